"""Train an MLP classifier on scikit-learn's digits with DistributedDataParallel.

Run::

    ringlet run -n 4 examples/train_ddp.py            # 4 ranks, then a 1-process check
    ringlet run -n 4 examples/train_ddp.py --no-compare
    python examples/train_ddp.py --single             # one process, no ringlet job

The data set is scikit-learn's bundled 8x8 digits (1797 images, 10 classes; no
download).  Without scikit-learn a generated 10-class data set of the same
shape is used instead, and the script says so.

Every step takes one global batch; rank r trains on every world_size-th
example of it.  Each rank scales its summed loss gradient by
world_size / global_batch, so the mean that DDP computes is exactly the
gradient of the global batch's mean loss, for any world size.  With
``--compare`` (the default) rank 0 then trains the same model in one process
on the whole batches and prints both held-out accuracies: they are the same.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import ringlet
from ringlet import nn, optim
from ringlet.parallel import DDP


def load_data(seed: int = 0):
    """(x_train, y_train, x_test, y_test, source): 80/20 split with a fixed seed."""
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        x, y, source = d.data.astype(np.float32) / 16.0, d.target.astype(np.int64), "digits"
    except ImportError:
        # 10 Gaussian clusters in 64 dimensions, overlapping enough to need training.
        g = np.random.default_rng(1)
        centers = g.normal(0, 0.5, (10, 64))
        y = g.integers(0, 10, 1797)
        x = (centers[y] + g.normal(0, 1.5, (1797, 64))).astype(np.float32)
        source = "generated (pip install scikit-learn for the digits)"
    perm = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(y))
    tr, te = perm[:cut], perm[cut:]
    return x[tr], y[tr], x[te], y[te], source


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 128, rng=1), nn.ReLU(), nn.LayerNorm(128),
                         nn.Linear(128, 64, rng=2), nn.ReLU(), nn.Linear(64, 10, rng=3))


class ProgressBar:
    """A text bar on stderr: redrawn in place on a terminal, one line per update otherwise
    (under ``ringlet run`` output goes through the launcher line by line)."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width = total, width
        self.tty = sys.stderr.isatty()

    def update(self, done: int, text: str) -> None:
        fill = int(self.width * done / self.total)
        line = f"[{'#' * fill}{'.' * (self.width - fill)}] {done}/{self.total} {text}"
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done == self.total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def train(model, data, args, *, rank=0, world=1, ddp=None, bar=None):
    """Train in place; each rank takes every world-th example of each global batch."""
    x_tr, y_tr = data[0], data[1]
    opt = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    runner = ddp if ddp is not None else model
    steps_per_epoch = (len(y_tr) + args.batch - 1) // args.batch
    for epoch in range(args.epochs):
        order = np.random.default_rng(100 + epoch).permutation(len(y_tr))  # same on every rank
        total_loss, seen = 0.0, 0
        for s in range(steps_per_epoch):
            idx = order[s * args.batch:(s + 1) * args.batch]
            mine = idx[rank::world]
            opt.zero_grad()
            loss, g = nn.cross_entropy(runner(x_tr[mine]), y_tr[mine], reduction="sum")
            # sum over my examples * world / global batch: DDP's mean is the global mean
            g *= np.float32(world / len(idx))
            runner.backward(g)
            if ddp is not None:
                ddp.sync_gradients()
            opt.step()
            total_loss += loss
            seen += len(mine)
        if bar is not None:  # this rank's share of the data
            bar.update(epoch + 1, f"train loss {total_loss / seen:.4f}")
    return model


def accuracy(model, x, y, *, rank=0, world=1) -> float:
    """Held-out accuracy; with world > 1 each rank scores a slice and the counts are summed."""
    mine = slice(rank, None, world)
    with nn.no_grad():
        model.eval()
        pred = np.argmax(model(x[mine]), axis=-1)
        model.train()
    counts = np.array([np.sum(pred == y[mine]), len(pred)], np.int64)
    if world > 1:
        ringlet.all_reduce(counts)
    return float(counts[0]) / float(counts[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64, help="global batch size")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--single", action="store_true", help="one process, no ringlet job")
    ap.add_argument("--no-compare", dest="compare", action="store_false",
                    help="skip rank 0's single-process check")
    args = ap.parse_args()
    data = load_data()

    if args.single:
        print(f"data: {data[4]}, {len(data[1])} train / {len(data[3])} test")
        t0 = time.perf_counter()
        model = train(make_model(), data, args, bar=ProgressBar(args.epochs))
        print(f"single process: held-out accuracy {accuracy(model, data[2], data[3]):.4f} "
              f"({time.perf_counter() - t0:.1f}s)")
        return

    ringlet.init()
    rank, world = ringlet.get_rank(), ringlet.get_world_size()
    if rank == 0:
        print(f"data: {data[4]}, {len(data[1])} train / {len(data[3])} test, {world} ranks")
    model = make_model()
    ddp = DDP(model)
    t0 = time.perf_counter()
    train(model, data, args, rank=rank, world=world, ddp=ddp,
          bar=ProgressBar(args.epochs) if rank == 0 else None)
    acc = accuracy(model, data[2], data[3], rank=rank, world=world)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        print(f"DDP on {world} ranks: held-out accuracy {acc:.4f} ({elapsed:.1f}s)")
        if args.compare:
            ref = train(make_model(), data, args)
            ref_acc = accuracy(ref, data[2], data[3])
            diff = max(float(np.max(np.abs(a.data - b.data)))
                       for a, b in zip(model.parameters(), ref.parameters()))
            # The parameters agree to float32 rounding after one step (~1e-7); the
            # differences compound over many steps but the predictions do not change.
            print(f"single process:  held-out accuracy {ref_acc:.4f}; largest parameter "
                  f"difference {diff:.1e} -> {'same accuracy' if ref_acc == acc else 'DIFFERENT'}")
    ringlet.shutdown()


if __name__ == "__main__":
    main()
