"""Jobs across hosts, on the multi-host test bed (``ringlet.testbed.HostBed``).

Each host is a network namespace with its own host name, joined to the others
by veths through a bridge.  Ranks start on their hosts the ways users start
them (the env contract, ``ringlet run --hosts``, ``mpirun`` with a hostfile);
each writes what it found to a file of its own (tests/_multihost_job.py).
Faults are real: a link set down, a host's ranks SIGKILLed or SIGSTOPped.
Skipped, with the reason, where namespaces cannot be made (not root).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from ringlet.testbed import HostBed

from _launchers import clean_env, openmpi_env, openmpi_mpirun

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "_multihost_job.py")
PORT = 29500  # every bed host is a fresh network namespace: nothing else listens there
DEADLINE_S = 120.0  # bounds a whole job on two loaded cores; never assumed as progress


@pytest.fixture
def make_bed():
    why = HostBed.unavailable()
    if why:
        pytest.skip(f"multi-host test bed unavailable: {why}")
    beds: List[HostBed] = []

    def make(hosts: int, **kw) -> HostBed:
        bed = HostBed(hosts, **kw)
        beds.append(bed)
        return bed

    yield make
    for bed in beds:
        bed.close()


def placement(bed: HostBed, per_host: Sequence[int]) -> List[Tuple[str, int]]:
    """``[(host, local_rank)]`` in rank order: host-major, as launchers place ranks."""
    return [(bed.hosts[h], k) for h, n in enumerate(per_host) for k in range(n)]


def start_env_contract(bed: HostBed, per_host: Sequence[int], out: str, mode: str,
                       host_env: Optional[Dict[str, Dict[str, str]]] = None,
                       **extra: str) -> List[subprocess.Popen]:
    """Start a job the torchrun way: RANK/WORLD_SIZE/MASTER_ADDR/... on every rank
    (``extra`` on every rank too, ``host_env[host]`` on that host's ranks)."""
    where = placement(bed, per_host)
    secret = secrets.token_hex(16)
    procs = []
    for rank, (host, local) in enumerate(where):
        env = clean_env(RANK=str(rank), WORLD_SIZE=str(len(where)), LOCAL_RANK=str(local),
                        LOCAL_WORLD_SIZE=str(per_host[bed.hosts.index(host)]),
                        MASTER_ADDR=bed.addr(bed.hosts[0]), MASTER_PORT=str(PORT),
                        RINGLET_SECRET=secret, **extra, **(host_env or {}).get(host, {}))
        procs.append(bed.popen(host, [sys.executable, JOB, mode, out], env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: Sequence[subprocess.Popen], timeout: float = DEADLINE_S) -> Dict[int, str]:
    """Exit code and output of every process, killing stragglers at the deadline."""
    end = time.monotonic() + timeout
    outs = {}
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            out = (out or b"") + b"\n<killed at the test deadline>"
        outs[r] = (p.returncode, (out or b"").decode(errors="replace"))
    return outs


def results(out: str, n: int, outs) -> List[dict]:
    recs = []
    for r in range(n):
        path = os.path.join(out, f"rank{r}.json")
        assert os.path.exists(path), f"rank {r} wrote no result; output:\n{outs[r][1][-3000:]}"
        with open(path) as f:
            recs.append(json.load(f))
    return recs


def check_placement(bed: HostBed, per_host: Sequence[int], recs: List[dict]) -> None:
    """Each rank ran on its host, bound that host's address, and shares the
    same-host identity exactly with the ranks of its host."""
    where = placement(bed, per_host)
    for r, (host, _) in enumerate(where):
        assert recs[r]["hostname"] == bed.hostname(host), (r, recs[r])
        assert recs[r]["bind"] == bed.addr(host), (r, recs[r])
    for a in range(len(where)):
        for b in range(len(where)):
            same = where[a][0] == where[b][0]
            assert (recs[a]["host_id"] == recs[b]["host_id"]) == same, (a, b)


# ---- the bed itself -------------------------------------------------------------------------
def test_bed_hosts_are_separate_and_torn_down(make_bed):
    t0 = time.monotonic()
    bed = make_bed(3, rate="1gbit")
    setup = time.monotonic() - t0
    names = {h: bed.netns(h) for h in bed.hosts}
    ids = {}
    for h in bed.hosts:
        r = bed.run(h, [sys.executable, "-c", "import socket, ringlet._topology as t; "
                        "print(socket.gethostname(), t.host_id())"], clean_env(), check=True)
        name, hid = r.stdout.decode().split()
        assert name == h
        ids[h] = hid
        # Every host resolves every other by name, and reaches it.
        r = bed.run(h, [sys.executable, "-c", "import socket; print(socket.gethostbyname('h3'))"],
                    clean_env(), check=True)
        assert r.stdout.decode().strip() == bed.addr("h3")
    assert len(set(ids.values())) == 3
    p = bed.popen("h2", ["sleep", "600"])
    t0 = time.monotonic()
    bed.close()
    teardown = time.monotonic() - t0
    assert p.poll() is not None, "a process the bed started outlived it"
    left = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    assert not left & set(names.values()), "the bed left namespaces behind"
    assert setup < 5.0 and teardown < 5.0, (setup, teardown)


_SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], 29600))
print("listening", flush=True)
c, _ = srv.accept()
n = 0
while n < int(sys.argv[2]):
    b = c.recv(1 << 16)
    if not b:
        break
    n += len(b)
c.sendall(b"k")
print(n, flush=True)
"""
_SOURCE = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 29600))
t = time.monotonic()
s.sendall(bytes(int(sys.argv[2])))
assert s.recv(1) == b"k"
print(time.monotonic() - t)
"""


def test_bed_shapes_links_with_tbf(make_bed):
    # 4 MB through an 80 Mbit/s link (each direction shaped) takes at least
    # 0.4 s less the bucket (256 KiB): a lower bound no machine load can break;
    # h2's link is not shaped, so h2 -> h1 is bounded by h1's link alone.
    bed = make_bed(2, rate={"h1": "80mbit"})  # h1's link only: a slow host
    n = 4_000_000
    sink = bed.popen("h1", [sys.executable, "-c", _SINK, bed.addr("h1"), str(n)], clean_env(),
                     stdout=subprocess.PIPE)
    assert sink.stdout.readline().strip() == b"listening"
    r = bed.run("h2", [sys.executable, "-c", _SOURCE, bed.addr("h1"), str(n)], clean_env(),
                check=True)
    took = float(r.stdout)
    assert sink.stdout.readline().strip() == str(n).encode()
    assert took >= (n - 300_000) * 8 / 80e6, took


def test_bed_burst_sets_every_links_bucket(make_bed):
    bed = make_bed(2, rate="1gbit", burst="16kb")
    for h in bed.hosts:
        out = subprocess.run(["tc", "-n", bed.netns(h), "qdisc", "show", "dev", bed.ifname],
                             capture_output=True, text=True, check=True).stdout
        assert re.search(r"tbf .*rate 1Gbit burst 16Kb", out), out
    with pytest.raises(ValueError, match="burst must be a tc size"):
        HostBed(2, rate="1gbit", burst="16 kb; reboot")


_MAKE_BED = """
import os, signal, sys
from ringlet.testbed import HostBed
bed = HostBed(2)
bed.popen("h1", ["sleep", "600"])
print(" ".join(bed.netns(h) for h in bed.hosts), flush=True)
if sys.argv[1] == "raise":
    with bed:
        raise KeyboardInterrupt
elif sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""  # "exit": leaves the bed open; atexit tears it down


@pytest.mark.parametrize("how", ["raise", "exit", "kill"])
def test_bed_torn_down_on_every_exit_path(make_bed, how):
    r = subprocess.run([sys.executable, "-c", _MAKE_BED, how], env=clean_env(),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    made = r.stdout.decode().split()
    assert len(made) == 2, r.stderr.decode()
    if how == "kill":
        assert r.returncode == -signal.SIGKILL
        make_bed(1)  # the next bed sweeps what a killed process left
    left = set(os.listdir("/run/netns"))
    assert not left & set(made), (how, left & set(made))


# ---- launch: the env contract, and correctness across hosts ----------------------------------
@pytest.mark.parametrize("per_host, rate", [((2, 2), "1gbit"), ((1, 1, 1), None),
                                            ((3, 3), None)], ids=["2x2", "3x1", "2x3"])
def test_env_contract_every_collective(make_bed, tmp_path, per_host, rate):
    # 2x2 runs over links shaped to 1 Gbit/s, as the benchmarks' bed.
    bed = make_bed(len(per_host), rate=rate)
    n = sum(per_host)
    outs = wait_all(start_env_contract(bed, per_host, str(tmp_path), "matrix"))
    recs = results(str(tmp_path), n, outs)
    assert all(code == 0 for code, _ in outs.values()), outs
    check_placement(bed, per_host, recs)
    bad = [b for rec in recs for b in rec["bad"]]
    assert not bad, "\n".join(bad[:20])


# ---- faults between hosts -------------------------------------------------------------------
FAULT_TIMEOUT_S = 3.0  # the op deadline of the fault jobs


def start_loop(bed: HostBed, out: str, **extra: str) -> List[subprocess.Popen]:
    """A 2x2 job looping all_reduce with a short op deadline; returns once every rank
    has completed operations (each creates a ready file), under a generous deadline."""
    procs = start_env_contract(bed, (2, 2), out, "loop",
                               MULTIHOST_OP_TIMEOUT=str(FAULT_TIMEOUT_S), **extra)
    end = time.monotonic() + DEADLINE_S
    while not all(os.path.exists(os.path.join(out, f"ready{r}")) for r in range(4)):
        dead = [r for r, p in enumerate(procs) if p.poll() is not None]
        if dead or time.monotonic() > end:
            outs = wait_all(procs, 1.0)
            pytest.fail(f"the job did not start (ranks exited: {dead}): {outs}")
        time.sleep(0.02)  # polling a file the ranks create; not a timer standing in for it
    return procs


def failures(out: str, procs, ranks=(0, 1)) -> List[dict]:
    """The failure records of ``ranks``, waiting (under the test deadline) until each has
    written one; every process is killed afterwards (exit paths are not timed here)."""
    end = time.monotonic() + DEADLINE_S
    recs: Dict[int, dict] = {}
    try:
        while len(recs) < len(ranks):
            for r in ranks:
                path = os.path.join(out, f"rank{r}.json")
                if r not in recs and os.path.exists(path):
                    with open(path) as f:
                        rec = json.load(f)
                    if rec["state"] == "failed":
                        recs[r] = rec
            missing = [r for r in ranks if r not in recs]
            gone = [r for r in missing if procs[r].poll() is not None]
            assert not gone, f"ranks {gone} exited without a failure record: {wait_all(procs, 1)}"
            assert time.monotonic() < end, f"ranks {missing} never failed (hung)"
            time.sleep(0.02)  # polling files the ranks write; not a timer standing in for them
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        wait_all(procs, 10.0)
    return [recs[r] for r in ranks]


def test_link_cut_mid_collective_errors_at_the_deadline(make_bed, tmp_path):
    bed = make_bed(2)
    out = str(tmp_path)
    procs = start_loop(bed, out)
    cut = time.monotonic()
    bed.set_link("h2", False)  # packets dropped: no reset, only the deadline can tell
    recs = failures(out, procs, (0, 1, 2, 3))
    for rec in recs:
        waited = rec["t_error"] - cut
        assert "rank" in rec["message"] and "peer" in rec["message"], rec
        # The op in flight began before the cut (at most one short loop step), so
        # no error comes much before the deadline.  Host 1's ranks, which serve
        # the store, error at it; host 2's also spend a bounded attempt to report
        # their failure to the store across the cut.
        late = 10.0 if rec["rank"] < 2 else 15.0
        assert FAULT_TIMEOUT_S * 0.8 <= waited <= FAULT_TIMEOUT_S + late, (waited, rec)
    assert any(rec["error"] == "CollectiveTimeout" for rec in recs[:2]), recs


@pytest.mark.parametrize("pipelined", [False, True])
def test_host_killed_survivors_error_within_a_second(make_bed, tmp_path, pipelined):
    bed = make_bed(2)
    out = str(tmp_path)
    # pipelined: a 32 MiB hierarchical all_reduce, 64 slices whose inter-host phases run
    # on the inter group's executor, one queued behind another, while the host works.
    extra = dict(RINGLET_ALGO="hier", MULTIHOST_COUNT=str(8 << 20)) if pipelined else {}
    procs = start_loop(bed, out, **extra)
    killed = time.monotonic()
    assert len(bed.signal_host("h2", signal.SIGKILL)) == 2
    recs = failures(out, procs)
    for rec in recs:
        waited = rec["t_error"] - killed
        assert rec["error"] in ("PeerClosedError", "GroupPoisonedError", "RingletError"), rec
        assert 0 <= waited < 1.0, (waited, rec)


def test_host_frozen_errors_at_the_deadline_not_before(make_bed, tmp_path):
    bed = make_bed(2)
    out = str(tmp_path)
    procs = start_loop(bed, out)
    stopped = time.monotonic()
    assert len(bed.signal_host("h2", signal.SIGSTOP)) == 2
    recs = failures(out, procs)
    for rec in recs:
        waited = rec["t_error"] - stopped
        assert FAULT_TIMEOUT_S * 0.8 <= waited <= FAULT_TIMEOUT_S + 10.0, (waited, rec)
    assert any(rec["error"] == "CollectiveTimeout" for rec in recs), recs


# ---- launch: ringlet run --hosts --------------------------------------------------------------
def test_ringlet_run_hosts_over_rsh(make_bed, tmp_path):
    bed = make_bed(2)
    out = str(tmp_path)
    # The launcher runs on h1, as on a cluster's first node; h2's ranks start through
    # the bed's rsh script (ssh's calling convention), in h2's namespaces.
    # The launcher's knobs reach every rank; what names its own host (the interface)
    # reaches only the ranks on it.
    r = bed.run("h1", [sys.executable, "-m", "ringlet.run", "--hosts", "h1:2,h2:2", "--rsh",
                       bed.rsh, "--timeout", str(DEADLINE_S), JOB, "matrix", out],
                clean_env(RINGLET_SPIN_US="77", RINGLET_IFNAME=bed.ifname),
                timeout=DEADLINE_S + 30)
    outs = {rank: (r.returncode, r.stdout.decode() + r.stderr.decode()) for rank in range(4)}
    assert r.returncode == 0, outs[0][1][-4000:]
    recs = results(out, 4, outs)
    check_placement(bed, (2, 2), recs)
    for rank, rec in enumerate(recs):
        # The store is served where h2 can reach it, and the secret is on no command line.
        assert rec["master"] == bed.addr("h1"), rec
        assert rec["local"][0] == str(rank % 2), rec
        assert rec["secret_in_argv"] == [], rec
        assert rec["knobs"] == {"RINGLET_SPIN_US": "77",
                                "RINGLET_IFNAME": bed.ifname if rank < 2 else None}, rec
    bad = [b for rec in recs for b in rec["bad"]]
    assert not bad, "\n".join(bad[:20])
    # Every output line carries its rank, remote ones included.
    assert "[2] rank 2 checked" in r.stdout.decode(), r.stdout.decode()[-2000:]


def test_ringlet_run_hosts_unknown_host_fails_fast(make_bed, tmp_path):
    bed = make_bed(2)
    t0 = time.monotonic()
    r = bed.run("h1", [sys.executable, "-m", "ringlet.run", "--hosts", "h1:1,h2:1,h9:1",
                       "--rsh", bed.rsh, JOB, "matrix", str(tmp_path)], clean_env(),
                timeout=DEADLINE_S)
    err = r.stderr.decode()
    assert r.returncode != 0 and "h9" in err, err
    assert time.monotonic() - t0 < 60.0


# ---- launch: mpirun with a hostfile ----------------------------------------------------------
def mpirun_on_bed(bed: HostBed, per_host: int, out: str, *extra: str):
    """``mpirun`` on h1 with a hostfile of the bed's hosts; Open MPI starts its daemon
    on the other hosts through the bed's rsh script, as it would through ssh."""
    hostfile = os.path.join(out, "hostfile")
    with open(hostfile, "w") as f:
        f.writelines(f"{h} slots={per_host}\n" for h in bed.hosts)
    n = per_host * len(bed.hosts)
    argv = [openmpi_mpirun(), "--hostfile", hostfile, "--mca", "plm_rsh_agent", bed.rsh,
            "-np", str(n), "--map-by", f"ppr:{per_host}:node:OVERSUBSCRIBE", *extra,
            sys.executable, JOB, "matrix", out]
    r = bed.run("h1", argv, openmpi_env(), timeout=DEADLINE_S)
    if r.returncode != 0 and b"Open MPI failed to TCP connect to a peer MPI process" in r.stderr + r.stdout:
        # Open MPI's own connection between its processes (before ringlet runs any
        # operation) was reset, seen once in ~30 runs on 2 loaded cores: run it again.
        r = bed.run("h1", argv, openmpi_env(), timeout=DEADLINE_S)
    return r


def test_mpirun_hostfile_hosts_reporting_one_name(make_bed, tmp_path):
    # Every host calls itself "node": the bootstrap must still see two hosts (it
    # goes by the same-host identity, not MPI's processor name) and serve the
    # store where h2 reaches it.
    bed = make_bed(2, hostnames=["node", "node"])
    out = str(tmp_path)
    r = mpirun_on_bed(bed, 2, out)
    outs = {rank: (r.returncode, r.stdout.decode() + r.stderr.decode()) for rank in range(4)}
    assert r.returncode == 0, outs[0][1][-4000:]
    recs = results(out, 4, outs)
    check_placement(bed, (2, 2), recs)
    assert [rec["local"][0] for rec in recs] == ["0", "1", "0", "1"], recs
    bad = [b for rec in recs for b in rec["bad"]]
    assert not bad, "\n".join(bad[:20])


def test_mpirun_loopback_store_on_another_host_fails_fast(make_bed, tmp_path):
    # RINGLET_HOST_ID alike everywhere makes rank 0 take the job for one host and
    # serve the store on loopback; every rank must say so at once, not after init's
    # timeout (300 s).
    bed = make_bed(2)
    t0 = time.monotonic()
    r = mpirun_on_bed(bed, 2, str(tmp_path), "-x", "RINGLET_HOST_ID=one-host")
    waited = time.monotonic() - t0
    text = r.stdout.decode() + r.stderr.decode()
    assert r.returncode != 0, text[-3000:]
    assert "rank 0 serves the rendezvous store on loopback" in text, text[-3000:]
    for rank in range(4):
        assert f"rank {rank}: rank 0 serves the rendezvous store on loopback" in text, rank
    assert "this rank runs on another host" in text and "ranks [2, 3] run on other hosts" in text
    assert waited < 60.0, waited


# ---- interfaces -------------------------------------------------------------------------------
def test_ifname_selects_the_interface_between_hosts(make_bed, tmp_path):
    # Each host also has an interface the others cannot reach, listed after eth0;
    # RINGLET_IFNAME by exclusion ("^side") still lands every rank on eth0.
    bed = make_bed(2)
    for i, h in enumerate(bed.hosts):
        bed.add_interface(h, "side0", f"192.0.2.{i + 1}/24")
    outs = wait_all(start_env_contract(bed, (1, 1), str(tmp_path), "matrix",
                                       RINGLET_IFNAME="^side,lo"))
    recs = results(str(tmp_path), 2, outs)
    assert all(code == 0 for code, _ in outs.values()), outs
    check_placement(bed, (1, 1), recs)


def test_unreachable_advertised_address_names_both_ranks(make_bed, tmp_path):
    # h2's ranks listen on an interface only h2 is on (RINGLET_IFNAME=side0) and
    # advertise it; h1's ranks, dialling them, fail at once, naming the rank, the
    # peer and the address.
    bed = make_bed(2)
    bed.add_interface("h2", "side0", "192.0.2.2/24")
    out = str(tmp_path)
    t0 = time.monotonic()
    # Flat: the error's ranks are then the world's (a hierarchical phase numbers
    # its sub-group's ranks and adds the parent's in a note).
    procs = start_env_contract(bed, (2, 2), out, "loop", MULTIHOST_OP_TIMEOUT="60",
                               RINGLET_ALGO="flat", host_env={"h2": {"RINGLET_IFNAME": "side0"}})
    recs = failures(out, procs, (0, 1))
    for rec in recs:
        msg = rec["message"]
        assert re.search(r"rank [01]: \S+ seq=\d+ peer [23] \(192\.0\.2\.2:\d+\)", msg), msg
        assert "is unreachable from world rank" in msg or "aborted" in msg, msg
        assert rec["t_error"] - t0 < 60.0, rec
    assert any("is unreachable from world rank" in rec["message"] for rec in recs), recs


_DIES_ON_H2 = """
import os, sys, time
import ringlet
marker = sys.argv[1]
ringlet.init()
ringlet.barrier()
if ringlet.get_rank() == 3:
    ringlet.shutdown()  # its connections close: the others fail on them
    # Exit only once rank 0 has exited (it names its pid in the marker file).
    end = time.monotonic() + 60
    while time.monotonic() < end and not (os.path.exists(marker) and
                                          not os.path.exists("/proc/" + open(marker).read())):
        time.sleep(0.01)  # polling a file and a pid; not a timer standing in for them
    os._exit(7)
try:
    ringlet.barrier()
finally:
    if ringlet.get_rank() == 0:
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(marker + ".tmp", marker)
"""


def test_ringlet_run_hosts_blames_the_remote_rank_that_died(make_bed, tmp_path):
    # Rank 3 (on h2) leaves between two barriers and exits 7 only after rank 0
    # has failed on its closed connection and exited: exit order blames rank 0.  The
    # launcher must read the job's failure record from its store (served off
    # loopback) and blame rank 3, with rank 3's exit code.
    bed = make_bed(2)
    script = tmp_path / "dies.py"
    script.write_text(_DIES_ON_H2)
    r = bed.run("h1", [sys.executable, "-m", "ringlet.run", "--hosts", "h1:2,h2:2", "--rsh",
                       bed.rsh, "--grace", "30", str(script), str(tmp_path / "marker")],
                clean_env(), timeout=DEADLINE_S)
    err = r.stderr.decode()
    assert r.returncode == 7, err[-3000:]
    assert "rank 3 failed first (exit code 7)" in err, err[-3000:]
