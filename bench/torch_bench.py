"""torch.distributed over "ringlet" against "gloo": a collective sweep and a DDP step.

Both backends live in one job: the default group is "ringlet", and a second
group over the same ranks is "gloo".  Every measurement alternates between
them (round by round, which one goes first alternating too), so background
load hits both alike; each cell is the median over ``--rounds`` rounds of the
slowest rank's time.

Sweep: ``--ops`` (default all_reduce) from ``--min`` to ``--max`` bytes of
float32, by factors of 4, through ``torch.distributed`` calls.
DDP: ``DistributedDataParallel`` with an SGD step, on ``--model``:

- ``mlp``: ``--layers`` Linear(width, width) + ReLU (``--width 2048 --layers 6``:
  25.2 M parameters), ``--batch`` rows per rank. Each weight is read and
  written several times per step (forward, backward, optimizer), so on a host
  with few cores per rank its compute is most of the step.
- ``embedding``: a recommendation-style model, an EmbeddingBag(vocab, dim) with
  dense gradients (``--vocab 393216 --dim 64``: 25.2 M parameters) summing
  ``--bag`` rows per sample, then Linear(dim, 256) + ReLU + Linear(256, 1).
  A step touches few rows but reduces the whole table's gradient: the case
  where communication dominates.

``--bucket-view`` passes ``gradient_as_bucket_view=True`` (gradients live in
DDP's buckets: no copy into them before the all_reduce and out after).

Run under any launcher, e.g.::

    ringlet run -n 4 bench/torch_bench.py
    torchrun --nproc-per-node 2 bench/torch_bench.py --json out.json

Rank 0 prints markdown tables (time per op in microseconds, speed-up of
ringlet over gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ringlet.torch  # noqa: F401  (registers "ringlet")


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="all_reduce",
                    help="comma list of all_reduce, broadcast, all_gather, reduce_scatter")
    ap.add_argument("--min", type=int, default=8)
    ap.add_argument("--max", type=int, default=256 << 20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target-s", type=float, default=0.05,
                    help="about this long per round and cell (at least one op)")
    ap.add_argument("--model", default="mlp", choices=("mlp", "embedding"))
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=393216)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--bag", type=int, default=20, help="rows summed per sample (embedding)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="DDP rounds (one step each backend)")
    ap.add_argument("--bucket-view", action="store_true",
                    help="DDP(gradient_as_bucket_view=True) for both backends")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-ddp", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads per rank (ranks already share the cores)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _op_fn(op, nbytes, P, group):
    n = max(1, nbytes // 4)
    if op == "all_reduce":
        x = torch.ones(n)
        return lambda: dist.all_reduce(x, group=group)
    if op == "broadcast":
        x = torch.ones(n)
        return lambda: dist.broadcast(x, src=0, group=group)
    if op == "all_gather":  # nbytes is the output size
        m = max(1, n // P)
        out, x = torch.empty(m * P), torch.ones(m)
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    if op == "reduce_scatter":  # nbytes is the input size
        m = max(1, n // P)
        out, x = torch.empty(m), torch.ones(m * P)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    raise SystemExit(f"unknown op {op!r}")


def _slowest(seconds: float, group) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def _timed(fn, iters: int, group) -> float:
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return _slowest((time.perf_counter() - t0) / iters, group)


def sweep(a, groups, P):
    rows = []
    sizes = []
    s = a.min
    while s <= a.max:
        sizes.append(s)
        s *= 4
    if sizes and sizes[-1] < a.max:
        sizes.append(a.max)  # the largest size is always measured
    for op in a.ops.split(","):
        for nbytes in sizes:
            fns = {name: _op_fn(op, nbytes, P, g) for name, g in groups.items()}
            # Iterations per round from one warm-up op of each (the slower decides).
            warm = max(_timed(fns[name], 1, groups[name]) for name in groups)
            iters = max(1, min(2000, int(a.target_s / max(warm, 1e-6))))
            times = {name: [] for name in groups}
            names = list(groups)
            for r in range(a.rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    times[name].append(_timed(fns[name], iters, groups[name]))
            med = {name: statistics.median(v) for name, v in times.items()}
            rows.append({"op": op, "bytes": nbytes, "iters": iters,
                         **{f"{k}_us": v * 1e6 for k, v in med.items()}})
            del fns
    return rows


def _build(a):
    """A fresh model of ``--model``'s shape (weights set by the caller)."""
    if a.model == "embedding":
        return nn.ModuleDict({"emb": nn.EmbeddingBag(a.vocab, a.dim, mode="sum"),
                              "head": nn.Sequential(nn.Linear(a.dim, 256), nn.ReLU(),
                                                    nn.Linear(256, 1))})
    layers = []
    for _ in range(a.layers):
        layers += [nn.Linear(a.width, a.width), nn.ReLU()]
    return nn.Sequential(*layers)


def _data(a, rank):
    g = torch.Generator().manual_seed(1 + rank)
    if a.model == "embedding":
        idx = torch.randint(0, a.vocab, (a.batch, a.bag), generator=g)
        return idx, torch.randn(a.batch, 1, generator=g)
    return torch.randn(a.batch, a.width, generator=g), torch.randn(a.batch, a.width, generator=g)


class _Rec(nn.Module):
    """The embedding model as one module DDP can wrap."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, idx):
        return self.inner["head"](self.inner["emb"](idx))


def ddp(a, groups, P):
    torch.manual_seed(0)
    base = _build(a)
    nparams = sum(p.numel() for p in base.parameters())
    wrap = _Rec if a.model == "embedding" else (lambda m: m)
    models = {}
    for name, g in groups.items():
        m = _build(a)
        m.load_state_dict(base.state_dict())
        m = wrap(m)
        models[name] = (DDP(m, process_group=g, gradient_as_bucket_view=a.bucket_view),
                        torch.optim.SGD(m.parameters(), lr=1e-4))
    x, y = _data(a, dist.get_rank())

    def step(name):
        model, opt = models[name]
        g = groups[name]
        dist.barrier(group=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        return _slowest(time.perf_counter() - t0, g)

    names = list(groups)
    for name in names:  # warm-up: DDP's first step builds its buckets
        step(name)
    times = {name: [] for name in names}
    for r in range(a.steps):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(step(name))
    # The compute-only floor: the same step without DDP.
    plain = wrap(_build(a))
    opt = torch.optim.SGD(plain.parameters(), lr=1e-4)
    local = []
    for _ in range(a.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        opt.step()
        local.append(time.perf_counter() - t0)
    return {"model": a.model, "params": nparams, "ranks": P, "batch": a.batch,
            "bucket_view": a.bucket_view, "local_ms": statistics.median(local[1:]) * 1e3,
            **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}}


def _fmt_bytes(n: int) -> str:
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f:
            return f"{n // f} {unit}"
    return f"{n} B"


def main(argv=None) -> None:
    a = _args(argv)
    torch.set_num_threads(a.threads)
    dist.init_process_group("ringlet")
    P, rank = dist.get_world_size(), dist.get_rank()
    groups = {"ringlet": dist.group.WORLD,
              "gloo": dist.new_group(list(range(P)), backend="gloo")}
    # The allocator decides whether a step faults its gradients in afresh (docs/benchmarks.md).
    alloc = {k: os.environ[k] for k in ("GLIBC_TUNABLES", "LD_PRELOAD") if os.environ.get(k)}
    out = {"ranks": P, "threads": torch.get_num_threads(), "allocator": alloc or "default"}
    if not a.no_sweep:
        out["sweep"] = sweep(a, groups, P)
    if not a.no_ddp:
        out["ddp"] = ddp(a, groups, P)
    if rank == 0:
        if "sweep" in out:
            print(f"\n{P} ranks, torch.distributed, median of {a.rounds} interleaved rounds, "
                  f"slowest rank (us per op)\n")
            print("| op | size | ringlet | gloo | gloo / ringlet |")
            print("|---|---:|---:|---:|---:|")
            for row in out["sweep"]:
                print(f"| {row['op']} | {_fmt_bytes(row['bytes'])} | {row['ringlet_us']:.1f} | "
                      f"{row['gloo_us']:.1f} | {row['gloo_us'] / row['ringlet_us']:.2f}x |")
        if "ddp" in out:
            d = out["ddp"]
            print(f"\nDDP step, {d['model']}, {d['params'] / 1e6:.1f} M parameters, {P} ranks, batch "
                  f"{d['batch']} per rank, median of {a.steps} interleaved steps (ms), allocator "
                  f"{out['allocator']}\n")
            print("| ranks | no DDP | ringlet | gloo | gloo / ringlet |")
            print("|---:|---:|---:|---:|---:|")
            print(f"| {P} | {d['local_ms']:.1f} | {d['ringlet_ms']:.1f} | {d['gloo_ms']:.1f} | "
                  f"{d['gloo_ms'] / d['ringlet_ms']:.2f}x |")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
