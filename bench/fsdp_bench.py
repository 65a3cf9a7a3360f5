"""FSDP memory per rank and step time per strategy, against DDP.

Ranks are processes (``run_world`` process mode), one BLAS thread each.
The model is a stack of ``--layers`` ``Linear(width, width)`` + ReLU blocks;
each Linear is one FSDP unit.  Optimizer: AdamW (two float32 state arrays
per parameter).

**Memory** (``--part memory``; default ~50 M parameters: 8 x Linear(2500,
2500), 4 ranks, batch 8 per rank).  Per rank, for one training step after a
warm-up step (so optimizer state exists and prefetch follows the recorded
order):

* *state peak* = the buffers' own accounting: FSDP's ``memory_stats()``
  peak of (shard parameters + shard gradients + gathered full parameters +
  unsharded gradients + staging buffers) over the step, plus the optimizer
  state (constant during forward/backward; its temporaries are not state).
  DDP: module parameters + its flat gradient buffers + optimizer state, all
  persistent.
* *tracemalloc peak*: numpy reports every array allocation to tracemalloc,
  which runs from process start; the peak over the step includes
  activations and temporaries, not just state.
* *bound* (the issue's): (params + grads + AdamW state of the whole model) / N
  + two units' full parameters.

**Speed** (``--part speed``; default 8 x Linear(1024, 1024), ~8.4 M
parameters, 2 and 4 ranks): median step time (forward, backward with
gradient reduction, AdamW step), the slowest rank per step, all
configurations built up front and stepped round-robin (one step of each in
turn) so background load on a shared host hits them alike; and the time
ranks spent blocked on all-gathers (*exposed gather*): what prefetch is
meant to hide.  Two compute models:

* *CPU*: numpy computes (batch 64 per rank).  Loopback communication needs
  the same cores as the matmuls, so on a small host overlap cannot shorten
  the step much even when it hides the gathers.
* *off-CPU* (``--offcpu-ms``, default 15): batch 8 per rank, and every unit
  also spends that long off the CPU in forward (twice in backward), like a
  kernel on an accelerator, leaving the cores to the communication, as on a
  GPU node.

Run::

    PYTHONPATH=src python3 bench/fsdp_bench.py                 # both parts, markdown tables
    PYTHONPATH=src python3 bench/fsdp_bench.py --part memory
    PYTHONPATH=src python3 bench/fsdp_bench.py --quick         # small smoke run
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

MB = 1e6

# name -> (kind, FSDP keyword arguments, minimum world size)
CONFIGS = {
    "DDP": ("ddp", {}, 1),
    "NO_SHARD": ("fsdp", dict(strategy="NO_SHARD"), 1),
    "SHARD_GRAD_OP": ("fsdp", dict(strategy="SHARD_GRAD_OP"), 1),
    "FULL_SHARD": ("fsdp", dict(strategy="FULL_SHARD"), 1),
    "FULL_SHARD, no prefetch": ("fsdp", dict(strategy="FULL_SHARD", prefetch=False), 1),
    "FULL_SHARD, lean": ("fsdp", dict(strategy="FULL_SHARD", prefetch=False,
                                      overlap_reduce=False), 1),
    "HYBRID_SHARD 2x2": ("fsdp", dict(strategy="HYBRID_SHARD", shard_size=2), 4),
    "HYBRID_SHARD 2x2, no prefetch": ("fsdp", dict(strategy="HYBRID_SHARD", shard_size=2,
                                                   prefetch=False), 4),
}
MEMORY_CONFIGS = ["DDP", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "FULL_SHARD, no prefetch",
                  "FULL_SHARD, lean", "HYBRID_SHARD 2x2"]


def _offcpu_linear(ms):
    from ringlet import nn

    class OffCpuLinear(nn.Linear):
        """A Linear whose unit also waits ``ms`` off the CPU (2x in backward): an accelerator."""

        def forward(self, x):
            time.sleep(ms / 1e3)
            return super().forward(x)

        def backward(self, g):
            time.sleep(2 * ms / 1e3)
            return super().backward(g)

    return OffCpuLinear


def _build(name, width, layers, offcpu_ms=0.0):
    from ringlet import nn, optim
    from ringlet.parallel.ddp import DDP
    from ringlet.parallel.fsdp import FSDP

    lin = _offcpu_linear(offcpu_ms) if offcpu_ms else nn.Linear
    blocks = []
    for i in range(layers):
        blocks += [lin(width, width, rng=i), nn.ReLU()]
    model = nn.Sequential(*blocks)
    kind, kw, _ = CONFIGS[name]
    if kind == "ddp":
        w = DDP(model)
        params = list(model.parameters())
    else:
        w = FSDP(model, **kw)
        params = list(w.parameters())
    opt = optim.AdamW(params, lr=1e-4)
    return kind, w, opt, model


def _step(kind, w, opt, x):
    from ringlet import nn

    opt.zero_grad()
    _, g = nn.mse_loss(w(x), x)
    w.backward(g)
    if kind == "ddp":
        w.sync_gradients()
    opt.step()


def _opt_bytes(opt):
    return sum(a.nbytes for st in opt.state.values() for a in st.values()
               if isinstance(a, np.ndarray))


def _memory_rank(rank, n, name, width, layers, batch):
    import gc
    import tracemalloc

    tracemalloc.start()
    kind, w, opt, model = _build(name, width, layers)
    x = np.random.default_rng(rank).standard_normal((batch, width)).astype(np.float32)
    _step(kind, w, opt, x)  # warm-up: optimizer state, recorded unit order
    gc.collect()
    live_before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    if kind == "fsdp":
        w.reset_peak_memory_stats()
    _step(kind, w, opt, x)
    _, traced_peak = tracemalloc.get_traced_memory()
    opt_b = _opt_bytes(opt)
    if kind == "ddp":
        p = sum(q.nbytes for q in model.parameters())
        g = sum(b.nbytes for b in w.grad_buffers.values())
        persistent = peak = p + g + opt_b
        full_p = full_g = 0
    else:
        st = w.memory_stats()
        persistent = st["sharded_params"] + st["sharded_grads"] + opt_b
        peak = st["peak_total"] + opt_b
        full_p, full_g = st["peak_full_params"], st["peak_full_grads"]
    return dict(persistent=persistent, peak=peak, full_p=full_p, full_g=full_g,
                live_before=live_before, traced_peak=traced_peak)


def _speed_rank(rank, n, names, width, layers, batch, steps, warmup, offcpu_ms):
    import ringlet

    x = np.random.default_rng(rank).standard_normal((batch, width)).astype(np.float32)
    # Every configuration is built first and the steps are interleaved round-robin,
    # so all of them see the same background load on a shared host.
    built = {name: _build(name, width, layers, offcpu_ms) for name in names
             if CONFIGS[name][2] <= n}
    for kind, w, opt, _ in built.values():
        for _ in range(warmup):
            _step(kind, w, opt, x)
    rec = {name: ([], [], []) for name in built}
    for _ in range(steps):
        for name, (kind, w, opt, _) in built.items():
            ringlet.barrier()
            if kind == "fsdp":
                w.reset_stats()
            t0 = time.perf_counter()
            _step(kind, w, opt, x)
            dt = np.array([time.perf_counter() - t0])
            ringlet.all_reduce(dt, ringlet.ReduceOp.MAX)  # the slowest rank sets the pace
            times, gathers, reduces = rec[name]
            times.append(float(dt[0]))
            if kind == "fsdp":
                gathers.append(w.stats["gather_wait_s"])
                reduces.append(w.stats["reduce_wait_s"])
    return {name: dict(step=statistics.median(t),
                       gather=statistics.median(g) if g else None,
                       reduce=statistics.median(r) if r else None)
            for name, (t, g, r) in rec.items()}


def memory_part(a):
    from ringlet.testing import run_world

    unit = (a.mem_width * a.mem_width + a.mem_width) * 4
    total_params = unit * a.mem_layers
    state = 4 * total_params  # params + grads + AdamW exp_avg + exp_avg_sq
    bound = state / a.mem_ranks + 2 * unit
    print(f"## Memory per rank: {a.mem_layers} x Linear({a.mem_width}, {a.mem_width}) = "
          f"{total_params / 4 / 1e6:.1f} M float32 parameters, {a.mem_ranks} ranks, AdamW, "
          f"batch {a.mem_batch} per rank\n")
    print(f"Whole-model state (params + grads + AdamW) {state / MB:.1f} MB; 1/N of it "
          f"{state / a.mem_ranks / MB:.1f} MB; one unit's full parameters {unit / MB:.1f} MB; "
          f"bound 1/N + 2 units = **{bound / MB:.1f} MB**.\n")
    print("| strategy | state between steps | state peak in step | of which full params / "
          "full grads | within bound | tracemalloc live / peak |")
    print("|---|---:|---:|---:|:---:|---:|")
    for name in MEMORY_CONFIGS:
        if CONFIGS[name][2] > a.mem_ranks:
            continue
        res = run_world(_memory_rank, a.mem_ranks, mode="process", timeout=1200,
                        args=(name, a.mem_width, a.mem_layers, a.mem_batch))
        r = max(res, key=lambda d: d["peak"])
        ok = "yes" if r["peak"] <= bound else "no"
        print(f"| {name} | {r['persistent'] / MB:.1f} MB | {r['peak'] / MB:.1f} MB | "
              f"{r['full_p'] / MB:.1f} / {r['full_g'] / MB:.1f} MB | {ok} | "
              f"{r['live_before'] / MB:.1f} / {r['traced_peak'] / MB:.1f} MB |", flush=True)
    print()


def speed_part(a):
    speed_table(a, a.batch, 0.0)
    if a.offcpu_ms > 0:
        speed_table(a, a.offcpu_batch, a.offcpu_ms)


def speed_table(a, batch, offcpu_ms):
    from ringlet.testing import run_world

    nparams = (a.width * a.width + a.width) * a.layers
    how = "CPU compute" if not offcpu_ms else (f"off-CPU compute: {offcpu_ms:g} ms per unit "
                                               f"forward, {2 * offcpu_ms:g} ms backward")
    print(f"## Step time, {how}: {a.layers} x Linear({a.width}, {a.width}) = "
          f"{nparams / 1e6:.1f} M float32 parameters, AdamW, batch {batch} per rank, median of "
          f"{a.steps} steps after {a.warmup} warm-up\n")
    names = a.configs or list(CONFIGS)
    rows = {}
    for n in a.ranks:
        res = run_world(_speed_rank, n, mode="process", timeout=1800,
                        args=(names, a.width, a.layers, batch, a.steps, a.warmup, offcpu_ms))
        # per-rank exposed gather time: the mean over ranks (the step time is already the max)
        for name in res[0]:
            step = res[0][name]["step"]
            g = [r[name]["gather"] for r in res]
            rd = [r[name]["reduce"] for r in res]
            rows.setdefault(name, {})[n] = (step, None if g[0] is None else statistics.mean(g),
                                            None if rd[0] is None else statistics.mean(rd))
    hdr = " | ".join(f"{n} ranks: step / exposed gather / reduce wait" for n in a.ranks)
    print(f"| strategy | {hdr} |")
    print("|---|" + "---:|" * len(a.ranks))
    for name in names:
        cells = []
        for n in a.ranks:
            v = rows.get(name, {}).get(n)
            if v is None:
                cells.append("—")
                continue
            step, g, rd = v
            extra = "" if g is None else f" / {g * 1e3:.0f} / {rd * 1e3:.0f} ms"
            cells.append(f"{step * 1e3:.0f} ms{extra}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["memory", "speed", "both"], default="both")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--mem-width", type=int, default=2500)
    ap.add_argument("--mem-layers", type=int, default=8)
    ap.add_argument("--mem-batch", type=int, default=8)
    ap.add_argument("--mem-ranks", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--offcpu-ms", type=float, default=15.0,
                    help="second speed table: ms per unit spent off the CPU (0: skip it)")
    ap.add_argument("--offcpu-batch", type=int, default=8)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None,
                    help="speed: run only these configurations")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    if a.quick:
        a.mem_width, a.width, a.steps, a.warmup, a.offcpu_ms = 256, 256, 3, 1, 2.0
    print(f"# FSDP benchmark\nhost: {platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}, numpy {np.__version__}; ranks are processes with one "
          f"BLAS thread each\n")
    if a.part in ("memory", "both"):
        memory_part(a)
    if a.part in ("speed", "both"):
        speed_part(a)


if __name__ == "__main__":
    main()
