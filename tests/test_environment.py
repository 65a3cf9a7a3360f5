"""Launcher detection, interface selection, the job secret and the MPI bootstrap."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import ringlet
from ringlet import environment as envmod
from ringlet.environment import (LaunchEnv, detect, is_loopback, load_secret, parse_nodelist,
                                 select_bind_address)
from ringlet.errors import RendezvousError
from _launchers import clean_env, clear_launcher, openmpi_mpirun



# ---- detect: each launcher -------------------------------------------------------------------
def test_nothing_set_is_none():
    assert detect({}) is None
    assert detect({"PATH": "/bin", "HOME": "/root"}) is None


def test_ringlet_variables():
    env = {"RINGLET_RANK": "2", "RINGLET_WORLD_SIZE": "4", "RINGLET_LOCAL_RANK": "0",
           "RINGLET_LOCAL_WORLD_SIZE": "2", "RINGLET_MASTER_ADDR": "10.0.0.1",
           "RINGLET_MASTER_PORT": "29500"}
    assert detect(env) == LaunchEnv(2, 4, 0, 2, "10.0.0.1", 29500, "ringlet")
    # Local rank/size default to the global ones (one host).
    assert detect({"RINGLET_RANK": "1", "RINGLET_WORLD_SIZE": "3"}) == \
        LaunchEnv(1, 3, 1, 3, None, None, "ringlet")


def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node1", "MASTER_PORT": "1234"}
    assert detect(env) == LaunchEnv(5, 8, 1, 4, "node1", 1234, "torchrun")


# Open MPI, MPICH and Slurm are checked under their real launchers (test_launch.py:
# test_mpirun_sets_what_detect_reads, test_mpich_*, test_srun_runs_a_job).  The Slurm
# cases below are the multi-node ones a one-host cluster cannot produce.
def test_slurm_multi_node_variables_and_overrides():
    # Several nodes (a step list unlike the job's, two tasks on each of two nodes): a
    # one-node test cluster cannot set these.
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_STEP_NODELIST": "localhost,node[2-3]", "SLURM_JOB_NODELIST": "other[1-9]",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1", "SLURM_JOB_ID": "123456"}
    e = detect(env)
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.source) == \
        (3, 4, 1, 2, "slurm")
    assert e.master_addr == "127.0.0.1"  # first node of the *step*, resolved
    assert e.master_port == 20000 + 123456 % 20000
    # A second step of the job, running beside the first, listens elsewhere.
    assert detect(dict(env, SLURM_STEP_ID="0")).master_port == 20000 + 123456 % 20000
    assert detect(dict(env, SLURM_STEP_ID="1")).master_port == 20000 + (123456 + 7919) % 20000
    # torch's pair, left in the shell or exported for torch's store: not Slurm's.
    env.update(MASTER_ADDR="10.9.9.9", MASTER_PORT="5555")
    e = detect(env)
    assert (e.master_addr, e.master_port) == ("127.0.0.1", 20000 + 123456 % 20000)
    assert e.ignored == ("MASTER_ADDR=10.9.9.9", "MASTER_PORT=5555")
    env.update(RINGLET_MASTER_ADDR="10.8.8.8", RINGLET_MASTER_PORT="6666")
    e = detect(env)
    assert (e.master_addr, e.master_port) == ("10.8.8.8", 6666)


def test_slurm_uneven_tasks_per_node():
    # Three nodes with 2, 2 and 1 tasks: multi-node, out of a one-node cluster's reach.
    env = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0",
           "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "localhost"}
    assert detect(env).local_world_size == 1


def test_slurm_master_that_does_not_resolve(monkeypatch):
    # A broken resolver on a real cluster: not reproducible on demand, so faked.
    def fail(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    with pytest.raises(RendezvousError, match=r"'gpu07'.*SLURM_JOB_NODELIST"):
        detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"})


def test_precedence_ringlet_over_torchrun_over_mpi_over_slurm():
    # Parsing logic: which of several launchers' variables wins (nested launches).
    ringlet_vars = {"RINGLET_RANK": "0", "RINGLET_WORLD_SIZE": "2"}
    # torchrun's own markers: it is then the launcher nested inside the others.
    torch_vars = {"RANK": "1", "WORLD_SIZE": "3", "TORCHELASTIC_RUN_ID": "none", "GROUP_RANK": "0"}
    ompi_vars = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}
    mpich_vars = {"PMI_RANK": "3", "PMI_SIZE": "5"}
    slurm_vars = {"SLURM_PROCID": "4", "SLURM_NTASKS": "6", "SLURM_JOB_NODELIST": "localhost"}
    layers = [ringlet_vars, torch_vars, ompi_vars, mpich_vars, slurm_vars]
    expected = ["ringlet", "torchrun", "openmpi", "mpich", "slurm"]
    for i, source in enumerate(expected):
        env = {}
        for layer in layers[i:]:
            env.update(layer)
        e = detect(env)
        assert e.source == source and e.rank == i and e.world_size == i + 2


@pytest.mark.parametrize("mpi", [
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
    {"PMI_RANK": "1", "PMI_SIZE": "2"},
])
def test_a_stale_rank_and_world_size_never_outvote_the_mpi_launcher(mpi):
    # RANK=5 WORLD_SIZE=7 left in the shell, then `mpirun -n 2`: both ranks took
    # rank 5 of 7 and waited for ranks that never came.
    (rank_var, rank), (size_var, size) = mpi.items()
    stale = {"RANK": "5", "WORLD_SIZE": "7", "LOCAL_RANK": "5"}
    with pytest.raises(ValueError) as info:
        detect(dict(mpi, **stale))
    msg = str(info.value)
    assert "conflicting launcher variables" in msg
    assert f"{rank_var}=1, {size_var}=2" in msg and "RANK=5, WORLD_SIZE=7" in msg
    assert "RINGLET_RANK" in msg  # says how to choose explicitly
    # The same numbering twice (a wrapper that copies MPI's) is no conflict.
    e = detect(dict(mpi, RANK=rank, WORLD_SIZE=size))
    assert (e.rank, e.world_size) == (1, 2)
    # torchrun's markers: torchrun started this process, under mpirun (one per node).
    e = detect(dict(mpi, **dict(stale, WORLD_SIZE="8"), TORCHELASTIC_RUN_ID="job7"))
    assert (e.source, e.rank, e.world_size) == ("torchrun", 5, 8)
    e = detect(dict(mpi, **dict(stale, WORLD_SIZE="8"), GROUP_RANK="1"))
    assert (e.source, e.rank, e.world_size) == ("torchrun", 5, 8)
    # An explicit choice wins over both.
    e = detect(dict(mpi, **stale, RINGLET_RANK="0", RINGLET_WORLD_SIZE="3"))
    assert (e.source, e.rank, e.world_size) == ("ringlet", 0, 3)
    # Half a pair still gives way to the launcher's complete one.
    e = detect(dict(mpi, WORLD_SIZE="7"))
    assert (e.rank, e.world_size) == (1, 2)


@pytest.mark.parametrize("mpi", [
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
    {"PMI_RANK": "1", "PMI_SIZE": "2"},
])
def test_master_addr_counts_only_beside_the_variables_it_belongs_with(mpi):
    # MASTER_ADDR/MASTER_PORT left from a torchrun session, then `mpirun -n 2`: each
    # rank skipped the MPI bootstrap and waited for a store at the stale address
    # until init's timeout.  Under MPI only RINGLET_MASTER_* choose the address.
    stale = {"MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29500"}
    e = detect(dict(mpi, **stale))
    assert (e.master_addr, e.master_port) == (None, None)  # init bootstraps over MPI
    assert e.ignored == ("MASTER_ADDR=192.0.2.1", "MASTER_PORT=29500")
    note = envmod.ignored_note(e)
    assert "MASTER_ADDR=192.0.2.1, MASTER_PORT=29500 ignored" in note
    assert "RINGLET_MASTER_ADDR and RINGLET_MASTER_PORT" in note
    # One of the pair alone is passed over too (it made init demand the other).
    assert detect(dict(mpi, MASTER_ADDR="192.0.2.1")).master_addr is None
    assert detect(dict(mpi, MASTER_PORT="29500")).master_port is None
    # Ignored means not read: a malformed one does not stop the job.
    assert detect(dict(mpi, MASTER_PORT="http")).ignored == ("MASTER_PORT=http",)
    # The explicit choice counts.
    e = detect(dict(mpi, **stale, RINGLET_MASTER_ADDR="10.0.0.7", RINGLET_MASTER_PORT="4242"))
    assert (e.master_addr, e.master_port) == ("10.0.0.7", 4242)
    # Where RANK/WORLD_SIZE count, their MASTER_* do: torchrun nested in mpirun, a
    # wrapper (or `import ringlet.torch`) that copies MPI's numbering, plain env://.
    nested = dict(mpi, RANK="3", WORLD_SIZE="4", TORCHELASTIC_RUN_ID="j", **stale)
    copied = dict(mpi, RANK="1", WORLD_SIZE="2", **stale)
    for env in (nested, copied, dict(stale, RANK="1", WORLD_SIZE="2"),
                dict(stale, RINGLET_RANK="1", RINGLET_WORLD_SIZE="2")):
        e = detect(env)
        assert (e.master_addr, e.master_port, e.ignored) == ("192.0.2.1", 29500, ()), env
    assert envmod.ignored_note(e) == "" and envmod.ignored_note(None) == ""


def test_a_hand_set_rank_wins_over_a_slurm_shell():
    # `srun --pty bash` (and a batch script) carry a one-task step's variables for a
    # shell that may start ranks by hand: those are the job's.
    shell = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "localhost"}
    e = detect(dict(shell, RANK="1", WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"))
    assert (e.source, e.rank, e.world_size) == ("torchrun", 1, 2)


def test_a_half_set_pair_gives_way_to_a_complete_later_launcher():
    # An sbatch script's `export WORLD_SIZE=$SLURM_NTASKS` stopped every srun task
    # with "WORLD_SIZE is set but RANK is not" though Slurm's variables were complete.
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost"}
    e = detect(dict(slurm, WORLD_SIZE="2"))
    assert (e.source, e.rank, e.world_size) == ("slurm", 1, 2)
    with pytest.raises(ValueError, match="WORLD_SIZE is set but RANK is not"):
        detect({"WORLD_SIZE": "2"})  # nothing complete to fall back on


# ---- detect: malformed values ----------------------------------------------------------------
@pytest.mark.parametrize("env, var", [
    ({"RINGLET_RANK": "one", "RINGLET_WORLD_SIZE": "2"}, "RINGLET_RANK"),
    ({"RINGLET_RANK": "2", "RINGLET_WORLD_SIZE": "2"}, "RINGLET_RANK"),
    ({"RINGLET_RANK": "-1", "RINGLET_WORLD_SIZE": "2"}, "RINGLET_RANK"),
    ({"RINGLET_RANK": "0", "RINGLET_WORLD_SIZE": "0"}, "RINGLET_WORLD_SIZE"),
    ({"RINGLET_RANK": "0"}, "RINGLET_WORLD_SIZE"),
    ({"WORLD_SIZE": "4"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK"),
    ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_RANK"),
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, "PMI_RANK"),
    ({"SLURM_PROCID": "0"}, "SLURM_NTASKS"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2(y2)"},
     "SLURM_TASKS_PER_NODE"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-"},
     "SLURM_JOB_NODELIST"),
])
def test_malformed_values_name_the_variable(env, var):
    with pytest.raises(ValueError, match=var):
        detect(env)


# ---- Slurm host lists --------------------------------------------------------------------------
@pytest.mark.parametrize("spec, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a,b[8-10]", ["a", "b8", "b9", "b10"]),
    ("gpu-[009-011]", ["gpu-009", "gpu-010", "gpu-011"]),
    ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    (" x , y ", ["x", "y"]),
])
def test_parse_nodelist(spec, hosts):
    assert parse_nodelist(spec) == hosts


@pytest.mark.parametrize("spec", ["n[1-2", "n1-2]", "n[[1]]", "n[a-b]", "n[3-1]", "n[]"])
def test_parse_nodelist_rejects_malformed(spec):
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        parse_nodelist(spec, "SLURM_JOB_NODELIST")


# ---- addresses -----------------------------------------------------------------------------
def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("127.3.2.1") and is_loopback("localhost")
    assert is_loopback("::1") and is_loopback("::ffff:127.0.0.1") and is_loopback("[::1]")
    assert not is_loopback("10.0.0.1") and not is_loopback("8.8.8.8") and not is_loopback("")
    assert not is_loopback(None)
    assert not is_loopback("no-such-host.invalid")


def test_select_bind_address_loopback_cases():
    assert select_bind_address(None) == "127.0.0.1"
    assert select_bind_address("127.0.0.1") == "127.0.0.1"
    assert select_bind_address("localhost") == "127.0.0.1"


def test_select_bind_address_with_ifname():
    assert select_bind_address(None, "lo") == "127.0.0.1"
    assert select_bind_address(None, "=lo") == "127.0.0.1"
    ifaces = envmod.list_interfaces()
    assert ("lo", "127.0.0.1") in ifaces
    others = [a for n, a in ifaces if n != "lo"]
    if others:
        assert select_bind_address(None, "^lo") == others[0]
        assert select_bind_address(None, "^=lo") == others[0]
    else:
        with pytest.raises(RendezvousError):
            select_bind_address(None, "^lo")
    with pytest.raises(RendezvousError, match=r"=nonexistent.*interfaces seen:.*lo=127\.0\.0\.1"):
        select_bind_address(None, "=nonexistent")
    with pytest.raises(RendezvousError, match="matches no interface"):
        select_bind_address(None, "=l")  # exact, so not a prefix of "lo"


def test_multi_host_never_falls_back_to_loopback():
    # An unroutable documentation address stands in for another host.
    with pytest.raises(RendezvousError, match="loopback"):
        select_bind_address("192.0.2.200", "lo")
    ifaces = [a for n, a in envmod.list_interfaces() if not is_loopback(a)]
    if not ifaces:
        pytest.skip("no non-loopback interface on this machine")
    try:
        addr = select_bind_address("192.0.2.200")
    except RendezvousError as exc:
        assert "no route" in str(exc)
    else:
        assert not is_loopback(addr) and addr in ifaces


def test_select_bind_address_with_fake_interfaces(monkeypatch):
    # Interface names this host lacks: the real ones (network namespaces, other hosts)
    # are the multi-host test bed's (docs/testing.md).
    fake = [("lo", "127.0.0.1"), ("docker0", "172.17.0.1"), ("eth0", "10.0.0.5"),
            ("ib0", "10.1.0.5")]
    monkeypatch.setattr(envmod, "list_interfaces", lambda: fake)
    assert select_bind_address(None, "ib") == "10.1.0.5"
    assert select_bind_address(None, "eth,ib") == "10.0.0.5"
    assert select_bind_address(None, "^docker,lo") == "10.0.0.5"
    assert select_bind_address(None, "^docker") == "10.0.0.5"  # non-loopback first
    assert select_bind_address(None, "=eth0") == "10.0.0.5"
    with pytest.raises(RendezvousError, match="docker0=172.17.0.1"):
        select_bind_address(None, "=eth")


# ---- the secret ---------------------------------------------------------------------------------
def test_load_secret_from_variable():
    assert load_secret({}) is None
    for empty in ("", "  "):
        # Set but empty is a mistake (an unset shell variable), never "no secret".
        with pytest.raises(ValueError, match="RINGLET_SECRET is set but empty"):
            load_secret({"RINGLET_SECRET": empty})
    assert load_secret({"RINGLET_SECRET": "a" * 16}) == b"a" * 16
    assert load_secret({"RINGLET_SECRET": "ü" * 8}) == "ü".encode() * 8  # 16 UTF-8 bytes
    with pytest.raises(ValueError, match="at least 16") as ei:
        load_secret({"RINGLET_SECRET": "short-secret"})
    assert "short-secret" not in str(ei.value)


def test_load_secret_from_file(tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(b"  file-secret-0123456789\n")
    os.chmod(f, 0o600)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_secret({"RINGLET_SECRET_FILE": str(f)}) == b"file-secret-0123456789"
    os.chmod(f, 0o644)
    with pytest.warns(UserWarning, match="chmod 600"):
        assert load_secret({"RINGLET_SECRET_FILE": str(f)}) == b"file-secret-0123456789"
    # The variable wins over the file.
    assert load_secret({"RINGLET_SECRET": "v" * 20, "RINGLET_SECRET_FILE": str(f)}) == b"v" * 20
    with pytest.raises(ValueError, match="cannot be read"):
        load_secret({"RINGLET_SECRET_FILE": str(tmp_path / "missing")})
    short = tmp_path / "short"
    short.write_bytes(b"tiny\n")
    os.chmod(short, 0o600)
    with pytest.raises(ValueError, match="at least 16"):
        load_secret({"RINGLET_SECRET_FILE": str(short)})


# ---- MPI bootstrap --------------------------------------------------------------------------------
def test_mpi_bootstrap_without_mpi4py_says_what_to_do(monkeypatch):
    clear_launcher(monkeypatch)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `from mpi4py import MPI` fail
    with pytest.raises(ImportError, match=r"pip install mpi4py.*RINGLET_MASTER_ADDR") as info:
        envmod.mpi_bootstrap(5.0)
    assert "ignored" not in str(info.value)
    # A MASTER_ADDR that used to stand in for the bootstrap: the error says it did not.
    for k, v in (("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2"),
                 ("MASTER_ADDR", "192.0.2.1")):
        monkeypatch.setenv(k, v)
    with pytest.raises(ImportError, match=r"pip install mpi4py.*\(MASTER_ADDR=192\.0\.2\.1 "
                                          r"ignored: under openmpi"):
        envmod.mpi_bootstrap(5.0)


def test_mpi_bootstrap_under_mpirun(tmp_path):
    script = tmp_path / "boot.py"
    script.write_text(textwrap.dedent("""
        from ringlet.environment import detect, mpi_bootstrap
        from ringlet.store import Store
        rank, size, addr, port, secret, server = mpi_bootstrap(60.0)
        assert (server is not None) == (rank == 0)
        with Store(addr, port, secret=secret, timeout=30) as st:
            st.set(f"r{rank}", b"x")
            st.wait([f"r{i}" for i in range(size)], timeout=30)
            st.add("done", 1)
            print(f"BOOT rank={rank} size={size} addr={addr} secret={len(secret)} "
                  f"source={detect().source}", flush=True)
            if server is not None:
                st.wait(["bye"], timeout=30)
            else:
                if st.add("left", 1) == size - 1:
                    st.set("bye", b"")
        if server is not None:
            server.close()
    """))
    env = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run([openmpi_mpirun(), "-n", "3", "--oversubscribe", sys.executable, str(script)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = sorted(l for l in out.stdout.splitlines() if l.startswith("BOOT"))
    assert lines == [f"BOOT rank={r} size=3 addr=127.0.0.1 secret=32 source=openmpi"
                     for r in range(3)]


# ---- ranks that lead sessions of their own on a shared core ---------------------------------
@pytest.mark.parametrize("autogroups,leader,cpus,local,warns", [
    ("1", True, 2, 4, True),
    ("0", True, 2, 4, False),    # no autogroups: a yield reaches every task
    ("1", False, 2, 4, False),   # in the launcher's session (ringlet run, mpirun)
    ("1", True, 4, 4, False),    # a core per rank: nobody waits for a core
    ("1", True, 2, 1, False),
])
def test_own_session_note(monkeypatch, tmp_path, autogroups, leader, cpus, local, warns):
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("needs os.sched_getaffinity (Linux)")
    sysctl = tmp_path / "sched_autogroup_enabled"
    sysctl.write_text(autogroups + "\n")
    monkeypatch.setattr(envmod, "_AUTOGROUP_SYSCTL", str(sysctl))
    monkeypatch.setattr(envmod.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(envmod.os, "getsid", lambda pid: os.getpid() if leader else 1)
    note = envmod.own_session_note(local)
    if warns:
        assert f"{local} ranks on this host share {cpus} CPU(s)" in note
        assert "ringlet run" in note and "sched_autogroup_enabled=0" in note
    else:
        assert note is None
    monkeypatch.setattr(envmod, "_AUTOGROUP_SYSCTL", str(tmp_path / "missing"))
    assert envmod.own_session_note(local) is None  # no such kernel knob: nothing to say


@pytest.mark.parametrize("launcher", ["mpich", "openmpi"])
def test_init_warns_ranks_in_sessions_of_their_own(tmp_path, launcher):
    # Two ranks pinned to one CPU under real launchers: MPICH's mpiexec starts each
    # rank as a session leader (as torchrun does), so init warns exactly when the
    # kernel has autogroups; Open MPI's mpirun keeps its ranks in one session: never.
    from _launchers import mpich, openmpi_env

    if not hasattr(os, "sched_setaffinity") or not os.path.exists(envmod._AUTOGROUP_SYSCTL):
        pytest.skip("needs Linux with scheduler autogroups")
    with open(envmod._AUTOGROUP_SYSCTL) as f:
        autogroups = f.read().strip() == "1"
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import os, sys, warnings
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        import ringlet
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ringlet.init(timeout=60)
        ringlet.barrier()
        with open(os.path.join(sys.argv[1], f"{ringlet.get_rank()}.out"), "w") as f:
            f.write(f"LEADER {os.getsid(0) == os.getpid()} WARNED "
                    f"{any('leads a session of its own' in str(w.message) for w in seen)}")
        ringlet.shutdown()
    """))
    if launcher == "mpich":
        mpiexec, libmpi = mpich()
        argv, env, leader = [mpiexec, "-n", "2"], clean_env(MPI4PY_LIBMPI=libmpi), True
    else:
        argv, env, leader = [openmpi_mpirun(), "-n", "2", "--oversubscribe"], openmpi_env(), False
    out = subprocess.run(argv + [sys.executable, str(script), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(2):
        assert (tmp_path / f"{r}.out").read_text() == \
            f"LEADER {leader} WARNED {autogroups and leader}"


def test_spin_yield_follows_oversubscription(monkeypatch):
    from ringlet import _core, _world

    monkeypatch.setattr(_world.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert [_world._spin_yield_policy(n) for n in (1, 2, 3, 8)] == [0, 0, 1, 1]
    for var in ("RINGLET_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID",
                "WORLD_SIZE", "RINGLET_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                "SLURM_NTASKS", "RINGLET_SPIN_YIELD"):
        monkeypatch.delenv(var, raising=False)
    saved = _core.get_tuning()
    try:
        _core.set_tuning(spin_yield=1)
        ringlet.init()  # a world of one: no more ranks than CPUs, so no yield
        ringlet.shutdown()
        assert _core.get_tuning()["spin_yield"] == 0
        monkeypatch.setenv("RINGLET_SPIN_YIELD", "1")  # the variable wins over the policy
        ringlet.init()
        ringlet.shutdown()
        assert _core.get_tuning()["spin_yield"] == 1
    finally:
        _core.set_tuning(**saved)


# ---- congestion control of same-host connections (local_reno) --------------------------------
def _congestion_by_ports():
    """{(local port, peer port): congestion control} of this process's TCP connections."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = os.dup(int(name))
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)  # not a socket
            continue
        with s:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                peer = s.getpeername()
            except OSError:
                continue  # a listener
            cc = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
            out[(s.getsockname()[1], peer[1])] = cc.split(b"\0")[0].decode()
    return out


def _ring_connections(rank, P):
    from ringlet import _world

    x = np.ones(1000, np.float32)
    ringlet.all_reduce(x)  # a ring: every rank connects to its neighbours
    ringlet.barrier()
    seen = _congestion_by_ports() if rank == 0 else None
    ringlet.barrier()
    return _world._current().ctx.port, seen


@pytest.mark.parametrize("reno", [1, 0])
def test_same_host_connections_use_reno(reno, monkeypatch):
    # Thread ranks share this process, so rank 0 sees both ends of every
    # connection; ringlet's are those with a rank's listening port at one end.
    # Over TCP: same-host collectives would otherwise open no connection at all.
    monkeypatch.setenv("RINGLET_TRANSPORT", "tcp")
    from ringlet import _core
    from ringlet.testing import run_world

    saved = _core.get_tuning()
    assert saved["local_reno"] == 1  # the default
    try:
        _core.set_tuning(local_reno=reno)
        results = run_world(_ring_connections, 3, timeout=60)
    finally:
        _core.set_tuning(**saved)
    ports = {port for port, _ in results}
    ours = {k: cc for k, cc in results[0][1].items() if k[0] in ports or k[1] in ports}
    assert len(ours) >= 6, ours  # 3 connections, both ends
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        default = f.read().strip()
    assert set(ours.values()) == {"reno" if reno else default}, (ours, default)
