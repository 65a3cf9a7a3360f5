"""FSDP after a backward that raised part-way, and clip_grad_norm_'s bounded memory.

A failed backward must not leave partial gradients in a unit's full gradient
buffer (nor saved contexts, nor forward counts) for the next iteration to
reduce.  Oracles: the plain model in one process (numpy layers) and numpy
norms.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from ringlet import nn, optim
from ringlet.parallel import fsdp as fsdp_mod
from ringlet.parallel.fsdp import FSDP, ShardingStrategy
from ringlet.testing import run_world

SS = ShardingStrategy
B = 8


class Boom(Exception):
    pass


class Block(nn.Module):
    """Linear, Tanh, Linear; ``fail`` raises between the two Linears' backward."""

    def __init__(self, din, dout, seed):
        super().__init__()
        self.a = nn.Linear(din, dout, dtype=np.float64, rng=seed)
        self.act = nn.Tanh()
        self.b = nn.Linear(dout, dout, dtype=np.float64, rng=seed + 1)
        self.fail = False

    def forward(self, x):
        return self.b(self.act(self.a(x)))

    def backward(self, g):
        g = self.b.backward(g)  # b's gradients are in the unit's buffer now
        if self.fail:
            raise Boom("injected failure")
        return self.a.backward(self.act.backward(g))


def make():
    # Units: each Block (by auto_wrap), the root holds nothing.  Block 1's
    # backward completes and reduces; block 0 fails half-way.
    return nn.Sequential(Block(5, 6, 0), Block(6, 1, 2))


def batches(k, seed=11):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((B, 5)), rng.standard_normal((B, 1))) for _ in range(k)]


def one_sgd_step(batch):
    """The oracle: one plain SGD step on the whole batch, in one process."""
    model = make()
    opt = optim.SGD(model.parameters(), lr=0.1)
    x, y = batch
    model.backward(nn.mse_loss(model(x), y)[1])
    opt.step()
    return model.state_dict(copy=True)


def assert_state_close(got, want):
    assert list(got) == list(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-12, err_msg=k)


def _loss_grad(f, batch, rank, n):
    x, y = batch
    sl = slice(rank * B // n, (rank + 1) * B // n)
    return nn.mse_loss(f(x[sl]), y[sl])[1]


def _fail_then_step(rank, n, strategy, recover):
    model = make()
    first = model[0]
    f = FSDP(model, strategy=strategy, auto_wrap=(Block,))
    opt = optim.SGD(f.parameters(), lr=0.1)
    bad, good = batches(2)
    opt.zero_grad()
    first.fail = True
    with pytest.raises(Boom):
        f.backward(_loss_grad(f, bad, rank, n))
    first.fail = False
    if recover == "clear_context":
        f.clear_context()
    opt.zero_grad()  # the usual loop: the optimizer zeroes its (shard) gradients
    f.backward(_loss_grad(f, good, rank, n))
    opt.step()
    return f.full_state_dict(rank0_only=False)


@pytest.mark.parametrize("recover", ["zero_grad", "clear_context"])
@pytest.mark.parametrize("strategy", [SS.FULL_SHARD, SS.SHARD_GRAD_OP, SS.NO_SHARD])
def test_next_step_after_a_failed_backward_is_clean(strategy, recover):
    want = one_sgd_step(batches(2)[1])
    for sd in run_world(_fail_then_step, 2, args=(strategy, recover)):
        assert_state_close(sd, want)


def _fail_inside_no_sync(rank, n):
    model = make()
    first = model[0]
    f = FSDP(model, auto_wrap=(Block,))
    opt = optim.SGD(f.parameters(), lr=0.1)
    early, bad, good = batches(3)
    with f.no_sync():
        f.backward(_loss_grad(f, early, rank, n))  # accumulated in the unit buffers
        first.fail = True
        with pytest.raises(Boom):
            f.backward(_loss_grad(f, bad, rank, n))
    first.fail = False
    opt.zero_grad()
    msgs = []
    for _ in range(2):  # refused until fsdp.zero_grad(), even after opt.zero_grad()
        with pytest.raises(RuntimeError, match="raised part-way") as info:
            f(good[0])
        msgs.append(str(info.value))
    f.zero_grad()
    f.backward(_loss_grad(f, good, rank, n))
    opt.step()
    return msgs, f.full_state_dict(rank0_only=False)


def test_accumulated_gradients_lost_with_a_failed_backward_need_zero_grad():
    want = one_sgd_step(batches(3)[2])
    for msgs, sd in run_world(_fail_inside_no_sync, 2):
        for m in msgs:
            assert "Boom: injected failure" in m and "no_sync()" in m, m
            assert "fsdp.zero_grad()" in m, m
        assert_state_close(sd, want)


def _no_shard_without_zero_grad(rank, n):
    model = make()
    first = model[0]
    f = FSDP(model, strategy=SS.NO_SHARD, auto_wrap=(Block,))
    opt = optim.SGD(f.parameters(), lr=0.1)
    bad, good = batches(2)
    first.fail = True
    with pytest.raises(Boom):
        f.backward(_loss_grad(f, bad, rank, n))
    first.fail = False
    with pytest.raises(RuntimeError, match=r"NO_SHARD gradients \['0.flat_param'\]"):
        f(good[0])
    opt.zero_grad()  # any zero_grad clears NO_SHARD's in-place partial gradients
    f.backward(_loss_grad(f, good, rank, n))
    opt.step()
    return f.full_state_dict(rank0_only=False)


def test_no_shard_partial_gradients_in_place_are_refused_until_zeroed():
    want = one_sgd_step(batches(2)[1])
    for sd in run_world(_no_shard_without_zero_grad, 2):
        assert_state_close(sd, want)


# ---- clip_grad_norm_ ----------------------------------------------------------------------------
def _clip(rank, n, dtype, max_norm):
    f = FSDP(nn.Sequential(nn.Linear(40, 30, dtype=dtype, rng=0), nn.Tanh(),
                           nn.Linear(30, 7, dtype=dtype, rng=1)))
    rng = np.random.default_rng(100 + rank)
    before = []
    for p in f.parameters():
        p.grad = rng.standard_normal(p.size).astype(dtype)
        before.append(p.grad.copy())
    got = f.clip_grad_norm_(max_norm)
    return got, before, [p.grad.copy() for p in f.parameters()]


@pytest.mark.parametrize("chunk", [7, 1 << 20])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clip_grad_norm_in_chunks_matches_numpy(monkeypatch, chunk, dtype):
    monkeypatch.setattr(fsdp_mod, "_NORM_CHUNK", chunk)  # 7: many chunks and a remainder
    for max_norm in (1e6, 3.0):
        res = run_world(_clip, 2, args=(dtype, max_norm))
        flat = np.concatenate([g.astype(np.float64) for _, before, _ in res for g in before])
        norm = float(np.sqrt(np.sum(flat * flat)))
        scale = max_norm / (norm + 1e-6)
        for got, before, after in res:
            assert got == pytest.approx(norm, rel=1e-12)
            for b, a in zip(before, after):
                want = b if scale >= 1 else b * dtype(scale)
                np.testing.assert_allclose(a, want, rtol=1e-6 if dtype == np.float32 else 1e-12)


def test_clip_grad_norm_does_not_copy_a_shard_to_float64():
    n_el = 4 << 20  # a 16 MiB float32 shard; a float64 copy would take 32 MiB

    def body(rank, n):
        f = FSDP(nn.Linear(2048, 2048, dtype=np.float32, rng=0, bias=False))
        (p,) = f.parameters()
        assert p.size == n_el
        p.grad = np.full(p.size, 0.5, np.float32)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            got = f.clip_grad_norm_(1e9)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return got, peak

    ((got, peak),) = run_world(body, 1)
    assert got == pytest.approx(0.5 * np.sqrt(n_el), rel=1e-12)
    # one 1 Mi-element float64 chunk (8 MiB) at a time, far below the 32 MiB copy
    assert peak < 12 << 20, peak
