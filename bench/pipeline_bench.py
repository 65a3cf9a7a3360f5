"""Pipeline schedules: measured step time, bubble and activation memory.

Two parts, both on 4 pipeline ranks (one process each, ``run_world`` process mode):

1. Timing (GPipe, 1F1B, interleaved 1F1B with 2 stages per rank; 8 and 16
   microbatches).  Each stage's compute is a fixed wall-clock cost per
   microbatch (``--fwd-ms`` forward, twice that backward, split evenly over
   the virtual stages), spent sleeping, off the CPU like an accelerator
   kernel, while real activations of ``--hidden`` float32 features travel
   between ranks.  "compute per rank" is the measured time inside the
   stages (sleep overshoots its nominal m·3·fwd-ms a little).  To explain
   the gap between measured and theoretical bubble, the table also shows the
   median delivery latency of the step's messages (send posted -> receive
   done, over messages whose receiver was already waiting; perf_counter is
   one system-wide clock), the bubble the plan's simulation predicts with
   the measured compute and that latency, the share of the step spent blocked
   in receives, and the rest (sending, posting receives, the end-of-step
   agreement).
   This measures the schedule and the runtime (messages, prefetching, Python
   overhead) without the ranks competing for a small machine's cores.  The
   measured bubble of a rank is its idle fraction ``1 - compute/step``; the
   table shows the mean over ranks beside the theoretical (p-1)/(m+p-1) or
   (p-1)/(v·m+p-1).
2. Memory (GPipe vs 1F1B vs interleaved, real MLP in numpy): the peak bytes
   of saved activations per rank, i.e. the largest total, over the step, of
   the arrays the stage's layers keep for backward.

Run::

    PYTHONPATH=src python3 bench/pipeline_bench.py            # prints markdown tables
    PYTHONPATH=src python3 bench/pipeline_bench.py --quick    # a fast smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core per rank
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from ringlet import nn  # noqa: E402
from ringlet.testing import run_world  # noqa: E402

P = 4


class Wait(nn.Module):
    """Stand-in for an accelerator layer: a fixed wall time per call, CPU left free."""

    def __init__(self, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        t_end = time.perf_counter() + self.fwd_s
        y = x + np.float32(1.0)
        self._save(x)
        _spend(t_end)
        return y

    def backward(self, g):
        t_end = time.perf_counter() + self.bwd_s
        self._pop()
        _spend(t_end)
        return g


def _spend(t_end: float) -> None:
    # Sleep, never spin: on a small machine a spinning rank would steal the
    # core another rank's communication thread needs.  Oversleeping is
    # harmless: the measured compute time includes it.
    left = t_end - time.perf_counter()
    if left > 0:
        time.sleep(left)


class Measured(nn.Sequential):
    """Sequential that reports the bytes its layers hold for backward.

    Reads each layer's saved contexts (``Module._contexts``, ringlet.nn's
    internal queue): benchmark instrumentation, not library code.
    """

    def saved_bytes(self) -> int:
        total = 0
        for m in self.modules():
            for entry in m._contexts:
                total += _nbytes(entry.ctx)
        return total


def _nbytes(obj) -> int:
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _schedule(kind: str, rank: int, m: int, layers_for_stage):
    from ringlet.pipeline import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                  ScheduleInterleaved1F1B)

    v = 2 if kind == "interleaved" else 1
    n = P * v
    stages = [PipelineStage(Measured(*layers_for_stage(s, v)), s, n) for s in range(rank, n, P)]
    if kind == "gpipe":
        return ScheduleGPipe(stages[0], m, loss_fn=nn.mse_loss)
    if kind == "1f1b":
        return Schedule1F1B(stages[0], m, loss_fn=nn.mse_loss)
    return ScheduleInterleaved1F1B(stages, m, loss_fn=nn.mse_loss)


def _timing_rank(rank, world, kind, m, args):
    fwd = args["fwd_ms"] / 1000.0

    def layers(s, v):
        return [Wait(fwd / v, 2 * fwd / v)]

    sched = _schedule(kind, rank, m, layers)
    batch = m * args["mb_size"]
    x = np.ones((batch, args["hidden"]), np.float32)
    y = np.zeros_like(x)
    out = []
    for i in range(args["warmup"] + args["steps"]):
        sched.step(x if rank == 0 else None, y if rank == P - 1 else None)
        if i >= args["warmup"]:
            st = sched.last_stats
            out.append((st.step_time, st.compute_time, st.wait_time))
    return out, (st.started_at, st.timeline)


def _memory_rank(rank, world, kind, m, args):
    h = args["hidden"]

    def layers(s, v):
        per = 2 // v  # the same 8 Linear+Tanh blocks in total, whatever v
        out = []
        for i in range(per):
            out += [nn.Linear(h, h, rng=10 * s + i), nn.Tanh()]
        return out

    sched = _schedule(kind, rank, m, layers)
    batch = m * args["mb_size"]
    g = np.random.default_rng(0)
    x = g.normal(size=(batch, h)).astype(np.float32)
    y = g.normal(size=(batch, h)).astype(np.float32)
    sched.step(x if rank == 0 else None, y if rank == P - 1 else None)
    st = sched.last_stats
    return st.peak_activation_bytes, st.peak_alive, st.step_time


def delivery_latency(timelines) -> float:
    """Median time from a send to its receive completing, over the messages whose
    receiver was already waiting (so the delay is the transfer, not the receiver).

    ``timelines``: per rank, ``(started_at, timeline)`` of one step; perf_counter
    is system-wide monotonic on Linux, so the ranks' clocks line up.
    """
    from ringlet.pipeline import ActionKind as K

    sent, recvd = {}, []
    for t0, tl in timelines:
        for a, b, act in tl:
            if act.kind in (K.SEND_ACT, K.SEND_GRAD):
                sent[(act.kind, act.stage, act.microbatch)] = t0 + b
            elif act.kind in (K.RECV_ACT, K.RECV_GRAD):
                recvd.append((t0 + a, t0 + b, act))
    lat = []
    for a, b, act in recvd:
        key = ((K.SEND_ACT, act.stage - 1, act.microbatch) if act.kind is K.RECV_ACT
               else (K.SEND_GRAD, act.stage + 1, act.microbatch))
        if key in sent and a < sent[key]:
            lat.append(b - sent[key])
    return statistics.median(lat) if lat else 0.0


def predicted(kind: str, m: int, compute: float, latency: float) -> float:
    """Step time the plan's simulation predicts with the measured compute and latency."""
    from ringlet.pipeline import plan_1f1b, plan_gpipe, plan_interleaved_1f1b, simulate

    if kind == "interleaved":
        plan, v = plan_interleaved_1f1b(P, 2, m), 2
    else:
        plan, v = (plan_gpipe if kind == "gpipe" else plan_1f1b)(P, m), 1
    tf = compute / (3 * m * v)  # backward = 2 x forward
    return simulate(plan, forward_time=tf, backward_time=2 * tf, comm_time=latency).makespan


def theory(kind: str, m: int) -> float:
    from ringlet.pipeline import bubble_fraction

    return bubble_fraction(P, m, 2 if kind == "interleaved" else 1)


def main() -> None:
    ap = argparse.ArgumentParser(description="pipeline schedule benchmark")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--mb-size", type=int, default=32, help="samples per microbatch")
    ap.add_argument("--fwd-ms", type=float, default=4.0,
                    help="forward wall time of one stage per microbatch (backward: 2x)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer steps, smaller model")
    args = vars(ap.parse_args())
    if args["quick"]:
        args.update(hidden=256, steps=2, warmup=1, fwd_ms=2.0)
    kinds = ["gpipe", "1f1b", "interleaved"]

    print(f"# pipeline benchmark: {P} ranks (processes), {platform.machine()}, "
          f"{os.cpu_count()} cores, numpy {np.__version__}")
    print(f"timing: stage compute {args['fwd_ms']} ms forward + {2 * args['fwd_ms']} ms "
          f"backward per microbatch (off-CPU), activations {args['mb_size']} x "
          f"{args['hidden']} float32 per microbatch\n")
    print("| schedule | microbatches | step time (ms) | compute per rank (ms) | measured bubble "
          "| theoretical bubble | message latency (ms) | simulated with that latency "
          "| blocked in receives | other runtime time |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in (8, 16):
        for kind in kinds:
            out = run_world(_timing_rank, P, mode="process", args=(kind, m, args), timeout=300)
            res = [r for r, _ in out]
            lat = delivery_latency([tl for _, tl in out])
            steps = [statistics.median(r[i][0] for r in res) for i in range(args["steps"])]
            step = statistics.median(steps)
            compute = statistics.mean(c for r in res for (_, c, _) in r)
            idle = statistics.mean(1 - c / s for r in res for (s, c, _) in r)
            waited = statistics.mean(w / s for r in res for (s, _, w) in r)
            other = statistics.mean(1 - (c + w) / s for r in res for (s, c, w) in r)
            sim = predicted(kind, m, compute, lat)
            print(f"| {kind} | {m} | {1000 * step:.1f} | {1000 * compute:.1f} | {idle:.3f} | "
                  f"{theory(kind, m):.3f} | {1000 * lat:.2f} | {1 - compute / sim:.3f} "
                  f"({1000 * sim:.0f} ms) | {waited:.3f} | {other:.3f} |", flush=True)

    print(f"\nmemory: 8 x (Linear({args['hidden']}, {args['hidden']}) + Tanh) float32, "
          f"{args['mb_size']} samples per microbatch, 2 blocks per stage (1 per virtual "
          f"stage when interleaved)\n")
    print("| schedule | microbatches | peak saved activations per rank (MiB), rank 0..3 "
          "| peak alive microbatch-stages per rank |")
    print("|---|---:|---|---|")
    for m in (8, 16):
        for kind in kinds:
            res = run_world(_memory_rank, P, mode="process", args=(kind, m, args), timeout=300)
            mib = ", ".join(f"{b / 2**20:.2f}" for b, _, _ in res)
            alive = ", ".join(str(a) for _, a, _ in res)
            print(f"| {kind} | {m} | {mib} | {alive} |", flush=True)


if __name__ == "__main__":
    main()
