"""A 2-rank ping-pong beside busy loops, one line per job: how a job's mode varies.

Run without a launcher, it starts ``--busy`` busy-looping processes (as
``ringlet bench --busy`` does) and, beside them, ``--jobs`` jobs of 2 ranks in
turn (``ringlet run -n 2`` of this file).  Each job times ``--samples``
samples, each a barrier and ``--batch`` round trips of ``--size`` bytes, as the
benchmark's batch method does, and rank 0 prints the median time per message,
the median round trip, the barrier's median, the median 8-byte round trip
and the median copy of ``--size`` bytes within the rank (each timed after
them, in samples of the same shape), the share of the job's time the rank was
on a CPU and its voluntary context switches per round trip
(docs/experiments.md, "A 256 KiB ping-pong in two modes, busy or idle"):

    PYTHONPATH=src python3 bench/busy_pingpong.py --jobs 8 --busy 2 --size 262144
"""

import argparse
import os
import resource
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np


def job(size: int, samples: int, batch: int) -> None:
    import ringlet
    from ringlet.bench.sweep import ping_pong

    ringlet.init()
    r = ringlet.get_rank()
    big = SimpleNamespace(buf=np.ones(size, np.uint8), out=np.empty(size, np.uint8))
    small = SimpleNamespace(buf=np.ones(8, np.uint8), out=np.empty(8, np.uint8))

    def round_trip(bufs=big) -> None:
        ping_pong(r, ringlet.send, ringlet.recv, bufs)  # the benchmark's own exchange

    for _ in range(50):
        round_trip()
    clock = time.perf_counter
    rts, bars = np.empty((samples, batch)), np.empty(samples)
    ru0, w0 = resource.getrusage(resource.RUSAGE_SELF), clock()
    for i in range(samples):
        b0 = clock()
        ringlet.barrier()
        t = clock()
        bars[i] = t - b0
        for j in range(batch):
            round_trip()
            t2 = clock()
            rts[i, j], t = t2 - t, t2
    ru1, w1 = resource.getrusage(resource.RUSAGE_SELF), clock()
    def per_op(step) -> float:
        """Median over samples (a barrier, then `batch` steps) of one step's time."""
        each = np.empty(samples)
        for i in range(samples):
            ringlet.barrier()
            t = clock()
            for _ in range(batch):
                step()
            each[i] = (clock() - t) / batch
        return float(np.median(each))

    # Controls: a small message's hand-over, and the same bytes copied within
    # the rank (is this CPU slow, or the hand-over of the bytes?).
    tiny = per_op(lambda: round_trip(small))
    local = per_op(lambda: np.copyto(big.out, big.buf))
    cpu = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime
    per_msg = np.median(rts.sum(axis=1)) / batch / 2 * 1e6
    if r == 0:
        print(f"{per_msg:9.1f} us/message  round trip {np.median(rts) * 1e6:8.1f} us  "
              f"barrier {np.median(bars) * 1e6:6.1f} us  8 B round trip "
              f"{tiny * 1e6:6.1f} us  local copy {local * 1e6:6.1f} us  "
              f"on CPU {cpu / (w1 - w0):.2f}  "
              f"sleeps/round trip {(ru1.ru_nvcsw - ru0.ru_nvcsw) / rts.size:.3f}", flush=True)
    ringlet.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=256 << 10, help="bytes per message")
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--batch", type=int, default=20, help="round trips per barrier")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--busy", type=int, default=2, help="busy loops beside the jobs")
    a = p.parse_args()
    if "RANK" in os.environ or "RINGLET_RANK" in os.environ:
        job(a.size, a.samples, a.batch)
        return
    from ringlet.bench.busy import busy_loops

    cmd = [sys.executable, "-m", "ringlet.run", "-n", "2", __file__, "--size", str(a.size),
           "--samples", str(a.samples), "--batch", str(a.batch)]
    with busy_loops(a.busy):
        for _ in range(a.jobs):
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
