"""Train an MLP classifier with FullyShardedDataParallel.

Run::

    ringlet run -n 4 examples/train_fsdp.py                         # FULL_SHARD
    ringlet run -n 4 examples/train_fsdp.py --strategy hybrid_shard # 2 shards x 2 replicas
    ringlet run -n 4 examples/train_fsdp.py --mixed-precision float16
    ringlet run -n 4 examples/train_fsdp.py --checkpoint /tmp/fsdp_ckpt

(``PYTHONPATH=src python3 -m ringlet.run -n 4 examples/train_fsdp.py`` from a
source checkout.)  The task is synthetic: labels come from a fixed random
"teacher" network, so every rank builds the same data from a seed and trains
on its own slice of each global batch.  Rank 0 prints the loss (which goes
down), each rank's share of the model, and at the end the accuracy of the
gathered full model, evaluated on held-out data in a plain, unwrapped copy.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import ringlet
from ringlet import nn, optim
from ringlet.parallel.fsdp import FSDP, MixedPrecision, ShardingStrategy

IN, HIDDEN, CLASSES = 32, 256, 10


def make_model(seed: int = 0) -> nn.Sequential:
    return nn.Sequential(nn.Linear(IN, HIDDEN, rng=seed), nn.GELU(), nn.LayerNorm(HIDDEN),
                         nn.Linear(HIDDEN, HIDDEN, rng=seed + 1), nn.GELU(),
                         nn.Linear(HIDDEN, CLASSES, rng=seed + 2))


def make_data(n: int, seed: int):
    rng = np.random.default_rng(seed)
    teacher = np.random.default_rng(99).standard_normal((IN, CLASSES)) / np.sqrt(IN)
    x = rng.standard_normal((n, IN)).astype(np.float32)
    y = np.argmax(x @ teacher + 0.1 * rng.standard_normal((n, CLASSES)), axis=1)
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="full_shard",
                    choices=[s.value for s in ShardingStrategy])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=128, help="global batch size")
    ap.add_argument("--mixed-precision", default="none", choices=["none", "float16", "bfloat16"])
    ap.add_argument("--checkpoint", default=None, help="save a sharded checkpoint here and reload it")
    args = ap.parse_args()

    ringlet.init()
    rank, world = ringlet.get_rank(), ringlet.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the world size {world}")

    strategy = ShardingStrategy(args.strategy)
    kw = {}
    if strategy is ShardingStrategy.HYBRID_SHARD:
        kw["shard_size"] = 2 if world % 2 == 0 else world
    mp = None
    if args.mixed_precision != "none":
        mp = MixedPrecision(param_dtype=args.mixed_precision, reduce_dtype=np.float32) \
            if args.mixed_precision == "bfloat16" else MixedPrecision(np.float16, np.float32)

    model = make_model()
    full_bytes = sum(p.nbytes for p in model.parameters())
    fsdp = FSDP(model, strategy=strategy, mixed_precision=mp, **kw)
    opt = optim.AdamW(fsdp.parameters(), lr=3e-3, weight_decay=0.01)
    shard_bytes = sum(p.nbytes for p in fsdp.parameters())
    if rank == 0:
        print(f"{fsdp}\nunits: {fsdp.units}\nparameters per rank: {shard_bytes} bytes of "
              f"{full_bytes} ({shard_bytes / full_bytes:.0%})", flush=True)

    x_all, y_all = make_data(args.steps * args.batch, seed=1)
    local = args.batch // world
    first = last = None
    for step in range(args.steps):
        lo = step * args.batch + rank * local
        x, y = x_all[lo: lo + local], y_all[lo: lo + local]
        opt.zero_grad()
        loss, g = nn.cross_entropy(fsdp(x), y)
        fsdp.backward(g)
        opt.step()
        mean = np.array([loss])
        ringlet.all_reduce(mean, ringlet.ReduceOp.AVG)
        first = mean[0] if first is None else first
        last = mean[0]
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {mean[0]:.4f}", flush=True)

    if args.checkpoint:
        from ringlet.checkpoint import load, save

        save({"model": fsdp.sharded_state_dict(), "step": args.steps}, args.checkpoint)
        fresh = FSDP(make_model(seed=7), strategy=strategy, mixed_precision=mp, **kw)
        sd = fresh.sharded_state_dict()
        res = load({"model": sd, "step": 0}, args.checkpoint)
        fresh.load_sharded_state_dict(sd)
        a, b = fsdp.full_state_dict(), fresh.full_state_dict()
        if rank == 0:
            same = all(np.array_equal(a[k], b[k]) for k in a)
            print(f"checkpoint {os.path.abspath(args.checkpoint)}: step "
                  f"{res.state_dict['step']}, reloaded model identical: {same}", flush=True)

    # The whole model, gathered unit by unit onto rank 0, in a plain unwrapped copy.
    full = fsdp.full_state_dict(rank0_only=True)
    x_test, y_test = make_data(2000, seed=2)
    with nn.no_grad():
        sharded_logits = fsdp(x_test)  # every rank takes part in the gathers
    if rank == 0:
        plain = make_model(seed=3)
        plain.load_state_dict(full)
        with nn.no_grad():
            logits = plain(x_test)
        acc = float(np.mean(np.argmax(logits, axis=1) == y_test))
        agree = bool(np.allclose(logits, sharded_logits, atol=1e-2 if mp else 1e-5))
        print(f"loss {first:.4f} -> {last:.4f}; held-out accuracy {acc:.1%} "
              f"(chance {1 / CLASSES:.0%}); plain copy agrees with FSDP: {agree}", flush=True)
        if not (last < first and agree):
            raise SystemExit("training did not behave as expected")
    ringlet.shutdown()


if __name__ == "__main__":
    main()
