"""all_reduce, flat against hierarchical, on hosts simulated with per-rank host ids.

Runs P ranks as processes on this machine (``ringlet.testing.run_world`` with
``host_ids``, which sets ``RINGLET_HOST_ID`` in each rank), and times the same
op in both forms in alternating rounds: each timed op starts after a barrier,
its time is the slowest rank's, and the table shows the median over all rounds.

Example (docs/algorithms.md, "Predicted crossovers", the loopback measurement)::

    python bench/hier_vs_flat.py --hosts a,a,b,b --bytes 64M --iters 5 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import ringlet
from ringlet.testing import run_world


def _rank(rank, P, nbytes, iters, rounds):
    g = ringlet._world._require(None)
    plan = g._hier  # the hierarchical plan; None runs the flat form
    x = np.ones(nbytes // 4, np.float32)
    out = {"flat": [], "hier": []}
    for _ in range(rounds):
        for algo in ("flat", "hier"):
            g._hier = None if algo == "flat" else plan
            ringlet.all_reduce(x)  # warm-up (and, the first time, the sub-groups)
            for _ in range(iters):
                ringlet.barrier()
                t0 = time.perf_counter()
                ringlet.all_reduce(x)
                out[algo].append(time.perf_counter() - t0)
    g._hier = plan
    return out


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="a,a,b,b", help="host id of each rank (default a,a,b,b)")
    ap.add_argument("--bytes", type=_size, default=64 << 20)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    ids = a.hosts.split(",")
    P = len(ids)
    os.environ["RINGLET_ALGO"] = "hier"
    res = run_world(_rank, P, mode="process", timeout=900, host_ids=ids,
                    args=(a.bytes, a.iters, a.rounds))
    print(f"# {P} ranks on hosts {ids}, all_reduce {a.bytes} B float32, load average "
          f"{os.getloadavg()[0]:.1f}")
    for algo in ("flat", "hier"):
        per = [max(r[algo][i] for r in res) for i in range(len(res[0][algo]))]
        t = float(np.median(per))
        print(f"{algo}: median {t * 1e3:.1f} ms, busbw {a.bytes / t * 2 * (P - 1) / P / 1e9:.3f} "
              f"GB/s (min {min(per) * 1e3:.1f}, max {max(per) * 1e3:.1f} ms, {len(per)} ops)")


if __name__ == "__main__":
    main()
