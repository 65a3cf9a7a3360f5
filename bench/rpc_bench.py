"""Benchmark ringlet.rpc between two workers: latency, calls/s, large-payload throughput.

Run either way::

    python bench/rpc_bench.py                       # starts 2 local processes itself
    ringlet run -n 2 bench/rpc_bench.py             # under the launcher
    python bench/rpc_bench.py --quick               # fewer iterations

Rank 0 calls rank 1 and prints Markdown tables:

* round-trip latency of a small call (``rpc_sync`` of a function returning
  its argument, a small int): median, p10, p90;
* calls per second with 1..128 ``rpc_async`` calls kept in flight;
* throughput of large float32 arrays, 1-64 MiB: sent as the argument (the
  callee returns only its size) and echoed both ways (GB/s counts the bytes
  of the argument plus the result).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections import deque
from typing import Any, Dict, List

import numpy as np

import ringlet
from ringlet import rpc


# replace=True: run as a script, this file is both __main__ and (for the
# spawned ranks) the module rpc_bench, so it registers twice in the parent.
@rpc.register(name="bench.echo", replace=True)
def echo(x: Any) -> Any:
    return x


@rpc.register(name="bench.nbytes", replace=True)
def nbytes(x: np.ndarray) -> int:
    return int(x.nbytes)


def _pct(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def latency(n: int) -> Dict[str, float]:
    for i in range(200):  # warm up: connection, threads, caches
        rpc.rpc_sync(1, echo, args=(i,))
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        rpc.rpc_sync(1, echo, args=(i,))
        times.append(time.perf_counter() - t0)
    return {"median_us": statistics.median(times) * 1e6, "p10_us": _pct(times, 0.1) * 1e6,
            "p90_us": _pct(times, 0.9) * 1e6}


def calls_per_second(window: int, n: int) -> float:
    inflight: deque = deque()
    t0 = time.perf_counter()
    for i in range(n):
        if len(inflight) >= window:
            inflight.popleft().result()
        inflight.append(rpc.rpc_async(1, echo, args=(i,)))
    while inflight:
        inflight.popleft().result()
    return n / (time.perf_counter() - t0)


def throughput(mib: int, reps: int) -> Dict[str, float]:
    x = np.random.default_rng(0).standard_normal((mib << 20) // 4).astype(np.float32)
    assert rpc.rpc_sync(1, nbytes, args=(x,)) == x.nbytes  # warm-up
    one_way, both = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        rpc.rpc_sync(1, nbytes, args=(x,))
        one_way.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        y = rpc.rpc_sync(1, echo, args=(x,))
        both.append(time.perf_counter() - t0)
    assert np.array_equal(x, y)
    return {"arg_gbps": x.nbytes / min(one_way) / 1e9, "echo_gbps": 2 * x.nbytes / min(both) / 1e9}


def run(rank: int, world: int, quick: bool) -> str:
    rpc.init_rpc(f"bench{rank}", rpc_timeout=120)
    report = ""
    if rank == 0:
        n_lat = 500 if quick else 5000
        lat = latency(n_lat)
        windows = [1, 8, 32, 128]
        cps = {w: calls_per_second(w, 1000 if quick else 10000) for w in windows}
        sizes = [1, 4, 16, 64]
        thr = {s: throughput(s, 2 if quick else 5) for s in sizes}
        lines = [
            f"host: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"numpy {np.__version__}, ringlet {ringlet.__version__}; 2 workers on one machine (loopback)",
            "",
            f"Small-call round trip ({n_lat} sequential `rpc_sync` calls):",
            "",
            "| median | p10 | p90 |",
            "|---|---|---|",
            f"| {lat['median_us']:.0f} us | {lat['p10_us']:.0f} us | {lat['p90_us']:.0f} us |",
            "",
            "Small calls per second with a window of `rpc_async` calls in flight:",
            "",
            "| in flight | calls/s |",
            "|---|---|",
            *[f"| {w} | {c:,.0f} |" for w, c in cps.items()],
            "",
            "Large float32 arrays (best of the repetitions):",
            "",
            "| size | argument only (GB/s) | echo, both ways (GB/s) |",
            "|---|---|---|",
            *[f"| {s} MiB | {t['arg_gbps']:.2f} | {t['echo_gbps']:.2f} |" for s, t in thr.items()],
        ]
        report = "\n".join(lines)
    rpc.shutdown()
    return report


def _launched() -> bool:
    return any(k in os.environ for k in ("RINGLET_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))


def _main_launched(quick: bool) -> None:
    ringlet.init()
    out = run(ringlet.get_rank(), ringlet.get_world_size(), quick)
    if out:
        print(out)
    ringlet.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description="ringlet.rpc benchmark (2 workers)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    args = ap.parse_args()
    if _launched():
        _main_launched(args.quick)
        return
    from ringlet.testing import run_world

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import rpc_bench  # the spawned ranks import the functions from this module by name

    print(run_world(rpc_bench.run, 2, mode="process", timeout=900, args=(args.quick,))[0])


if __name__ == "__main__":
    main()
