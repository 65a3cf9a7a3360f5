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
import secrets
import signal
import subprocess
import sys
import time
from typing import Dict, List, Sequence, Tuple

import pytest

from ringlet.testbed import HostBed

from _launchers import clean_env

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
                       **extra: str) -> List[subprocess.Popen]:
    """Start a job the torchrun way: RANK/WORLD_SIZE/MASTER_ADDR/... on every rank."""
    where = placement(bed, per_host)
    secret = secrets.token_hex(16)
    procs = []
    for rank, (host, local) in enumerate(where):
        env = clean_env(RANK=str(rank), WORLD_SIZE=str(len(where)), LOCAL_RANK=str(local),
                        LOCAL_WORLD_SIZE=str(per_host[bed.hosts.index(host)]),
                        MASTER_ADDR=bed.addr(bed.hosts[0]), MASTER_PORT=str(PORT),
                        RINGLET_SECRET=secret, **extra)
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
        assert recs[r]["hostname"] == host, (r, recs[r])
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


# ---- launch: the env contract, and correctness across hosts ----------------------------------
@pytest.mark.parametrize("per_host", [(2, 2), (1, 1, 1), (3, 3)], ids=["2x2", "3x1", "2x3"])
def test_env_contract_every_collective(make_bed, tmp_path, per_host):
    bed = make_bed(len(per_host))
    n = sum(per_host)
    outs = wait_all(start_env_contract(bed, per_host, str(tmp_path), "matrix"))
    recs = results(str(tmp_path), n, outs)
    assert all(code == 0 for code, _ in outs.values()), outs
    check_placement(bed, per_host, recs)
    bad = [b for rec in recs for b in rec["bad"]]
    assert not bad, "\n".join(bad[:20])
