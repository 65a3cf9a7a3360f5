"""A shared-memory all_gather into numpy's arrays against page-aligned ones.

numpy places a large array's data 16 bytes past a page; ``ringlet bench`` uses
page-aligned buffers.  For each block size the same ``all_gather`` runs into
both, 20 ops back to back (the slowest rank's time per op), three rounds
(docs/experiments.md, "Copies into numpy's arrays"):

    ringlet run -n 4 python3 bench/aligned_copies.py
"""

import time

import numpy as np

import ringlet


def aligned(n: int) -> np.ndarray:
    raw = np.empty(n * 4 + 8192, np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off:off + n * 4].view(np.float32)


def main() -> None:
    ringlet.init()
    rank, P = ringlet.get_rank(), ringlet.get_world_size()

    def timed(fn, n: int = 20) -> float:
        fn()
        ringlet.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        v = np.array([(time.perf_counter() - t0) / n * 1e6])
        ringlet.all_reduce(v, op=ringlet.ReduceOp.MAX)
        return float(v[0])

    for m in (65536, 81920, 131072, 163840):  # elements per block: 256-640 KiB
        ua, ui = np.empty(P * m, np.float32), np.empty(m, np.float32)
        aa, ai = aligned(P * m), aligned(m)
        res = [(timed(lambda: ringlet.all_gather(ua, ui)), timed(lambda: ringlet.all_gather(aa, ai)))
               for _ in range(3)]
        if rank == 0:
            print(f"block {m * 4:>7} B: numpy's array (data at page + {ua.ctypes.data % 4096}) "
                  f"{[round(x) for x, _ in res]} us, page-aligned {[round(y) for _, y in res]} us",
                  flush=True)


if __name__ == "__main__":
    main()
