"""DistributedDataParallel: a second gradient for a parameter that is already ready.

Once a parameter is ready its slice of the flat buffer may be under reduction.
A further gradient in the same iteration must be refused before it touches
that buffer (else it corrupts the mean, on this rank or on every rank), named
clearly, and the other ranks must be told or fail fast, never hang.  Oracle:
the numpy mean of single-process gradients on each rank's shard.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from ringlet import nn
from ringlet.parallel import DDP
from ringlet.testing import WorldError, run_world

B, DIN, DOUT = 8, 6, 3


class Gain(nn.Module):
    """``x * w * w``: uses ``w`` twice; ``count=False`` forgets to count the second use."""

    def __init__(self, count=True):
        super().__init__()
        self.w = nn.Parameter(np.linspace(0.5, 1.5, 8))
        self.count = count

    def forward(self, x):
        y = x * self.w.data
        self._save((x, y), (self.w, self.w) if self.count else (self.w,))
        return y * self.w.data

    def backward(self, g):
        x, y = self._pop()
        w = self.w.data
        self.w.accumulate_grad(np.sum(g * y, axis=0))
        gy = g * w
        self.w.accumulate_grad(np.sum(gy * x, axis=0))
        return gy * w


def mlp():
    return nn.Sequential(nn.Linear(DIN, 8, dtype=np.float64, rng=0), nn.Tanh(),
                         nn.Linear(8, DOUT, dtype=np.float64, rng=1))


def gained(count=True):
    # Parameters 0.weight 0.bias 1.w 2.weight 2.bias; with a tiny cap one bucket
    # each, in reverse: bucket 0 = 2.bias, 1 = 2.weight, 2 = 1.w, 3 = 0.bias, 4 = 0.weight.
    return nn.Sequential(nn.Linear(DIN, 8, dtype=np.float64, rng=0), Gain(count),
                         nn.Linear(8, DOUT, dtype=np.float64, rng=1))


def data(n, seed):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((B, DIN)), rng.standard_normal((B, DOUT))
    return [(x[r * B // n:(r + 1) * B // n], y[r * B // n:(r + 1) * B // n]) for r in range(n)]


def oracle(make, shards):
    """Mean over ranks of each rank's single-process gradients (plain numpy layers)."""
    total = None
    for x, y in shards:
        model = make()
        model.backward(nn.mse_loss(model(x), y)[1])
        g = [p.grad.copy() for p in model.parameters()]
        total = g if total is None else [a + b for a, b in zip(total, g)]
    return [t / len(shards) for t in total]


def _behind_the_back(rank, n, as_view):
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=1e-6, gradient_as_bucket_view=as_view)
    x, y = data(n, 0)[rank]
    ddp.backward(nn.mse_loss(ddp(x), y)[1])  # every bucket launched
    errors = {}
    if rank == 1:  # a second forward/backward on the model itself, before syncing
        try:
            model.backward(nn.mse_loss(model(x), y)[1])
        except RuntimeError as exc:
            errors["backward"] = str(exc)
    try:
        ddp.sync_gradients()
    except RuntimeError as exc:
        errors["sync"] = str(exc)
    grads = [p.grad.copy() for p in model.parameters()]
    # the next iteration is clean on every rank
    model.zero_grad()
    x2, y2 = data(n, 1)[rank]
    ddp.backward(nn.mse_loss(ddp(x2), y2)[1])
    ddp.sync_gradients()
    return errors, grads, [p.grad.copy() for p in model.parameters()]


@pytest.mark.parametrize("as_view", [True, False])
def test_a_late_gradient_is_refused_before_it_reaches_the_bucket(as_view):
    want = oracle(mlp, data(2, 0))
    want2 = oracle(mlp, data(2, 1))
    for rank, (errors, grads, grads2) in enumerate(run_world(_behind_the_back, 2,
                                                             args=(as_view,))):
        if rank == 1:
            msg = errors["backward"]
            # Linear's backward adds the weight gradient first: parameter 2, bucket 1
            assert "second gradient for parameter '2.weight' (index 2)" in msg, msg
            assert "bucket 1 was already launched" in msg and "refused" in msg, msg
            assert "sync_gradients()" in msg and "find_unused_parameters" in msg, msg
        else:
            assert "backward" not in errors
        sync = errors["sync"]  # every rank is told, naming the rank and the parameter
        assert "rank 1: '2.weight' (index 2, bucket 1, launched)" in sync, sync
        assert "received no gradient" not in sync, sync
        for got, w in zip(grads, want):  # nothing of the refused gradient leaked in
            np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-14)
        for got, w in zip(grads2, want2):
            np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-14)


def _mid_backward(rank, n, culprit_syncs):
    model = gained(count=rank != 1)
    ddp = DDP(model, bucket_cap_mb=1e-6)
    x, y = data(n, 0)[rank]
    out = ddp(x)
    errors = {}
    try:
        ddp.backward(nn.mse_loss(out, y)[1])
    except RuntimeError as exc:
        errors["backward"] = str(exc)
        if not culprit_syncs:
            raise  # this rank's job ends here
    try:
        ddp.sync_gradients()
    except RuntimeError as exc:
        errors["sync"] = str(exc)
    model[1].count = True  # fixed: the next iteration trains normally everywhere
    model.zero_grad()
    x2, y2 = data(n, 1)[rank]
    ddp.backward(nn.mse_loss(ddp(x2), y2)[1])
    ddp.sync_gradients()
    return errors, [p.grad.copy() for p in model.parameters()]


def test_a_late_gradient_mid_backward_is_named_on_every_rank():
    want2 = oracle(gained, data(2, 1))
    res = run_world(_mid_backward, 2, args=(True,), timeout=60)
    assert "backward" not in res[0][0]
    msg = res[1][0]["backward"]
    assert "'1.w' (index 2)" in msg and "bucket 2 was already launched" in msg, msg
    for errors, grads2 in res:
        sync = errors["sync"]
        assert "rank 1: '1.w' (index 2, bucket 2, launched)" in sync, sync
        # its backward stopped there: the layers below it got nothing
        assert "'0.weight'" in sync and "'0.bias'" in sync, sync
        for got, w in zip(grads2, want2):
            np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-14)


def test_a_rank_that_stops_at_a_late_gradient_does_not_hang_the_others():
    t0 = time.monotonic()
    with pytest.raises(WorldError) as info:
        run_world(_mid_backward, 2, args=(False,), timeout=120, init_timeout=30)
    elapsed = time.monotonic() - t0
    failures = info.value.failures
    assert "'1.w' (index 2)" in failures[1] and "bucket 2" in failures[1], failures[1]
    # rank 0 waited in sync_gradients for buckets rank 1 never launched: it is
    # told (peer closed) or fails at its 30 s operation deadline, not at run_world's
    assert 0 in failures and "run_world deadline" not in failures[0], failures[0]
    assert "ringlet" in failures[0], failures[0]
    assert elapsed < 90, elapsed


def test_refused_gradient_leaves_grad_unchanged_on_one_rank():
    def body(rank, n):
        model = mlp()
        ddp = DDP(model, overlap=False)  # ready but not launched: refused all the same
        x, y = data(1, 0)[0]
        ddp.backward(nn.mse_loss(ddp(x), y)[1])
        before = model[2].bias.grad.copy()
        with pytest.raises(RuntimeError, match=r"'2.bias' \(index 3\).*bucket 0 is ready and "
                                               r"waiting to be launched"):
            model[2].bias.accumulate_grad(np.ones(DOUT))
        np.testing.assert_array_equal(model[2].bias.grad, before)
        with pytest.raises(RuntimeError, match=r"rank 0: '2.bias' \(index 3, bucket 0, not "
                                               r"yet launched\)"):
            ddp.sync_gradients()
        return [p.grad.copy() for p in model.parameters()]

    (grads,) = run_world(body, 1)
    for got, w in zip(grads, oracle(mlp, data(1, 0))):
        np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-14)
