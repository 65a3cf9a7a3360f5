"""Train a small MLP split into pipeline stages, one stage per rank.

Run::

    ringlet run -n 4 examples/train_pipeline.py                      # 1F1B
    ringlet run -n 4 examples/train_pipeline.py --schedule gpipe
    ringlet run -n 4 examples/train_pipeline.py --schedule interleaved   # 2 stages per rank
    ringlet run -n 4 examples/train_pipeline.py --dp 2               # 2 stages x 2 replicas

The task is a synthetic regression, y = sin(x @ a) + 0.5 cos(x @ b), made
from a fixed seed, so every rank can build the same data without
communication: rank 0 (first stage) feeds the inputs, the last stage the
targets and prints the loss, which goes down.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ringlet
from ringlet import nn, optim
from ringlet.pipeline import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                              ScheduleInterleaved1F1B, all_reduce_gradients,
                              pipeline_data_groups, split_model)

IN, HIDDEN, OUT = 16, 64, 2


def make_model(n_hidden_layers: int) -> nn.Sequential:
    layers = [nn.Linear(IN, HIDDEN, rng=0), nn.Tanh()]
    for i in range(n_hidden_layers):
        layers += [nn.Linear(HIDDEN, HIDDEN, rng=1 + i), nn.Tanh()]
    layers.append(nn.Linear(HIDDEN, OUT, rng=100))
    return nn.Sequential(*layers)


def make_batch(step: int, batch: int, replica: int) -> tuple:
    g = np.random.default_rng(1000 * step + replica)
    coef = np.random.default_rng(7)
    a, b = coef.normal(size=(IN, OUT)) / 3, coef.normal(size=(IN, OUT)) / 3
    x = g.normal(size=(batch, IN)).astype(np.float32)
    y = (np.sin(x @ a) + 0.5 * np.cos(x @ b)).astype(np.float32)
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    args = ap.parse_args()

    ringlet.init()
    world = ringlet.get_world_size()
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the world size {world}")
    pp = world // args.dp
    if args.dp > 1:
        pp_group, dp_group, rank, replica = pipeline_data_groups(pp, args.dp)
    else:
        pp_group, dp_group, rank, replica = None, None, ringlet.get_rank(), 0

    v = 2 if args.schedule == "interleaved" else 1
    n_stages = pp * v
    model = make_model(n_hidden_layers=max(1, n_stages - 1))
    chunks = split_model(model, n_stages)
    my_stages = [PipelineStage(chunks[s], s, n_stages, group=pp_group)
                 for s in range(rank, n_stages, pp)]
    if args.schedule == "gpipe":
        sched = ScheduleGPipe(my_stages[0], args.microbatches, loss_fn=nn.mse_loss)
    elif args.schedule == "1f1b":
        sched = Schedule1F1B(my_stages[0], args.microbatches, loss_fn=nn.mse_loss)
    else:
        sched = ScheduleInterleaved1F1B(my_stages, args.microbatches, loss_fn=nn.mse_loss)
    params = [p for st in my_stages for p in st.parameters()]
    opt = optim.SGD(params, lr=args.lr, momentum=0.9)
    last = rank == pp - 1
    if ringlet.get_rank() == 0:
        print(f"{args.schedule}: {pp} stages x {args.dp} replicas, {args.microbatches} "
              f"microbatches of {args.batch // args.microbatches}")
        print(sched.table())

    first_loss = None
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = make_batch(step, args.batch, replica)
        opt.zero_grad()
        loss = sched.step(x if rank == 0 else None, y if last else None)
        if dp_group is not None:
            all_reduce_gradients(my_stages, dp_group)
        opt.step()
        if last and replica == 0:
            first_loss = loss if first_loss is None else first_loss
            if step % 25 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {loss:.5f}", flush=True)
    dt = time.perf_counter() - t0
    if last and replica == 0:
        st = sched.last_stats
        print(f"loss {first_loss:.4f} -> {loss:.4f} in {args.steps} steps "
              f"({1000 * dt / args.steps:.1f} ms/step; last stage idle {st.idle_fraction:.0%})")
        if not loss < first_loss:
            raise SystemExit("the loss did not go down")
    ringlet.shutdown()


if __name__ == "__main__":
    main()
