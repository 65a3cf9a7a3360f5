"""A receive from any source against a named one: a 2-rank ping-pong inside a job of N ranks.

Rank 0 receives rank 1's message either from any source or by name and
answers it; the other ranks wait in the closing barrier (they stay in the
job, as a receive from any source needs).  Rounds alternate the two forms;
rank 0 prints the time per round trip of each round (docs/algorithms.md,
"send / recv"):

    ringlet run -n 4 python3 bench/recv_any.py --rounds 3 --iters 3000
    RINGLET_TRANSPORT=tcp ringlet run -n 3 python3 bench/recv_any.py
"""

import argparse
import time

import numpy as np

import ringlet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--bytes", type=int, default=4)
    a = ap.parse_args()
    ringlet.init()
    r = ringlet.get_rank()
    if ringlet.get_world_size() < 2:
        raise SystemExit("recv_any.py needs at least 2 ranks")
    msg = np.zeros(max(1, a.bytes), np.uint8)
    for rnd in range(a.rounds):
        for mode in ("any", "named"):
            src = None if mode == "any" else 1
            ringlet.barrier()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                if r == 0:
                    ringlet.recv(msg, src, tag=2)
                    ringlet.send(msg, 1, tag=2)
                elif r == 1:
                    ringlet.send(msg, 0, tag=2)
                    ringlet.recv(msg, 0, tag=2)
            dt = time.perf_counter() - t0
            if r == 0:
                print(f"round {rnd} {mode:5s} {1e6 * dt / a.iters:.2f} us per round trip",
                      flush=True)
    ringlet.barrier()
    ringlet.shutdown()


if __name__ == "__main__":
    main()
