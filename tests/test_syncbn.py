"""SyncBatchNorm against BatchNorm1d on the concatenated batch.

Oracle: every rank builds the global batch from a seed, runs a plain
``BatchNorm1d`` on all of it, and compares with its own slice through
``SyncBatchNorm``: the forward output slice, the input-gradient slice, the
running statistics (after several steps, so momentum and the unbiased
variance matter) and the parameter gradients (their sum over ranks equals
the reference's, since each rank's are local sums).  Ranks hold different
batch sizes, including zero and one sample.  float64, tolerance 1e-10
relative plus 1e-10 of the array's largest magnitude: the fused statistics
use ``E[x^2] - E[x]^2`` in float64 where the reference uses
``mean((x - mean)^2)``.  A float16 layer is compared with the float64
reference on the same values, within a few float16 ulps.
"""

from __future__ import annotations

import numpy as np
import pytest

import ringlet
from ringlet import nn
from ringlet.nn.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from ringlet.testing import run_world

RTOL, ATOL = 1e-10, 1e-12
C = 3


def close(a, b, what=""):
    # Absolute slack scaled to the array: with a global batch of two, the input
    # gradient is a difference of nearly equal terms (BatchNorm of two samples
    # is almost constant), so small entries carry the large ones' rounding.
    b = np.asarray(b)
    atol = ATOL + 1e-10 * (float(np.max(np.abs(b))) if b.size else 0.0)
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=atol, err_msg=what)


def _batches(sizes, step, with_len):
    rng = np.random.default_rng(100 + step)
    n = sum(sizes)
    shape = (n, C, 4) if with_len else (n, C)
    x = rng.standard_normal(shape) * np.array([1.0, 3.0, 0.5]).reshape((1, C) + (1,) * (len(shape) - 2)) + 2.0
    g = rng.standard_normal(shape)
    off = np.concatenate([[0], np.cumsum(sizes)])
    return x, g, off


def _sync_vs_reference(rank, n, sizes, with_len, momentum):
    ref = nn.BatchNorm1d(C, momentum=momentum, dtype=np.float64)
    bn = SyncBatchNorm(C, momentum=momentum, dtype=np.float64)
    rng = np.random.default_rng(1)
    w, b = rng.uniform(0.5, 1.5, C), rng.uniform(-1, 1, C)
    for layer in (ref, bn):
        layer.weight.data[:] = w
        layer.bias.data[:] = b
    for step in range(3):
        x, g, off = _batches(sizes, step, with_len)
        lo, hi = off[rank], off[rank + 1]
        ref.zero_grad()
        bn.zero_grad()
        y_ref = ref(x)
        gx_ref = ref.backward(g)
        y = bn(x[lo:hi])
        assert y.shape == x[lo:hi].shape
        close(y, y_ref[lo:hi], f"forward, step {step}")
        gx = bn.backward(g[lo:hi])
        close(gx, gx_ref[lo:hi], f"input gradient, step {step}")
        close(bn.running_mean, ref.running_mean, "running_mean")
        close(bn.running_var, ref.running_var, "running_var")
        assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1
        # Parameter gradients are local sums: their sum over ranks is the reference.
        pg = np.concatenate([bn.weight.grad, bn.bias.grad])
        ringlet.all_reduce(pg)
        close(pg, np.concatenate([ref.weight.grad, ref.bias.grad]), "param grads")
    # Evaluation: running statistics, no communication (ranks may call it alone).
    bn.eval()
    ref.eval()
    x, _, off = _batches(sizes, 9, with_len)
    with nn.no_grad():
        close(bn(x[:2]), ref(x[:2]), "eval")
    return True


@pytest.mark.parametrize("sizes", [(2, 5, 1), (4, 0, 3), (1, 1)])
@pytest.mark.parametrize("with_len", [False, True])
def test_sync_batchnorm_equals_batchnorm_on_concatenated_batch(sizes, with_len):
    assert all(run_world(_sync_vs_reference, len(sizes), args=(sizes, with_len, 0.1)))


def test_sync_batchnorm_cumulative_momentum():
    assert all(run_world(_sync_vs_reference, 3, args=((3, 2, 4), False, None)))


def _counts_collectives(rank, n):
    # Exactly one all_reduce in forward and one in backward (each with a refusal flag).
    bn = SyncBatchNorm(C, dtype=np.float64)
    calls = []
    real = bn._all_reduce
    bn._all_reduce = lambda a: (calls.append(a.size), real(a))
    x = np.random.default_rng(rank).standard_normal((3 + rank, C))
    bn(x)
    assert calls == [2 * C + 2]
    bn.backward(np.ones_like(x))
    assert calls == [2 * C + 2, 2 * C + 1]
    return True


def test_one_fused_all_reduce_each_way():
    assert all(run_world(_counts_collectives, 2))


def _too_small(rank, n):
    bn = SyncBatchNorm(C)
    x = np.ones((1 if rank == 0 else 0, C), np.float32)
    with pytest.raises(ValueError, match="more than one value per channel over the group"):
        bn(x)
    return True


def test_global_batch_of_one_rejected_on_every_rank():
    assert all(run_world(_too_small, 2))


def _convert(rank, n):
    bn1 = nn.BatchNorm1d(4, dtype=np.float64)
    bn1.weight.data[:] = [1, 2, 3, 4]
    bn1.running_mean[:] = 0.5
    model = nn.Sequential(nn.Linear(3, 4, dtype=np.float64, rng=0), bn1, nn.ReLU(),
                          nn.Sequential(nn.BatchNorm1d(4, affine=False, dtype=np.float64)),
                          nn.Linear(4, 2, dtype=np.float64, rng=1))
    model.eval()
    params_before = [id(p) for p in model.parameters()]
    out = convert_sync_batchnorm(model)
    assert out is model
    assert [type(m).__name__ for m in model] == ["Linear", "SyncBatchNorm", "ReLU",
                                                  "Sequential", "Linear"]
    assert isinstance(model[3][0], SyncBatchNorm)
    assert [id(p) for p in model.parameters()] == params_before  # same Parameter objects
    assert model[1].running_mean is bn1.running_mean
    assert model[1].training is False
    np.testing.assert_array_equal(model[1].weight.data, [1, 2, 3, 4])
    # Converting a BatchNorm1d directly returns the new layer; SyncBatchNorm stays.
    single = convert_sync_batchnorm(nn.BatchNorm1d(2))
    assert isinstance(single, SyncBatchNorm)
    assert convert_sync_batchnorm(single) is single
    # The converted model trains like the unsplit one on the concatenated batch.
    model.train()
    ref = nn.Sequential(nn.Linear(3, 4, dtype=np.float64, rng=0), nn.BatchNorm1d(4, dtype=np.float64),
                        nn.ReLU(), nn.Sequential(nn.BatchNorm1d(4, affine=False, dtype=np.float64)),
                        nn.Linear(4, 2, dtype=np.float64, rng=1))
    ref.load_state_dict(model.state_dict())
    x = np.random.default_rng(0).standard_normal((6, 3))
    mine = np.array_split(np.arange(6), n)[rank]
    close(model(x[mine]), ref(x)[mine])
    with pytest.raises(TypeError, match="Module"):
        convert_sync_batchnorm("bn")
    return True


def test_convert_sync_batchnorm():
    assert all(run_world(_convert, 2))


def _eval_untracked_alone(rank, n):
    # Without running statistics, evaluation normalises by this rank's own
    # batch and communicates nothing: rank 0 evaluates while rank 1 does not.
    bn = SyncBatchNorm(C, track_running_stats=False, dtype=np.float64).eval()
    ref = nn.BatchNorm1d(C, track_running_stats=False, dtype=np.float64)
    calls = []
    bn._all_reduce = lambda a: calls.append(a.size)
    if rank == 0:
        x = np.random.default_rng(7).standard_normal((5, C)) * 2.0 + 1.0
        g = np.random.default_rng(8).standard_normal((5, C))
        close(bn(x), ref(x), "eval forward, local statistics")
        close(bn.backward(g), ref.backward(g), "eval input gradient")
        with pytest.raises(ValueError, match="more than one value per channel in evaluation"):
            bn(x[:1])
    assert calls == []
    ringlet.barrier(timeout=60)
    return True


def test_eval_without_running_stats_uses_local_batch_and_no_collective():
    assert all(run_world(_eval_untracked_alone, 2))


def close16(got, want, what):
    # Float16 against the float64 oracle: 4 float16 ulps (eps 2**-10) of each value,
    # plus 4 ulps of the array's largest magnitude.
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=4e-3,
                               atol=4e-3 * float(np.max(np.abs(want))), err_msg=what)


def _sync_float16(rank, n, scale):
    # Rank 0 holds 2560 values a channel, rank 1 1536.  In float16 the backward's
    # local sums of gradients near 0.3 stalled (scale 1), and a variance past 65504
    # became inf when cast to float16 (scale 300).
    sizes = (40, 24)
    bn = SyncBatchNorm(C, dtype=np.float16)
    ref = nn.BatchNorm1d(C, dtype=np.float64)
    rng = np.random.default_rng(1)
    bn.weight.data[:] = rng.uniform(0.5, 1.5, C)
    bn.bias.data[:] = rng.uniform(-1, 1, C)
    ref.weight.data[:] = bn.weight.data
    ref.bias.data[:] = bn.bias.data
    x = (rng.standard_normal((sum(sizes), C, 64)) * scale + 0.2 * scale).astype(np.float16)
    g = rng.uniform(0.2, 0.4, x.shape).astype(np.float16)
    lo, hi = (0, sizes[0]) if rank == 0 else (sizes[0], sum(sizes))
    with np.errstate(over="raise", invalid="raise"):
        y = bn(x[lo:hi])
        gx = bn.backward(g[lo:hi])
    # Parameter gradients are local sums: their sum over ranks is the reference.
    pg = np.concatenate([bn.weight.grad, bn.bias.grad]).astype(np.float64)
    ringlet.all_reduce(pg)
    y_ref = ref(x.astype(np.float64))
    gx_ref = ref.backward(g.astype(np.float64))
    assert y.dtype == gx.dtype == bn.weight.grad.dtype == np.float16
    close16(y, y_ref[lo:hi], "forward")
    close16(gx, gx_ref[lo:hi], "input gradient")
    close16(pg[:C], ref.weight.grad, "weight gradient")
    close16(pg[C:], ref.bias.grad, "bias gradient")
    close16(bn.running_mean, ref.running_mean, "running_mean")
    close16(bn.running_var, ref.running_var, "running_var")
    return True


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_sync_batchnorm_float16_computes_in_float32(scale):
    assert all(run_world(_sync_float16, 2, args=(scale,)))
