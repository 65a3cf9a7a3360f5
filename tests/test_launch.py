"""Real launch paths: Open MPI's mpirun, MPICH's mpiexec, Slurm's srun, `ringlet run`,
torchrun-style variables (the real torchrun: tests/test_torch*.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from _launchers import SlurmCluster, clean_env, mpich, openmpi_env, openmpi_mpirun, slurm_binaries

SCRIPT = textwrap.dedent("""
    import numpy as np, ringlet
    g = ringlet.init(timeout=60)
    x = np.full(3, ringlet.get_rank() + 1, np.float32)
    ringlet.all_reduce(x)
    n = ringlet.get_world_size()
    assert np.all(x == n * (n + 1) / 2), x
    print(f"OK rank={ringlet.get_rank()} size={n} sum={x[0]:g}", flush=True)
    ringlet.shutdown()
""")


def _env(**extra):
    return clean_env(**extra)


# Each rank reports what detect() read from its real launcher, then runs a collective.
DETECT_SCRIPT = textwrap.dedent("""
    import json, os, sys, numpy as np, ringlet
    from ringlet.environment import detect
    e = detect()
    ringlet.init(timeout=60)
    x = np.arange(5, dtype=np.float64) * (ringlet.get_rank() + 1)
    ringlet.all_reduce(x)
    # A file per rank: launchers forward the ranks' stdout in chunks that can interleave.
    with open(os.path.join(sys.argv[1], f"{e.rank}.json"), "w") as f:
        json.dump(dict(vars(e), sum=x.tolist(), job=os.environ.get("SLURM_JOB_ID")), f)
    ringlet.shutdown()
""")


def _reports(out, tmp_path, n):
    assert out.returncode == 0, out.stdout + out.stderr
    reps = sorted((json.loads(p.read_text()) for p in tmp_path.glob("*.json")),
                  key=lambda r: r["rank"])
    assert [r["rank"] for r in reps] == list(range(n)), out.stdout + out.stderr
    want = (np.arange(5, dtype=np.float64) * (n * (n + 1) // 2)).tolist()
    for r in reps:
        assert r["sum"] == want and r["world_size"] == n and r["local_world_size"] == n, r
    # One host: the local ranks are 0..n-1, though not always in rank order (Open MPI 5
    # with --oversubscribe gives rank 1 local rank 2).
    assert sorted(r["local_rank"] for r in reps) == list(range(n)), reps
    return reps


def test_mpirun_sets_what_detect_reads(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(DETECT_SCRIPT)
    out = subprocess.run([openmpi_mpirun(), "-n", "3", "--oversubscribe", sys.executable,
                          str(script), str(tmp_path)], env=openmpi_env(),
                         capture_output=True, text=True, timeout=120)
    for r in _reports(out, tmp_path, 3):
        assert (r["source"], r["master_addr"], r["master_port"]) == ("openmpi", None, None)


def test_mpirun_with_a_stale_rank_and_world_size_fails_fast_and_says_why(tmp_path):
    # RANK=5 WORLD_SIZE=7 (and an address) left in the shell: under `mpirun -n 2`
    # both ranks took rank 5 of 7 and waited for a store nobody served until the
    # init timeout.  Now each rank stops at init and names both sets of variables.
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = openmpi_env(RANK="5", WORLD_SIZE="7", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    t0 = time.monotonic()
    out = subprocess.run([openmpi_mpirun(), "-n", "2", "--oversubscribe", sys.executable,
                          str(script)], env=env, capture_output=True, text=True, timeout=180)
    took = time.monotonic() - t0
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "OK rank=" not in text, text
    # mpirun kills the other rank once one exits non-zero, maybe before it printed.
    assert any(f"conflicting launcher variables: OMPI_COMM_WORLD_RANK={r}, "
               f"OMPI_COMM_WORLD_SIZE=2" in text for r in range(2)), text
    assert "RANK=5, WORLD_SIZE=7" in text, text
    assert took < 30, f"took {took:.1f} s: waited for the init timeout (60 s)?"


# MASTER_ADDR/MASTER_PORT left in the shell by an earlier torchrun session.  192.0.2.1 is
# TEST-NET-1: nothing answers there.  Each rank also keeps what init logged about them.
STALE = {"MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29500"}
STALE_SCRIPT = textwrap.dedent("""
    import json, logging, os, sys, numpy as np, ringlet
    from ringlet.environment import detect

    class Keep(logging.Handler):
        lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    log = logging.getLogger("ringlet")
    log.addHandler(Keep())
    log.setLevel(logging.DEBUG)
    e = detect()
    # Short: with the stale address honoured, init waited for a store there this long.
    ringlet.init(timeout=20)
    x = np.arange(5, dtype=np.float64) * (ringlet.get_rank() + 1)
    ringlet.all_reduce(x)
    with open(os.path.join(sys.argv[1], f"{e.rank}.json"), "w") as f:
        json.dump(dict(vars(e), sum=x.tolist(), job=os.environ.get("SLURM_JOB_ID"),
                       log=[ln for ln in Keep.lines if "MASTER_" in ln]), f)
    ringlet.shutdown()
""")


def _ignored_and_said_so(r, stale):
    names = tuple(f"{k}={v}" for k, v in stale.items())
    assert tuple(r["ignored"]) == names, r
    assert len(r["log"]) == 1 and r["log"][0].startswith(
        f"ringlet: rank {r['rank']}: {', '.join(names)} ignored: under {r['source']}"), r


@pytest.mark.parametrize("stale", [
    # With a secret set the old code rendezvoused at 192.0.2.1 until init's timeout.
    dict(STALE, RINGLET_SECRET="stale-master-addr-secret-0123"),
    # Only the address: the old code stopped at init, asking for MASTER_PORT.
    {"MASTER_ADDR": "192.0.2.1"},
], ids=["addr-port-secret", "addr-only"])
def test_mpirun_ignores_a_stale_master_addr(tmp_path, stale):
    script = tmp_path / "job.py"
    script.write_text(STALE_SCRIPT)
    out = subprocess.run([openmpi_mpirun(), "-n", "2", "--oversubscribe", sys.executable,
                          str(script), str(tmp_path)], env=openmpi_env(**stale),
                         capture_output=True, text=True, timeout=120)
    for r in _reports(out, tmp_path, 2):
        # The MPI bootstrap's own loopback store, not the stale address.
        assert (r["source"], r["master_addr"], r["master_port"]) == ("openmpi", None, None)
        _ignored_and_said_so(r, {k: v for k, v in stale.items() if k.startswith("MASTER_")})


def test_mpich_mpiexec_runs_a_job(tmp_path):
    # MPICH's hydra sets PMI_RANK/PMI_SIZE and MPI_LOCALRANKID/MPI_LOCALNRANKS; with
    # mpi4py pointed at MPICH's libmpi, ringlet bootstraps through it.
    mpiexec, libmpi = mpich()
    script = tmp_path / "job.py"
    script.write_text(DETECT_SCRIPT)
    out = subprocess.run([mpiexec, "-n", "4", sys.executable, str(script), str(tmp_path)],
                         env=clean_env(MPI4PY_LIBMPI=libmpi), capture_output=True, text=True,
                         timeout=120)
    for r in _reports(out, tmp_path, 4):
        assert (r["source"], r["master_addr"], r["master_port"]) == ("mpich", None, None)


def test_mpich_mpiexec_with_explicit_address(tmp_path):
    # No MPI library in the ranks at all: the launcher's variables and a given address.
    mpiexec, _ = mpich()
    script = tmp_path / "job.py"
    script.write_text(DETECT_SCRIPT)
    for _attempt in range(3):
        port = _free_port()
        out = subprocess.run([mpiexec, "-n", "3", sys.executable, str(script), str(tmp_path)],
                             env=clean_env(RINGLET_MASTER_ADDR="127.0.0.1",
                                           RINGLET_MASTER_PORT=str(port)),
                             capture_output=True, text=True, timeout=120)
        if out.returncode == 0 or "Address already in use" not in out.stderr:
            break
    for r in _reports(out, tmp_path, 3):
        assert (r["source"], r["master_addr"], r["master_port"]) == ("mpich", "127.0.0.1", port)


def test_mpich_launcher_with_open_mpi_mpi4py_fails_fast(tmp_path):
    # A real mismatch: the venv's mpi4py loads Open MPI, whose ranks under MPICH's
    # mpiexec are worlds of one.  Each rank must say so at once, not time out.
    mpiexec, _ = mpich()
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, sys, ringlet
        try:
            ringlet.init(timeout=600)
        except ringlet.errors.RendezvousError as exc:
            with open(os.path.join(sys.argv[1], os.environ["PMI_RANK"] + ".err"), "w") as f:
                f.write(str(exc))
            sys.exit(3)
    """))
    # The run's deadline (300 s) is half init's timeout: a rank that waited instead of
    # failing fails the test.
    out = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script), str(tmp_path)],
                         env=clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    for r in range(2):
        err = (tmp_path / f"{r}.err").read_text()
        assert err.startswith(f"rank {r}: the launcher (mpich) started this process as rank "
                              f"{r} of 2 but MPI (Open MPI"), err
        assert "sees rank 0 of 1" in err and "MPI4PY_LIBMPI" in err, err


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    slurm_binaries()
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_srun_runs_a_job(slurm, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(DETECT_SCRIPT)
    out = subprocess.run(["srun", "-n", "4", "--overcommit", sys.executable, str(script),
                          str(tmp_path)],
                         env=dict(slurm.env, RINGLET_SECRET="slurm-test-secret-0123456789"),
                         capture_output=True, text=True, timeout=180)
    reps = _reports(out, tmp_path, 4)
    first = socket.getaddrinfo(slurm.host, None, 0, socket.SOCK_STREAM)
    first.sort(key=lambda i: i[0] != socket.AF_INET)
    for r in reps:
        job = int(r["job"])
        assert job >= slurm.first_job
        assert (r["source"], r["master_addr"], r["master_port"]) == \
            ("slurm", first[0][4][0], 20000 + job % 20000), r


def test_srun_ignores_a_stale_master_addr(slurm, tmp_path):
    # srun passes the submitting shell's environment on: a MASTER_ADDR exported for an
    # earlier torchrun job outvoted the step's first node, and init waited for its timeout.
    script = tmp_path / "job.py"
    script.write_text(STALE_SCRIPT)
    out = subprocess.run(["srun", "-n", "2", "--overcommit", sys.executable, str(script),
                          str(tmp_path)],
                         env=dict(slurm.env, RINGLET_SECRET="slurm-test-secret-0123456789",
                                  **STALE),
                         capture_output=True, text=True, timeout=180)
    first = socket.getaddrinfo(slurm.host, None, 0, socket.SOCK_STREAM)
    first.sort(key=lambda i: i[0] != socket.AF_INET)
    for r in _reports(out, tmp_path, 2):
        assert (r["source"], r["master_addr"], r["master_port"]) == \
            ("slurm", first[0][4][0], 20000 + int(r["job"]) % 20000), r
        _ignored_and_said_so(r, STALE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_style_environment(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    # torchrun hands every rank MASTER_PORT; rank 0 binds it.  The port is picked
    # here like torchrun's own default would be, so retry if someone took it.
    for _attempt in range(3):
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, str(script)], env=_env(
            RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), RINGLET_SECRET="torchrun-style-test-secret"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
        outs = [p.communicate(timeout=120) for p in procs]
        if all(p.returncode == 0 for p in procs):
            break
        if not any("Address already in use" in e for _, e in outs):
            break
    assert all(p.returncode == 0 for p in procs), outs
    lines = sorted(o.strip() for o, _ in outs)
    assert lines == [f"OK rank={r} size=3 sum=6" for r in range(3)]


def test_ringlet_run_launcher(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "4", str(script)],
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(4):
        assert f"OK rank={r} size=4 sum=10" in out.stdout
    assert "RINGLET_SECRET" not in out.stdout + out.stderr


def test_no_secret_off_loopback_is_refused(tmp_path):
    import ringlet
    from ringlet import _world
    from ringlet.errors import AuthenticationError

    # A non-loopback bind address with no secret must be refused before any connection.
    env_backup = {k: os.environ.pop(k) for k in ("RINGLET_SECRET", "RINGLET_SECRET_FILE",
                                                  "RINGLET_ALLOW_INSECURE") if k in os.environ}
    try:
        with pytest.raises(AuthenticationError, match="RINGLET_SECRET"):
            ringlet.init(rank=0, world_size=2, master_addr="10.255.255.1", master_port=1,
                         bind_addr="10.255.255.2", timeout=1)
    finally:
        os.environ.update(env_backup)
    assert not _world.is_initialized()


# Each rank writes its parent's pid and what RINGLET_PTRACER=parent did with the ranks'
# parents (the debug line), then runs a collective.
PTRACER_SCRIPT = textwrap.dedent("""
    import os, sys, numpy as np, ringlet
    ringlet.init(timeout=60)
    x = np.ones(4, np.float32)
    ringlet.all_reduce(x)
    assert np.all(x == ringlet.get_world_size()), x
    with open(os.path.join(sys.argv[1], f"{ringlet.get_rank()}.pid"), "w") as f:
        f.write(str(os.getppid()))
    ringlet.shutdown()
""")


@pytest.mark.parametrize("launcher", ["ringlet run", "mpirun"])
def test_ptracer_parent_is_the_launcher_every_rank_shares(tmp_path, launcher):
    # RINGLET_PTRACER=parent declares the ranks' common parent only under Yama's
    # ptrace_scope 1. Whatever this kernel has, each real launcher must give the ranks of
    # a host one parent, and every rank must learn all of them through init.
    from ringlet import _shm

    script = tmp_path / "job.py"
    script.write_text(PTRACER_SCRIPT)
    env = dict(RINGLET_PTRACER="parent", RINGLET_DEBUG="INFO")
    if launcher == "mpirun":
        cmd = [openmpi_mpirun(), "-n", "3", "--oversubscribe", sys.executable, str(script),
               str(tmp_path)]
        proc = subprocess.Popen(cmd, env=openmpi_env(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    else:
        cmd = [sys.executable, "-m", "ringlet.run", "-n", "3", str(script), str(tmp_path)]
        proc = subprocess.Popen(cmd, env=_env(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    parents = {int((tmp_path / f"{r}.pid").read_text()) for r in range(3)}
    assert len(parents) == 1, parents
    (parent,) = parents
    if launcher == "ringlet run":
        assert parent == proc.pid  # the trampoline execs the rank in the launcher's child
    scope = _shm.yama_ptrace_scope()
    lines = [ln for ln in (out + err).splitlines() if "RINGLET_PTRACER=parent" in ln]
    assert len(lines) == 3, out + err
    if scope == 1:
        want = f"declared this host's ranks' parent (pid {parent}) the ptracer"
    else:
        yama = "no Yama module" if scope is None else f"Yama ptrace_scope {scope}"
        want = f"no ptracer declared ({yama}; parents of this host's ranks [{parent}])"
    assert all(want in ln for ln in lines), (want, lines)
