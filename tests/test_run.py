"""`ringlet run` / `python -m ringlet.run`: environment, output, failure and timeout handling."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import ringlet
from ringlet import cli, run as runmod

from _launchers import clean_env, clear_launcher



def _launch(*args, timeout=60, **kw):
    return subprocess.run([sys.executable, "-m", "ringlet.run", *args], env=clean_env(),
                          capture_output=True, text=True, timeout=timeout, **kw)


ECHO_ENV = textwrap.dedent("""
    import os, sys
    keys = ["RINGLET_RANK", "RINGLET_WORLD_SIZE", "RINGLET_LOCAL_RANK", "RINGLET_LOCAL_WORLD_SIZE",
            "RINGLET_MASTER_ADDR", "RINGLET_EXTERNAL_STORE"]
    print("env", *[os.environ[k] for k in keys])
    print("secret-len", len(os.environ["RINGLET_SECRET"]))
    print("to-stderr", os.environ["RINGLET_RANK"], file=sys.stderr)
""")


def test_ranks_get_their_environment_and_prefixed_output():
    out = _launch("-n", "3", sys.executable, "-c", ECHO_ENV)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for r in range(3):
        assert f"[{r}] env {r} 3 {r} 3 127.0.0.1 1" in lines
        assert f"[{r}] secret-len 64" in lines
        # stderr stays on stderr
        assert f"[{r}] to-stderr {r}" in out.stderr.splitlines()
        assert f"to-stderr {r}" not in out.stdout
    assert len(lines) == 6
    assert "RINGLET_SECRET" not in out.stdout + out.stderr


def test_the_store_the_launcher_serves_is_usable_and_authenticated(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os
        from ringlet.store import Store
        e = os.environ
        st = Store(e["RINGLET_MASTER_ADDR"], int(e["RINGLET_MASTER_PORT"]),
                   secret=e["RINGLET_SECRET"].encode(), timeout=30)
        n = int(e["RINGLET_WORLD_SIZE"])
        st.set("rank/" + e["RINGLET_RANK"], b"here")
        st.wait([f"rank/{r}" for r in range(n)], timeout=30)
        print("total", st.add("count", 1) <= n, len(st.job_id))
    """))
    out = _launch("-n", "4", str(script))  # a .py runs with this Python
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [f"[{r}] total True 16" for r in range(4)]
    # The secret is only in the children's environment, never printed.
    assert "secret" not in out.stderr.lower()


def test_module_mode_and_no_prefix(tmp_path):
    pkg = tmp_path / "mymod.py"
    # One write per line: without prefixes the ranks share the pipe, and print()
    # under PYTHONUNBUFFERED=1 writes each argument separately, so lines of two
    # ranks could interleave.
    pkg.write_text("import os, sys\n"
                   "sys.stdout.write(f\"mod {os.environ['RINGLET_RANK']} {sys.argv[1:]}\\n\")\n")
    env = clean_env()
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    out = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "2", "--no-prefix", "-m",
                          "mymod", "--lr", "0.1"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["mod 0 ['--lr', '0.1']", "mod 1 ['--lr', '0.1']"]


def test_failing_rank_sets_exit_code_and_stops_sleeping_siblings(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        from ringlet.store import Store
        e = os.environ
        r = int(e["RINGLET_RANK"])
        st = Store(e["RINGLET_MASTER_ADDR"], int(e["RINGLET_MASTER_PORT"]),
                   secret=e["RINGLET_SECRET"].encode(), timeout=30)
        if r == 1:
            # Fail only once the siblings are up, so they really are sleeping.
            st.wait(["up/0", "up/2"], timeout=30)
            print("failing now", flush=True)
            sys.exit(7)
        st.set(f"up/{r}", b"")
        time.sleep(120)
    """))
    grace = 2.0
    t0 = time.monotonic()
    out = _launch("-n", "3", "--grace", str(grace), str(script), timeout=60)
    elapsed = time.monotonic() - t0
    assert out.returncode == 7, out.stdout + out.stderr
    assert "[1] failing now" in out.stdout
    assert "rank 1 failed first (exit code 7)" in out.stderr
    # Siblings die on SIGTERM right away; well inside grace + startup margin.
    assert elapsed < grace + 10, elapsed
    assert "SIGKILL" not in out.stderr


def test_siblings_ignoring_sigterm_are_killed_after_grace(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        from ringlet.store import Store
        e = os.environ
        st = Store(e["RINGLET_MASTER_ADDR"], int(e["RINGLET_MASTER_PORT"]),
                   secret=e["RINGLET_SECRET"].encode(), timeout=30)
        if e["RINGLET_RANK"] == "0":
            st.wait(["ignoring"], timeout=30)
            sys.exit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        st.set("ignoring", b"")
        time.sleep(120)
    """))
    t0 = time.monotonic()
    out = _launch("-n", "2", "--grace", "0.5", str(script), timeout=60)
    assert out.returncode == 3, out.stderr
    assert "sending SIGKILL" in out.stderr
    assert time.monotonic() - t0 < 0.5 + 10


def test_ranks_lead_their_own_group_in_the_launchers_session():
    # A session of its own would be a scheduler autogroup of its own, where a
    # rank waiting for a peer on its core keeps half that core (run.py).
    code = ("import os, signal; print('ids', os.getpid(), os.getpgid(0), os.getsid(0), "
            "os.getppid(), signal.getsignal(signal.SIGTTOU) == signal.SIG_IGN)")
    out = _launch("-n", "2", sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    rows = [line.split()[2:] for line in out.stdout.splitlines() if " ids " in line]
    assert len(rows) == 2
    for pid, pgid, sid, ppid, ttou_ignored in rows:
        assert pgid == pid  # killpg reaches the rank and whatever it starts
        # The launcher runs in the session `_launch` started it in: ours.
        assert int(sid) == (os.getsid(0) if sys.version_info >= (3, 11) else int(pid))
        if sys.platform.startswith("linux"):
            assert ttou_ignored == "True"
    assert runmod.own_process_group() == (
        {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True})


def test_rank_killed_by_signal_reports_128_plus_signum():
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL) if os.environ['RINGLET_RANK']" \
           " == '1' else __import__('time').sleep(120)"
    out = _launch("-n", "2", "--grace", "1", sys.executable, "-c", code)
    assert out.returncode == 128 + signal.SIGKILL
    assert "rank 1 failed first (killed by SIGKILL" in out.stderr


def test_timeout_stops_everything_with_124():
    t0 = time.monotonic()
    out = _launch("-n", "2", "--timeout", "1", "--grace", "1", sys.executable, "-c",
                  "import time; print('up', flush=True); time.sleep(120)")
    assert out.returncode == 124, out.stderr
    assert "timed out after 1s" in out.stderr
    assert time.monotonic() - t0 < 1 + 1 + 10


def test_sigint_to_the_launcher_reaches_every_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import time
        print("up", flush=True)
        try:
            time.sleep(120)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise SystemExit(1)
    """))
    p = subprocess.Popen([sys.executable, "-m", "ringlet.run", "-n", "2", str(script)],
                         env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = set()
        deadline = time.monotonic() + 30
        while len(seen) < 2 and time.monotonic() < deadline:
            line = p.stdout.readline()  # ranks print "up" once they can be interrupted
            if line.endswith("up\n"):
                seen.add(line.split()[0])
        assert seen == {"[0]", "[1]"}
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "[0] interrupted" in rest and "[1] interrupted" in rest
    assert "received SIGINT" in err


def test_launcher_killed_with_sigkill_leaves_no_orphans(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    script = tmp_path / "job.py"
    script.write_text("import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-m", "ringlet.run", "-n", "2", str(script)],
                         env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    pids = []
    try:
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline:
            parts = p.stdout.readline().split()
            if len(parts) == 3 and parts[1] == "pid":
                pids.append(int(parts[2]))
        assert len(pids) == 2
    finally:
        p.kill()
        p.wait(30)

    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(_alive(pid) for pid in pids)


# ---- remote ranks (--hosts, --rsh) --------------------------------------------------------------
# ssh's model, on this host: `RSH HOST COMMAND...` runs the words as one shell command in a
# session of its own (sshd's), relaying the streams; interrupted or killed, it exits 255 and
# signals nothing (the remote command sees EOF on its stdin and nothing else).
_SSH_LIKE = textwrap.dedent("""
    import os, signal, subprocess, sys, threading
    p = subprocess.Popen(["/bin/sh", "-c", " ".join(sys.argv[2:])], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    def pump(src, dst, close):
        while True:
            data = os.read(src, 65536)
            if not data:
                break
            try:
                os.write(dst, data)
            except OSError:
                break
        if close:
            os.close(dst)

    threading.Thread(target=pump, args=(0, p.stdin.fileno(), True), daemon=True).start()
    outs = [threading.Thread(target=pump, args=(p.stdout.fileno(), 1, False), daemon=True),
            threading.Thread(target=pump, args=(p.stderr.fileno(), 2, False), daemon=True)]
    for t in outs:
        t.start()
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda *a: os._exit(255))
    rc = p.wait()
    for t in outs:
        t.join()
    os._exit(rc if rc >= 0 else 255)
""")
# `ringlet run` with "remotehost" taken for another host, served by the rsh above.
_LAUNCH_WITH_A_REMOTE_HOST = (
    "import sys\n"
    "import ringlet.run as r\n"
    "r._is_this_host = lambda h: h != 'remotehost'\n"
    "r._store_address = lambda hosts: '127.0.0.1'\n"
    "sys.exit(r.main(sys.argv[1:]))\n")
_WAITS_FOR_A_SIGNAL = textwrap.dedent("""
    import os, signal, sys, time
    if sys.argv[1] == "stubborn" and os.environ["RINGLET_RANK"] == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("up", os.getpid(), flush=True)
    try:
        time.sleep(120)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise SystemExit(1)
""")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie waiting for init to reap it is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _signal_a_job_with_a_remote_rank(tmp_path, sig, mode, grace):
    """Start rank 0 here and rank 1 on "remotehost", send ``sig`` to the launcher once
    both are up; returns (exit code, stdout, stderr, {rank: pid}, seconds to exit)."""
    rsh = tmp_path / "ssh_like.py"
    rsh.write_text(_SSH_LIKE)
    job = tmp_path / "job.py"
    job.write_text(_WAITS_FOR_A_SIGNAL)
    p = subprocess.Popen([sys.executable, "-c", _LAUNCH_WITH_A_REMOTE_HOST,
                          "--hosts", "localhost:1,remotehost:1",
                          "--rsh", f"{sys.executable} {rsh}", "--grace", str(grace),
                          str(job), mode],
                         env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        pids, lines = {}, []
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            line = p.stdout.readline()  # ranks print "up" once they can be signalled
            if not line:
                break
            lines.append(line)
            parts = line.split()
            if len(parts) == 3 and parts[1] == "up":
                pids[int(parts[0].strip("[]"))] = int(parts[2])
        assert sorted(pids) == [0, 1], lines + [p.stderr.read() if p.poll() is not None else ""]
        t0 = time.monotonic()
        p.send_signal(sig)
        rest, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    return p.returncode, "".join(lines) + rest, err, pids, took


def test_ctrl_c_reaches_a_remote_rank_as_sigint_and_its_last_words_arrive(tmp_path):
    # The launcher killed the remote shell; the agent saw only EOF and sent SIGTERM:
    # the rank's KeyboardInterrupt handler never ran and its output was cut off.
    code, out, err, pids, _ = _signal_a_job_with_a_remote_rank(tmp_path, signal.SIGINT,
                                                               "polite", 20)
    assert code == 130, err
    assert "[0] interrupted" in out and "[1] interrupted" in out, (out, err)
    assert not any(_alive(pid) for pid in pids.values()), pids


def test_a_remote_rank_ignoring_sigterm_is_gone_when_the_launcher_exits(tmp_path):
    # The launcher returned at once (its remote shell died); the remote rank lived on
    # for --grace before its agent killed it, out of the launcher's sight.
    code, out, err, pids, took = _signal_a_job_with_a_remote_rank(tmp_path, signal.SIGTERM,
                                                                  "stubborn", 2)
    assert code == 128 + signal.SIGTERM, err
    assert not _alive(pids[1]) and not _alive(pids[0]), (pids, err)
    assert "rank(s) [1] still running 2s after being asked to stop; sending SIGKILL" in err, err
    assert took < 2 + 10, took


# ---- argument handling (in-process) -------------------------------------------------------------
def test_split_argv_keeps_program_options_for_the_program():
    split = runmod._split_argv
    assert split(["-n", "2", "train.py", "-n", "5"]) == (["-n", "2"], None, ["train.py", "-n", "5"])
    assert split(["-n2", "--grace=1", "-m", "pkg.mod", "--x"]) == \
        (["-n2", "--grace=1"], "pkg.mod", ["--x"])
    assert split(["--nproc", "2", "--", "-weird-prog", "a"]) == \
        (["--nproc", "2"], None, ["-weird-prog", "a"])
    with pytest.raises(SystemExit, match="unknown option"):
        split(["-n", "2", "--bogus", "x.py"])


def test_bad_launcher_arguments(capsys):
    assert runmod.main(["-n", "2"]) == 2
    assert "no program" in capsys.readouterr().err
    assert runmod.main(["-n", "2", "definitely-not-a-program-xyz"]) == 127
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        runmod.main(["-n", "0", "x.py"])
    assert ei.value.code == 2
    with pytest.raises(SystemExit):
        runmod.main(["x.py"])  # -n is required


def test_launcher_numbers_and_rsh_are_checked(capsys):
    # NaN passed every check: --timeout nan spun the launcher, --grace nan never killed.
    for args, why in ((["--grace", "nan"], "--grace must be a finite number"),
                      (["--timeout", "nan"], "--timeout must be a finite positive"),
                      (["--timeout", "inf"], "--timeout must be a finite positive"),
                      (["--hosts", "localhost:1", "--rsh", "ssh -o 'x"],
                       "No closing quotation")):
        with pytest.raises(SystemExit) as ei:
            runmod.main(["-n", "1", *args, "x.py"] if "--hosts" not in args else [*args, "x.py"])
        assert ei.value.code == 2, args
        assert why in capsys.readouterr().err, args


def test_ssh_never_prompts_and_times_out_its_connection(tmp_path, monkeypatch):
    # A host that asked for a password or a host key stopped the rank on a prompt nobody
    # could answer, and a host that dropped packets took about two minutes.
    ssh = tmp_path / "ssh"
    ssh.write_text("#!/bin/sh\nexit 255\n")
    ssh.chmod(0o755)
    seen = []
    job = str(tmp_path / "x.py")
    (tmp_path / "x.py").write_text("pass\n")

    class Capture:
        def __init__(self, n, cmd, **kw):
            seen.append(kw["rsh"])

        def run(self):
            return 0

    monkeypatch.setattr(runmod, "_Launcher", Capture)
    assert runmod.main(["--hosts", "localhost:1,elsewhere:1", "--rsh", str(ssh), job]) == 0
    assert seen[-1] == [str(ssh), "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    assert runmod.main(["--hosts", "localhost:1,elsewhere:1", "--rsh",
                        f"{ssh} -o ConnectTimeout=3", job]) == 0
    assert seen[-1][:3] == [str(ssh), "-o", "ConnectTimeout=3"]  # the user's first: it wins
    other = tmp_path / "enter-ns"
    other.write_text("#!/bin/sh\nexit 0\n")
    other.chmod(0o755)
    assert runmod.main(["--hosts", "localhost:1,elsewhere:1", "--rsh", str(other), job]) == 0
    assert seen[-1] == [str(other)]  # not ssh: nothing added


def test_cli_info_and_usage(capsys, monkeypatch):
    clear_launcher(monkeypatch)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"ringlet {ringlet.__version__}" in out
    assert "launch: none detected" in out
    assert "numpy " in out and "core" in out
    assert cli.main([]) == 2
    with pytest.raises(SystemExit):
        cli.main(["frobnicate"])


def test_cli_info_under_a_real_launcher(tmp_path):
    # `ringlet info` in each rank of a real mpirun: what it reports is what Open MPI set.
    from _launchers import openmpi_env, openmpi_mpirun

    info = (f"{sys.executable} -c 'import sys; from ringlet.cli import main; "
            f"sys.exit(main([\"info\"]))' > {tmp_path}/$OMPI_COMM_WORLD_RANK.out")
    out = subprocess.run([openmpi_mpirun(), "-n", "2", "--oversubscribe", "sh", "-c", info],
                         env=openmpi_env(RINGLET_SECRET="do-not-print-this-secret"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(2):
        text = (tmp_path / f"{r}.out").read_text()
        assert f"launch: openmpi rank {r}/2 local " in text, text
        assert "master none (bootstrap through mpi4py)" in text, text
        assert f"env OMPI_COMM_WORLD_RANK={r}" in text and "secret: set" in text, text
        assert "env RINGLET_SECRET=<redacted>" in text, text
        assert "do-not-print-this-secret" not in text


def test_console_entry_point_runs_a_job():
    out = subprocess.run([sys.executable, "-c", "import sys; from ringlet.cli import main; "
                          "sys.exit(main(sys.argv[1:]))", "run", "-n", "2", sys.executable, "-c",
                          "import os; print('hi', os.environ['RINGLET_RANK'])"],
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[0] hi 0", "[1] hi 1"]


def test_cli_bench_missing_module_exits_2(capsys, monkeypatch):
    monkeypatch.delattr(ringlet, "bench", raising=False)
    monkeypatch.setitem(sys.modules, "ringlet.bench", None)  # as if it were not installed
    assert cli.main(["bench", "--anything"]) == 2
    assert "ringlet bench: the benchmark module is not available" in capsys.readouterr().err


def test_failed_first_is_the_rank_that_failed_not_the_first_to_exit(tmp_path):
    # Rank 2 raises; its exit handlers close its sockets, so ranks 1 and 3
    # fail on them and exit while rank 2 is still exiting (it lingers in an
    # exit handler until they are gone, which makes the order certain).  By
    # exit order rank 1 or 3 would be blamed; the job's failure record
    # (rank 1 or 3: peer 2 closed) names rank 2.
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import atexit, os, time
        pids = []

        def linger():
            if os.environ["RINGLET_RANK"] != "2":
                return
            deadline = time.monotonic() + 60
            for pid in pids:
                while time.monotonic() < deadline:
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.01)  # polls a condition (the peer's exit), with a deadline
            os._exit(3)

        atexit.register(linger)  # before ringlet's: runs after ringlet.shutdown()
        import numpy as np, ringlet
        ringlet.init(timeout=60)
        r = ringlet.get_rank()
        x = np.zeros(4, np.float64)
        x[r] = os.getpid()
        ringlet.all_reduce(x)  # every connection up; every rank learns every pid
        pids[:] = [int(p) for q, p in enumerate(x) if q != r]
        if r == 2:
            raise RuntimeError("rank 2 fails on purpose")
        ringlet.all_reduce(x)
    """))
    out = _launch("-n", "4", "--grace", "30", str(script), timeout=120)
    assert "rank 2 fails on purpose" in out.stderr
    assert "rank 2 failed first (exit code 3)" in out.stderr, out.stderr
    assert "rank 1 failed first" not in out.stderr and "rank 3 failed first" not in out.stderr
    assert out.returncode == 3, out.stderr


def test_a_blamed_rank_killed_after_grace_keeps_the_first_failures_exit_code(tmp_path):
    # Rank 2 fails and then hangs in an exit handler; the launcher SIGKILLs it after
    # --grace.  The job's code was that SIGKILL's 137, hiding the failure's own.
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import atexit, os, time

        def hang():
            if os.environ["RINGLET_RANK"] == "2":
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:  # stuck: only SIGKILL ends it
                    time.sleep(0.05)

        atexit.register(hang)  # before ringlet's: runs after ringlet.shutdown()
        import numpy as np, ringlet
        ringlet.init(timeout=60)
        r = ringlet.get_rank()
        x = np.zeros(4)
        ringlet.all_reduce(x)  # every connection up
        if r == 2:
            raise RuntimeError("rank 2 fails on purpose")
        ringlet.all_reduce(x)
    """))
    out = _launch("-n", "4", "--grace", "2", str(script), timeout=120)
    assert "rank 2 fails on purpose" in out.stderr
    assert "rank 2 failed first (it did not exit within --grace and was killed)" in out.stderr, \
        out.stderr
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])


def test_remote_agent_ends_what_the_rank_left_behind():
    # A rank that started `sleep &` and exited left the child holding the session's
    # output: ssh never exited, and the launcher waited on it without end.
    spec = {"env": {}, "argv": ["/bin/sh", "-c", "sleep 600 & echo started"], "grace": 1.0}
    p = subprocess.Popen([sys.executable, "-c", "from ringlet.run import _agent; _agent()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=clean_env())
    p.stdin.write(json.dumps(spec).encode() + b"\n")
    p.stdin.flush()  # stdin stays open: the launcher is still there
    out = []
    reader = threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True)
    reader.start()
    reader.join(60)
    try:
        assert not reader.is_alive(), "the session's output never closed"
        assert out[0].strip() == b"started" and p.wait(30) == 0
    finally:
        p.stdin.close()
        p.kill()


def test_parse_hosts():
    from ringlet.run import parse_hosts
    assert parse_hosts("node1:4,node2") == [("node1", 4), ("node2", 1)]
    for bad in ("", "a:0", "a:x", "a:2,a:1", "a b:1", ":3", "Node1:2,node1:2"):
        with pytest.raises(ValueError, match="--hosts"):
            parse_hosts(bad)
    # One machine under two names once gave two ranks the same local rank.
    with pytest.raises(ValueError, match="'localhost' and '127.0.0.1' are all this host"):
        parse_hosts("localhost:2,127.0.0.1:2")


def test_hosts_option_errors_before_starting_anything(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('started')\n")
    for args, why in ((["-n", "3", "--hosts", "localhost:2"], "places 2 ranks"),
                      ([], "give -n N or --hosts"),
                      (["--hosts", "localhost:1,elsewhere:1", "--rsh", "no-such-rsh-here"],
                       "not an executable on PATH")):
        out = _launch(*args, str(script))
        assert out.returncode == 2 and why in out.stderr, (args, out.stderr)
        assert "started" not in out.stderr


def test_blame_follows_a_chain_of_aborting_peers_to_the_rank_that_vanished():
    # rank 1 saw rank 3 abort, and rank 3 had lost rank 2: rank 2 failed first
    from ringlet.run import _root_cause
    nested = ("rank 1: all_reduce seq=2 peer 3 (127.0.0.1:1) after 0.001s: peer aborted the "
              "operation: [rank 3: all_reduce seq=2 peer 2 (127.0.0.1:2) after 0.001s: connection "
              "lost while receiving (Connection reset by peer): the peer exited, crashed or aborted]")
    assert _root_cause(1, 3, False, nested, 4) == 2
    # an aborting peer whose own reason is not a lost peer is itself the cause
    own = ("rank 1: all_reduce seq=2 peer 3 (127.0.0.1:1) after 0.001s: peer aborted the "
           "operation: [rank 3: all_reduce seq=2 peer 0 (127.0.0.1:2) after 30s: timed out]")
    assert _root_cause(1, 3, False, own, 4) == 3
    assert _root_cause(1, 3, True, "rank 1: lost: the peer exited, crashed or aborted", 4) == 3
    assert _root_cause(1, None, False, "rank 1: desync", 4) == 1
    assert _root_cause(1, 9, True, "rank 1: lost", 4) == 1  # a peer outside the job is ignored
    # a peer that closed its connection (EOF, not a reset) vanished too
    eof = ("rank 2: barrier seq=2 peer 0 (10.0.0.1:1) after 0.001s: peer aborted the operation: "
           "[rank 0: barrier seq=2 peer 3 (10.0.0.2:2) after 0.001s: the peer closed the "
           "connection (it exited, crashed or aborted)]")
    assert _root_cause(2, 0, False, eof, 4) == 3
    # over shared memory a peer vanishes as a closed communicator or a process gone
    for gone in ("the peer closed its communicator (shared memory)",
                 "the peer's process (pid 77) exited or was killed (shared memory)"):
        shm = ("rank 0: all_reduce seq=2 peer 1 (127.0.0.1:1) after 0.001s: peer aborted the "
               f"operation: [rank 1: all_reduce seq=2 peer 2 (127.0.0.1:2) after 0.001s: {gone}]")
        assert _root_cause(0, 1, False, shm, 4) == 2, gone
