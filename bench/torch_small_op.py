"""A small ``dist.all_reduce`` back to back, "ringlet" against "gloo", in one job.

What a training loop pays per small collective (a loss scalar, a flag): the op itself
plus torch's dispatch and the backend's Python.  The default group is "ringlet", a second
group over the same ranks "gloo"; seven rounds alternate which goes first; each round
times ``-n`` calls of ``dist.all_reduce`` on a 2-element float32 tensor after a barrier.
Rank 0 prints, per backend, the median over rounds of the slowest rank's wall time per
call, the rounds' spread, and the CPU time per call of that rank's thread.

    ringlet run -n 2 bench/torch_small_op.py [-n 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ringlet.torch  # noqa: F401  (registers "ringlet")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=2000, help="calls per round (default 2000)")
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("ringlet")
    P, rank = dist.get_world_size(), dist.get_rank()
    groups = {"ringlet": dist.group.WORLD,
              "gloo": dist.new_group(list(range(P)), backend="gloo")}
    t = torch.ones(2)
    res = {k: {"wall": [], "cpu": []} for k in groups}
    for rnd in range(a.rounds):
        for name in (("ringlet", "gloo") if rnd % 2 == 0 else ("gloo", "ringlet")):
            g = groups[name]
            for _ in range(200):
                dist.all_reduce(t, group=g)
            dist.barrier(group=g)
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            for _ in range(a.n):
                dist.all_reduce(t, group=g)
            x = torch.tensor([(time.perf_counter_ns() - w0) / a.n / 1e3,
                              (time.thread_time_ns() - c0) / a.n / 1e3], dtype=torch.float64)
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=g)
            res[name]["wall"].append(x[0].item())
            res[name]["cpu"].append(x[1].item())
    if rank == 0:
        for k, v in res.items():
            print(f"{P} ranks {k:8s} wall median {statistics.median(v['wall']):8.1f} us per call "
                  f"(rounds {min(v['wall']):.1f}-{max(v['wall']):.1f}), CPU "
                  f"{statistics.median(v['cpu']):6.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
