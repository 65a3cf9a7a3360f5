"""One rank of a multi-host test job (tests/test_multihost.py), started on a bed host.

    python _multihost_job.py matrix OUTDIR   # every collective against numpy
    python _multihost_job.py loop OUTDIR     # all_reduce until it fails (fault tests);
                                             # MULTIHOST_OP_TIMEOUT: its deadline,
                                             # MULTIHOST_COUNT: its float32 count

Rank, world size and the rendezvous come from whatever launcher started the
process (``ringlet.init()`` with no arguments).  Each rank writes
OUTDIR/rank<R>.json: where it ran (host name, same-host identity, bind
address) and what it found.  In loop mode it also creates OUTDIR/ready<R>
once its first operations have completed, and records the monotonic time of
the error that ends the loop (CLOCK_MONOTONIC is one clock for every
namespace, so the test compares it with the time it injected the fault).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringlet  # noqa: E402
from ringlet import _core, _topology  # noqa: E402
from ringlet.errors import RingletError  # noqa: E402


def _argv_with(secret: str) -> list:
    """Pids of the processes whose command line holds ``secret`` (all hosts share one
    pid namespace on the bed, so this sees the launcher and its remote shells too)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if secret.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _where() -> dict:
    secret = os.environ.get("RINGLET_SECRET", "")
    return {"hostname": socket.gethostname(), "host_id": _topology.host_id(),
            "bind": ringlet.get_bind_address(),
            "master": os.environ.get("RINGLET_MASTER_ADDR") or os.environ.get("MASTER_ADDR"),
            "local": [os.environ.get(k) for k in ("RINGLET_LOCAL_RANK", "LOCAL_RANK",
                                                  "OMPI_COMM_WORLD_LOCAL_RANK") if k in os.environ],
            "secret_in_argv": _argv_with(secret) if len(secret) >= 16 else [],
            "knobs": {k: os.environ.get(k) for k in ("RINGLET_SPIN_US", "RINGLET_IFNAME")}}


def _write(out: str, rank: int, rec: dict) -> None:
    tmp = os.path.join(out, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, os.path.join(out, f"rank{rank}.json"))


def matrix(out: str) -> int:
    from test_collectives import SMALL_TUNING, _matrix

    from _oracle import counts_for

    ringlet.init()
    rank, P = ringlet.get_rank(), ringlet.get_world_size()
    _core.set_tuning(**SMALL_TUNING)  # latency and pipelined algorithms both run
    bad = _matrix(rank, P, [np.float32, np.int32], counts_for(P), full_roots=False)
    # One message far above the segment size, across the links.
    n = 1 << 18
    x = np.arange(n, dtype=np.float64) * (rank + 1)
    ringlet.all_reduce(x)
    if not np.array_equal(x, np.arange(n, dtype=np.float64) * (P * (P + 1) // 2)):
        bad.append(f"rank {rank}: all_reduce of {n} float64 differs from numpy")
    _write(out, rank, dict(_where(), rank=rank, size=P, bad=bad))
    print(f"rank {rank} checked {P} ranks", flush=True)
    ringlet.shutdown()
    return 0


def loop(out: str) -> int:
    group = ringlet.init()
    rank = ringlet.get_rank()
    op_timeout = float(os.environ["MULTIHOST_OP_TIMEOUT"])
    x = np.ones(int(os.environ.get("MULTIHOST_COUNT", "4096")), np.float32)
    i = 0
    try:
        while True:
            # The first operations (which also connect) keep init's generous deadline.
            group.all_reduce(x, timeout=op_timeout if i >= 3 else None)
            i += 1
            if i == 3:
                _write(out, rank, dict(_where(), rank=rank, state="running"))
                open(os.path.join(out, f"ready{rank}"), "w").close()
    except RingletError as exc:
        t = time.monotonic()
        _write(out, rank, dict(_where(), rank=rank, state="failed", t_error=t,
                               error=type(exc).__name__, message=str(exc), iterations=i))
        return 3


if __name__ == "__main__":
    sys.exit({"matrix": matrix, "loop": loop}[sys.argv[1]](sys.argv[2]))
