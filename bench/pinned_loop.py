"""Back-to-back broadcasts from rank 0 with the ranks pinned to chosen cores.

Each rank times its own loop of N 8-byte broadcasts and the loop plus a
closing barrier; rank 0 prints both per rank, in microseconds per operation.
Run under ``ringlet run`` (docs/benchmarks.md, "Small messages, back to back"):

    ringlet run -n 4 bench/pinned_loop.py --cores 0,0,1,1 -n 20000
    perf sched record -o sched.data -- ringlet run -n 4 bench/pinned_loop.py --cores 0,0,1,1 -n 5000
    perf sched timehist -i sched.data -C 0 -w | grep python

``--cores`` lists one core per rank (default: no pinning).
"""

import argparse
import os
import time

import numpy as np

import ringlet


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--ops", type=int, default=20000, help="broadcasts per rank")
    p.add_argument("--cores", default="", help="comma-separated core of each rank")
    args = p.parse_args()
    ringlet.init()
    r, size = ringlet.get_rank(), ringlet.get_world_size()
    if args.cores:
        os.sched_setaffinity(0, {int(args.cores.split(",")[r])})
    x = np.ones(2, np.float32)
    ringlet.barrier()
    t0 = time.perf_counter()
    for _ in range(args.ops):
        ringlet.broadcast(x, 0)
    t1 = time.perf_counter()
    ringlet.barrier()
    t2 = time.perf_counter()
    per = np.zeros(2 * size)
    per[2 * r:2 * r + 2] = [(t1 - t0) / args.ops * 1e6, (t2 - t0) / args.ops * 1e6]
    ringlet.all_reduce(per)
    if r == 0:
        print("rank  own loop (us/op)  with barrier (us/op)")
        for i in range(size):
            print(f"{i:4d}  {per[2 * i]:16.1f}  {per[2 * i + 1]:20.1f}")
    ringlet.shutdown()


if __name__ == "__main__":
    main()
