"""A parameter server over ringlet.rpc: rank 0 holds the model, the other ranks train it.

Run::

    ringlet run -n 4 examples/parameter_server.py            # 1 server + 3 trainers
    ringlet run -n 4 examples/parameter_server.py --steps 300

How it works:

* Rank 0 ("ps") builds the model (``ringlet.nn``) and an ``optim.SGD`` for it
  inside a ``ParameterServer`` object, wraps it in an ``RRef`` and starts one
  ``run_trainer`` call on every other rank, passing the RRef along.
* Each trainer ("trainer<i>") owns a shard of a synthetic classification
  problem.  Every step it fetches the current weights through the RRef
  (``ps.rpc_sync().get_weights()``), computes a gradient on a mini-batch with
  its local copy of the model and pushes it back (``ps.rpc_sync().push(...)``).
* The server applies each pushed gradient at once (asynchronous SGD, one
  update at a time under a lock) and prints the mean training loss of the
  last pushes, which goes down as the trainers work.
* ``rpc.shutdown()`` on every rank waits until all calls are finished.

Only arrays, floats and ints cross the wire (no pickle): the weights and
gradients travel as dicts of numpy arrays, sent zero-copy.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

import ringlet
from ringlet import nn, optim, rpc

N_FEATURES = 20
N_CLASSES = 4


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(N_FEATURES, 64, rng=0), nn.ReLU(), nn.Linear(64, N_CLASSES, rng=1))


def make_data(seed: int, n: int) -> "tuple[np.ndarray, np.ndarray]":
    """A fixed random 'teacher' labels Gaussian inputs; every rank draws its own samples."""
    teacher = np.random.default_rng(1234).standard_normal((N_FEATURES, N_CLASSES))
    x = np.random.default_rng(seed).standard_normal((n, N_FEATURES)).astype(np.float32)
    y = np.argmax(x @ teacher + 0.3 * np.tanh(x[:, :N_CLASSES] * 3), axis=1).astype(np.int64)
    return x, y


class ParameterServer:
    """The model and its optimizer, updated by gradients pushed from trainers."""

    def __init__(self, lr: float, report_every: int) -> None:
        self.model = build_model()
        self.params = dict(self.model.named_parameters())
        self.opt = optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.lock = threading.Lock()  # pushes arrive on several RPC worker threads
        self.version = 0
        self.report_every = report_every
        self.recent: list = []
        self.history: list = []

    def get_weights(self) -> dict:
        with self.lock:
            # Copies: the arrays are serialized after the lock is released,
            # while other pushes may already update the parameters in place.
            return {"version": self.version, "weights": {k: p.data.copy() for k, p in self.params.items()}}

    def push(self, grads: dict, loss: float, trainer: str) -> int:
        with self.lock:
            for name, g in grads.items():
                self.params[name].grad = g
            self.opt.step()
            self.version += 1
            self.recent.append(loss)
            if len(self.recent) == self.report_every:
                mean = float(np.mean(self.recent))
                self.history.append(mean)
                print(f"[ps] update {self.version:5d}  mean loss of the last {self.report_every} pushes: "
                      f"{mean:.4f}  (latest from {trainer})", flush=True)
                self.recent = []
            return self.version


def run_trainer(ps: rpc.RRef, steps: int, batch: int) -> list:
    """Runs on a trainer rank (called by rank 0): fetch weights, compute a gradient, push it."""
    me = rpc.get_worker_info()
    model = build_model()
    params = dict(model.named_parameters())
    x, y = make_data(seed=100 + me.rank, n=4096)
    rng = np.random.default_rng(me.rank)
    losses = []
    for _ in range(steps):
        state = ps.rpc_sync().get_weights()
        for name, w in state["weights"].items():
            params[name].data[...] = w
        idx = rng.integers(0, len(x), size=batch)
        loss, g = nn.cross_entropy(model(x[idx]), y[idx])
        model.zero_grad()
        model.backward(g)
        ps.rpc_sync().push({name: p.grad for name, p in params.items()}, float(loss), me.name)
        losses.append(float(loss))
    return losses


rpc.register(run_trainer, "run_trainer")


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with nn.no_grad():
        return float(np.mean(np.argmax(model(x), axis=1) == y))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150, help="steps per trainer")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()

    ringlet.init()
    rank, world = ringlet.get_rank(), ringlet.get_world_size()
    if world < 2:
        raise SystemExit("run with at least 2 ranks: ringlet run -n 4 examples/parameter_server.py")
    rpc.init_rpc("ps" if rank == 0 else f"trainer{rank}", rpc_timeout=120)

    if rank == 0:
        ps = ParameterServer(args.lr, report_every=max(1, 10 * (world - 1)))
        ps_rref = rpc.RRef(ps)
        x_test, y_test = make_data(seed=7, n=2000)
        print(f"[ps] {world - 1} trainers, {args.steps} steps each; test accuracy before: "
              f"{accuracy(ps.model, x_test, y_test):.3f}", flush=True)
        t0 = time.perf_counter()
        futs = [rpc.rpc_async(r, run_trainer, args=(ps_rref, args.steps, args.batch)) for r in range(1, world)]
        per_trainer = [f.result() for f in futs]
        took = time.perf_counter() - t0
        first = np.mean([l[:10] for l in per_trainer])
        last = np.mean([l[-10:] for l in per_trainer])
        print(f"[ps] {ps.version} updates in {took:.2f} s; mean trainer loss first 10 steps {first:.4f} "
              f"-> last 10 steps {last:.4f}; test accuracy after: {accuracy(ps.model, x_test, y_test):.3f}",
              flush=True)
        if not last < first:
            raise SystemExit("loss did not go down")
        del ps_rref
    # Every rank: wait until no call is in flight anywhere, then close.
    rpc.shutdown(timeout=600)
    ringlet.shutdown()


if __name__ == "__main__":
    main()
