"""ringlet.nn: every backward against central finite differences (float64), float16
layers against float64 ones, hooks, multi-forward context queues, no_grad, state dicts
and argument checking."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ringlet import nn

RNG = np.random.default_rng(1234)


# ---- finite-difference machinery ---------------------------------------------------
def _numeric_grad(f, x, idx, h=1e-6):
    """Central differences of scalar f() w.r.t. x[idx] for each flat index in idx."""
    out = np.empty(len(idx))
    flat = x.reshape(-1)
    for k, i in enumerate(idx):
        old = flat[i]
        flat[i] = old + h
        fp = f()
        flat[i] = old - h
        fm = f()
        flat[i] = old
        out[k] = (fp - fm) / (2 * h)
    return out


def _sample(n, k=40):
    return np.arange(n) if n <= k else RNG.choice(n, k, replace=False)


def check_module(module, x, *, input_grad=True, rtol=1e-6, atol=1e-8):
    """Compare module.backward with finite differences of sum(module(x) * R)."""
    module.zero_grad()
    y = module(x)
    R = RNG.standard_normal(y.shape)
    gx = module.backward(R)
    assert module.num_saved_contexts() == 0

    def f():
        with nn.no_grad():
            return float(np.sum(module(x) * R))

    if input_grad:
        assert gx.shape == x.shape and gx.dtype == np.float64
        idx = _sample(x.size)
        np.testing.assert_allclose(gx.reshape(-1)[idx], _numeric_grad(f, x, idx),
                                   rtol=rtol, atol=atol)
    for name, p in module.named_parameters():
        assert p.grad is not None, name
        idx = _sample(p.size)
        np.testing.assert_allclose(p.grad.reshape(-1)[idx], _numeric_grad(f, p.data, idx),
                                   rtol=rtol, atol=atol, err_msg=name)
    return gx


def f64(*shape):
    return RNG.standard_normal(shape)


# ---- layers vs finite differences ---------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 4), (3, 2, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_grad(shape, bias):
    check_module(nn.Linear(4, 3, bias, dtype=np.float64, rng=0), f64(*shape))


def test_relu_grad():
    x = f64(6, 5)
    x[np.abs(x) < 1e-3] = 0.5  # keep away from the kink
    check_module(nn.ReLU(), x)


def test_relu_keeps_nan_like_torch():
    """A NaN that came out as 0 hid a diverged layer upstream: the loss stayed finite.
    torch (and ringlet.nn.functional.relu) keep it; torch's backward passes the
    gradient at a NaN (its mask is ``not x <= 0``)."""
    x = np.array([[np.nan, -1.0, 2.0, -np.inf, np.inf, 0.0]])
    relu = nn.ReLU()
    y = relu(x)
    np.testing.assert_array_equal(y, [[np.nan, 0.0, 2.0, 0.0, np.inf, 0.0]])
    np.testing.assert_array_equal(y, nn.functional.relu(x))
    np.testing.assert_array_equal(relu.backward(np.full(x.shape, 3.0)), [[3, 0, 3, 0, 3, 0]])
    torch = pytest.importorskip("torch")
    tx = torch.from_numpy(x.copy()).requires_grad_(True)
    ty = torch.nn.ReLU()(tx)
    ty.backward(torch.full(x.shape, 3.0, dtype=torch.float64))
    np.testing.assert_array_equal(y, ty.detach().numpy())
    np.testing.assert_array_equal(relu(x), y)
    np.testing.assert_array_equal(relu.backward(np.full(x.shape, 3.0)), tx.grad.numpy())


def test_gelu_and_tanh_grad():
    check_module(nn.GELU(), f64(4, 3, 5))
    check_module(nn.Tanh(), f64(4, 7))


def test_gelu_is_tanh_approximation_close_to_erf():
    x = np.linspace(-6, 6, 2001)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    with nn.no_grad():
        got = nn.GELU()(x)
    err = np.max(np.abs(got - exact))
    assert 1e-6 < err < 1e-3  # an approximation, and a close one


@pytest.mark.parametrize("shape,norm", [((5, 6), 6), ((2, 3, 6), 6), ((2, 3, 4), (3, 4))])
def test_layernorm_grad(shape, norm):
    ln = nn.LayerNorm(norm, dtype=np.float64)
    ln.weight.data[...] = RNG.standard_normal(ln.weight.shape)
    ln.bias.data[...] = RNG.standard_normal(ln.bias.shape)
    check_module(ln, f64(*shape))
    check_module(nn.LayerNorm(norm, elementwise_affine=False, dtype=np.float64), f64(*shape))


def test_layernorm_normalises():
    with nn.no_grad():
        y = nn.LayerNorm(8, dtype=np.float64)(f64(4, 8) * 3 + 2)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(-1), 1, rtol=1e-4)


def test_embedding_grad_repeated_indices_and_padding():
    emb = nn.Embedding(7, 3, padding_idx=2, dtype=np.float64, rng=0)
    assert np.all(emb.weight.data[2] == 0)
    idx = np.array([[1, 1, 2], [6, 1, 0]])
    y = emb(idx)
    assert y.shape == (2, 3, 3)
    R = f64(*y.shape)
    assert emb.backward(R) is None
    want = np.zeros((7, 3))
    for (i, j), k in np.ndenumerate(idx):
        if k != 2:
            want[k] += R[i, j]
    np.testing.assert_array_equal(emb.weight.grad, want)

    def f():
        with nn.no_grad():
            return float(np.sum(emb(idx) * R))
    emb.zero_grad()
    emb(idx)
    emb.backward(R)
    rows = [0, 1, 6]  # the padding row is constant by definition
    sel = np.array([r * 3 + c for r in rows for c in range(3)])
    np.testing.assert_allclose(emb.weight.grad.reshape(-1)[sel],
                               _numeric_grad(f, emb.weight.data, sel), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("shape", [(8, 3), (4, 3, 5)])
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_grad(shape, training):
    bn = nn.BatchNorm1d(3, dtype=np.float64)
    bn.weight.data[...] = RNG.standard_normal(3)
    bn.bias.data[...] = RNG.standard_normal(3)
    bn.running_mean[...] = RNG.standard_normal(3)
    bn.running_var[...] = RNG.uniform(0.5, 2, 3)
    bn.train(training)
    check_module(bn, f64(*shape) * 2 + 1)
    check_module(nn.BatchNorm1d(3, affine=False, dtype=np.float64).train(training), f64(*shape))


def test_batchnorm_running_stats_like_torch():
    bn = nn.BatchNorm1d(2, momentum=0.25, dtype=np.float64)
    xs = [f64(6, 2) * 3 + 1 for _ in range(3)]
    rm, rv = np.zeros(2), np.ones(2)
    ids = {id(bn.running_mean), id(bn.running_var)}
    for x in xs:
        y = bn(x)
        bn.clear_context()
        np.testing.assert_allclose(y, (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5), rtol=1e-12)
        rm = 0.75 * rm + 0.25 * x.mean(0)
        rv = 0.75 * rv + 0.25 * x.var(0, ddof=1)  # unbiased, as torch
    np.testing.assert_allclose(bn.running_mean, rm, rtol=1e-12)
    np.testing.assert_allclose(bn.running_var, rv, rtol=1e-12)
    assert int(bn.num_batches_tracked) == 3
    assert {id(bn.running_mean), id(bn.running_var)} == ids  # updated in place
    bn.eval()
    x = f64(5, 2)
    with nn.no_grad():
        np.testing.assert_allclose(bn(x), (x - rm) / np.sqrt(rv + 1e-5), rtol=1e-12)
    # cumulative average with momentum=None
    bn2 = nn.BatchNorm1d(2, momentum=None, dtype=np.float64)
    with nn.no_grad():
        for x in xs:
            bn2(x)
    np.testing.assert_allclose(bn2.running_mean, np.mean([x.mean(0) for x in xs], 0), rtol=1e-12)
    with pytest.raises(ValueError, match="more than one value"):
        bn2(f64(1, 2))


@pytest.mark.parametrize("momentum", [0.25, None])
def test_batchnorm_forward_that_raises_leaves_running_stats_alone(momentum):
    """The running statistics change only once the forward can no longer fail
    (here the affine step overflows under np.errstate, as running out of memory would)."""
    bn = nn.BatchNorm1d(2, momentum=momentum, dtype=np.float64)
    ref = nn.BatchNorm1d(2, momentum=momentum, dtype=np.float64)
    x0 = f64(6, 2) * 3 + 1
    x1 = np.zeros((6, 2))
    x1[5] = 10.0  # normalised to 2.24: times 1e308 overflows
    for m in (bn, ref):
        with nn.no_grad():
            m(x0)
    before = {k: v.copy() for k, v in bn.state_dict().items()}
    bn.weight.data[...] = 1e308
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        bn(x1)
    bn.weight.data[...] = 1.0
    for k, v in bn.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    with nn.no_grad():
        np.testing.assert_array_equal(bn(x1), ref(x1))
    for k, v in bn.state_dict().items():
        np.testing.assert_array_equal(v, ref.state_dict()[k], err_msg=k)


def test_dropout():
    d = nn.Dropout(0.3, rng=0)
    x = RNG.uniform(1, 2, (200, 50)).astype(np.float32)
    y = d(x)
    assert y.dtype == np.float32
    kept = y != 0
    assert 0.65 < kept.mean() < 0.75
    np.testing.assert_allclose(y[kept], x[kept] / 0.7, rtol=1e-6)
    g = RNG.standard_normal(x.shape).astype(np.float32)
    gx = d.backward(g)
    np.testing.assert_allclose(gx, np.where(kept, g / 0.7, 0), rtol=1e-6)
    d.eval()
    assert d(x) is x and d.backward(g) is g
    d.train()
    assert np.all(nn.Dropout(1.0)(x) == 0)
    with pytest.raises(ValueError):
        nn.Dropout(1.5)


def test_losses_vs_finite_differences():
    pred, target = f64(4, 3), f64(4, 3)
    for red in ("mean", "sum"):
        loss, g = nn.mse_loss(pred, target, red)
        want = np.sum((pred - target) ** 2) / (12 if red == "mean" else 1)
        assert loss == pytest.approx(want, rel=1e-12)
        idx = np.arange(12)
        np.testing.assert_allclose(
            g.reshape(-1), _numeric_grad(lambda: nn.mse_loss(pred, target, red)[0], pred, idx),
            rtol=1e-6, atol=1e-9)
    logits = f64(2, 3, 5) * 3
    t = np.array([[0, 4, 2], [1, 1, 3]])
    for red, ign in (("mean", None), ("sum", None), ("mean", 4)):
        loss, g = nn.cross_entropy(logits, t, red, ignore_index=ign)
        z = logits.reshape(-1, 5)
        lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        keep = t.reshape(-1) != (ign if ign is not None else -1)
        want = -lp[np.arange(6), t.reshape(-1)][keep].sum() / (keep.sum() if red == "mean" else 1)
        assert loss == pytest.approx(want, rel=1e-12)
        idx = np.arange(logits.size)
        num = _numeric_grad(lambda: nn.cross_entropy(logits, t, red, ignore_index=ign)[0],
                            logits, idx)
        np.testing.assert_allclose(g.reshape(-1), num, rtol=1e-6, atol=1e-8)


def test_cross_entropy_is_stable_and_checks_labels():
    loss, g = nn.cross_entropy(np.array([[1000.0, 0.0], [0.0, -1000.0]], np.float32),
                               np.array([0, 1]))
    assert np.isfinite(loss) and loss == pytest.approx(500.0, rel=1e-6)
    assert g.dtype == np.float32 and np.all(np.isfinite(g))
    with pytest.raises(ValueError, match="labels"):
        nn.cross_entropy(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(TypeError, match="integer"):
        nn.cross_entropy(np.zeros((2, 3)), np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="shape"):
        nn.cross_entropy(np.zeros((2, 3)), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="reduction"):
        nn.mse_loss(np.zeros(2), np.zeros(2), "none")


def test_sequential_composite_grad_and_indexing():
    model = nn.Sequential(nn.Linear(5, 6, dtype=np.float64, rng=1), nn.Tanh(),
                          nn.LayerNorm(6, dtype=np.float64), nn.GELU(),
                          nn.Linear(6, 2, dtype=np.float64, rng=2))
    check_module(model, f64(3, 4, 5))
    assert len(model) == 5 and isinstance(model[-1], nn.Linear)
    assert [type(m).__name__ for m in model][:2] == ["Linear", "Tanh"]
    assert len(model[1:3]) == 2 and model[1:3][0] is model[1]
    assert [n for n, _ in model.named_parameters()] == [
        "0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    with pytest.raises(IndexError):
        model[5]
    with pytest.raises(TypeError):
        nn.Sequential(nn.ReLU(), "relu")


def test_module_used_twice_in_one_forward():
    # The same Tanh object after two layers: its two contexts are consumed in
    # reverse call order within the pass.
    act = nn.Tanh()
    model = nn.Sequential(nn.Linear(4, 5, dtype=np.float64, rng=3), act,
                          nn.Linear(5, 3, dtype=np.float64, rng=4), act)
    check_module(model, f64(6, 4))


# ---- dtypes -------------------------------------------------------------------------------
def test_float32_default_and_float64_flow():
    m = nn.Sequential(nn.Linear(3, 4, rng=0), nn.GELU(), nn.LayerNorm(4), nn.Linear(4, 2, rng=1))
    assert all(p.dtype == np.float32 for p in m.parameters())
    y = m(np.ones((2, 3)))  # float64 input is cast to the parameters' dtype
    assert y.dtype == np.float32
    m.backward(np.ones_like(y))
    assert all(p.grad.dtype == np.float32 for p in m.parameters())
    m64 = nn.Linear(3, 2, dtype=np.float64)
    assert m64(np.ones((1, 3), np.float32)).dtype == np.float64
    m64.clear_context()
    m.to(np.float64)
    assert all(p.dtype == np.float64 and p.grad is None for p in m.parameters())
    with pytest.raises(TypeError, match="dtype"):
        nn.Linear(2, 2, dtype=np.int32)
    # Layers without parameters compute in the dtype .to() gave them.
    for layer in (nn.BatchNorm1d(3, affine=False), nn.LayerNorm(3, elementwise_affine=False)):
        layer.to(np.float64)
        x = np.random.default_rng(0).standard_normal((4, 3))
        y = layer(x)
        assert y.dtype == np.float64
        layer.eval()
        assert layer(x).dtype == np.float64
        layer.clear_context()


# ---- float16: computed in float32 inside, like torch --------------------------------------
# Oracle: the same layer in float64 on the float16 values (inputs, parameters and
# gradients cast up exactly), so only the layer's own arithmetic is compared.
def close16(got, want, what, atol=None):
    """Within 4 float16 ulps (eps 2**-10) of each value, plus ``atol`` (default: 4 ulps of
    the array's largest magnitude, for entries that are differences of large terms)."""
    assert got.dtype == np.float16, what
    want = np.asarray(want, np.float64)
    if atol is None:
        atol = 4e-3 * float(np.max(np.abs(want)))
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=4e-3, atol=atol, err_msg=what)


def _twin64(layer16, layer64):
    for (name, p16), (_, p64) in zip(layer16.named_parameters(), layer64.named_parameters()):
        p64.data[...] = p16.data
    return layer64


def _vs_float64(layer16, layer64, x, g):
    """Forward and backward both layers; compare outputs and every gradient.  Internal
    overflow or an invalid operation raises (a float16 intermediate past 65504 did)."""
    with np.errstate(over="raise", invalid="raise"):
        y = layer16(x)
        gx = layer16.backward(g)
    y64 = layer64(x.astype(np.float64))
    gx64 = layer64.backward(g.astype(np.float64))
    close16(y, y64, "forward")
    close16(gx, gx64, "input gradient")
    for (name, p16), (_, p64) in zip(layer16.named_parameters(), layer64.named_parameters()):
        close16(p16.grad, p64.grad, f"{name} gradient")


def test_gelu_float16_computes_in_float32():
    """In float16 the derivative's x^2 term overflowed past |x| ~ 700, giving 0 * inf,
    a NaN gradient where the true one is 0 or 1, and 1 - tanh^2 lost its digits."""
    x = np.concatenate([np.linspace(-8, 8, 321),
                        [-65504, -3e4, -1e3, -300, 300, 1e3, 3e4, 65504]]).astype(np.float16)
    g = RNG.standard_normal(x.shape).astype(np.float16)
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    F = nn.functional
    with np.errstate(over="raise", invalid="raise"):
        layer = nn.GELU()
        y = layer(x)
        gx = layer.backward(g)
        fy, fg = F.gelu(x), F.gelu_grad(x)
    close16(y, F.gelu(x64), "GELU forward", atol=2e-3)
    close16(gx, g64 * F.gelu_grad(x64), "GELU input gradient", atol=2e-3)
    close16(fy, F.gelu(x64), "functional.gelu", atol=2e-3)
    close16(fg, F.gelu_grad(x64), "functional.gelu_grad", atol=2e-3)


# Gradients near 0.3 summed over 4096 rows in float16 stalled (at 1024: adding less than
# half an ulp changes nothing); scale 300: squared deviations past 256 overflowed and the
# variance became inf.
@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_layernorm_float16_computes_in_float32(scale):
    ln = nn.LayerNorm(8, dtype=np.float16)
    ln.weight.data[...] = RNG.uniform(0.5, 1.5, 8)
    ln.bias.data[...] = RNG.uniform(-1, 1, 8)
    x = (RNG.standard_normal((64, 64, 8)) * scale + 0.2 * scale).astype(np.float16)
    g = RNG.uniform(0.2, 0.4, x.shape).astype(np.float16)
    _vs_float64(ln, _twin64(ln, nn.LayerNorm(8, dtype=np.float64)), x, g)


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_batchnorm_float16_computes_in_float32(scale):
    bn = nn.BatchNorm1d(3, dtype=np.float16)
    bn.weight.data[...] = RNG.uniform(0.5, 1.5, 3)
    bn.bias.data[...] = RNG.uniform(-1, 1, 3)
    ref = _twin64(bn, nn.BatchNorm1d(3, dtype=np.float64))
    # 4096 values a channel
    x = (RNG.standard_normal((64, 3, 64)) * scale + 0.2 * scale).astype(np.float16)
    g = RNG.uniform(0.2, 0.4, x.shape).astype(np.float16)
    _vs_float64(bn, ref, x, g)
    close16(bn.running_mean, ref.running_mean, "running_mean")
    close16(bn.running_var, ref.running_var, "running_var")
    bn.eval()
    ref.eval()
    bn.zero_grad()
    ref.zero_grad()
    _vs_float64(bn, ref, x, g)  # normalised by the running statistics


def test_linear_float16_bias_gradient_sums_in_float32():
    # The bias gradient, a sum over 4096 rows of values near 0.3, stalled in float16.
    fc = nn.Linear(8, 4, dtype=np.float16, rng=0)
    x = RNG.standard_normal((4096, 8)).astype(np.float16)
    g = RNG.uniform(0.2, 0.4, (4096, 4)).astype(np.float16)
    _vs_float64(fc, _twin64(fc, nn.Linear(8, 4, dtype=np.float64, rng=0)), x, g)


def test_embedding_float16_repeated_rows_sum_in_float32():
    # A row looked up 4096 times: its gradient, summed in float16, stalled.
    emb = nn.Embedding(5, 4, dtype=np.float16, rng=0)
    idx = RNG.permutation(np.concatenate([np.full(4096, 1), np.arange(5)])).reshape(1367, 3)
    g = RNG.uniform(0.2, 0.4, idx.shape + (4,)).astype(np.float16)
    emb(idx)
    assert emb.backward(g) is None
    want = np.zeros((5, 4))
    np.add.at(want, idx.reshape(-1), g.reshape(-1, 4).astype(np.float64))
    assert emb.weight.grad.dtype == np.float16
    close16(emb.weight.grad, want, "weight gradient")


def test_linear_init_like_torch():
    torch = _torch()
    fc = nn.Linear(400, 300, rng=0)
    bound = 1 / math.sqrt(400)
    assert fc.weight.shape == (300, 400) and fc.bias.shape == (300,)
    for a in (fc.weight.data, fc.bias.data):
        assert a.min() >= -bound and a.max() <= bound and a.max() > 0.9 * bound
    # the same distribution as torch's default init: deciles of 120,000 draws
    # agree to well under a percent of the bound (a normal init, or a bound of
    # 1/in_features or 1/sqrt(out_features), is off by far more)
    torch.manual_seed(0)
    tw = torch.nn.Linear(400, 300).weight.detach().numpy()
    qs = np.linspace(0.1, 0.9, 9)
    np.testing.assert_allclose(np.quantile(fc.weight.data, qs), np.quantile(tw, qs),
                               rtol=0, atol=0.01 * bound)
    # a seed fixes the values, and different seeds give different ones
    np.testing.assert_array_equal(nn.Linear(4, 4, rng=7).weight.data,
                                  nn.Linear(4, 4, rng=7).weight.data)
    assert not np.array_equal(nn.Linear(4, 4, rng=7).weight.data,
                              nn.Linear(4, 4, rng=8).weight.data)


# ---- torch as the oracle: forward and backward ----------------------------------------
def _torch():
    # torch (CPU) is the independent oracle here; until CI installs it for the
    # test extra these tests skip without it (docs/testing.md).
    return pytest.importorskip("torch")


def _vs_torch(mod, tmod, x, *, rtol=1e-10, atol=1e-12, input_grad=True):
    """Forward x and backward a random gradient through ringlet's module and
    torch's with the same parameters (float64); outputs, input gradients and
    parameter gradients must agree."""
    torch = _torch()
    tparams = dict(tmod.named_parameters())
    assert sorted(tparams) == sorted(n for n, _ in mod.named_parameters())
    with torch.no_grad():
        for name, p in mod.named_parameters():
            tparams[name].copy_(torch.from_numpy(np.array(p.data)))
    mod.zero_grad()
    y = mod(x)
    R = RNG.standard_normal(y.shape)
    gx = mod.backward(R)
    tx = torch.from_numpy(np.array(x))
    if input_grad:
        tx.requires_grad_(True)
    ty = tmod(tx)
    ty.backward(torch.from_numpy(R))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=rtol, atol=atol, err_msg="forward")
    if input_grad:
        np.testing.assert_allclose(gx, tx.grad.numpy(), rtol=rtol, atol=atol, err_msg="input grad")
    for name, p in mod.named_parameters():
        np.testing.assert_allclose(p.grad, tparams[name].grad.numpy(), rtol=rtol, atol=atol,
                                   err_msg=name)


def test_linear_relu_gelu_tanh_match_torch():
    torch = _torch()
    tnn = torch.nn
    x = f64(5, 3, 6)
    _vs_torch(nn.Linear(6, 4, dtype=np.float64, rng=1), tnn.Linear(6, 4).double(), x)
    _vs_torch(nn.Linear(6, 4, bias=False, dtype=np.float64, rng=1),
              tnn.Linear(6, 4, bias=False).double(), x)
    _vs_torch(nn.ReLU(), tnn.ReLU(), x)
    _vs_torch(nn.GELU(), tnn.GELU(approximate="tanh"), x * 3)
    _vs_torch(nn.Tanh(), tnn.Tanh(), x * 2)
    mlp = nn.Sequential(nn.Linear(6, 8, dtype=np.float64, rng=2), nn.GELU(),
                        nn.LayerNorm(8, dtype=np.float64), nn.Linear(8, 3, dtype=np.float64, rng=3))
    tmlp = tnn.Sequential(tnn.Linear(6, 8), tnn.GELU(approximate="tanh"), tnn.LayerNorm(8),
                          tnn.Linear(8, 3)).double()
    _vs_torch(mlp, tmlp, x)


@pytest.mark.parametrize("shape", [(4, 8), (2, 3, 2, 4)])
def test_layernorm_matches_torch(shape):
    torch = _torch()
    ln = nn.LayerNorm(shape[-2:] if len(shape) > 2 else shape[-1], dtype=np.float64)
    ln.weight.data[...] = RNG.standard_normal(ln.weight.shape)
    ln.bias.data[...] = RNG.standard_normal(ln.bias.shape)
    tln = torch.nn.LayerNorm(ln.normalized_shape).double()
    _vs_torch(ln, tln, f64(*shape) * 3 + 1)


@pytest.mark.parametrize("shape", [(8, 3), (4, 3, 5)])
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_matches_torch(shape, training):
    torch = _torch()
    bn = nn.BatchNorm1d(3, momentum=0.3, dtype=np.float64)
    tbn = torch.nn.BatchNorm1d(3, momentum=0.3).double()
    rm, rv = RNG.standard_normal(3), RNG.uniform(0.5, 2, 3)
    bn.running_mean[...], bn.running_var[...] = rm, rv
    with torch.no_grad():
        tbn.running_mean.copy_(torch.from_numpy(rm))
        tbn.running_var.copy_(torch.from_numpy(rv))
    bn.weight.data[...] = RNG.standard_normal(3)
    bn.bias.data[...] = RNG.standard_normal(3)
    bn.train(training)
    tbn.train(training)
    _vs_torch(bn, tbn, f64(*shape) * 2 + 1)
    np.testing.assert_allclose(bn.running_mean, tbn.running_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(bn.running_var, tbn.running_var.numpy(), rtol=1e-12)


def test_embedding_matches_torch():
    torch = _torch()
    emb = nn.Embedding(7, 3, padding_idx=2, dtype=np.float64, rng=0)
    temb = torch.nn.Embedding(7, 3, padding_idx=2).double()
    idx = np.array([[1, 1, 2], [6, 1, 0]])
    with torch.no_grad():
        temb.weight.copy_(torch.from_numpy(emb.weight.data))
    emb.zero_grad()
    y = emb(idx)
    R = f64(*y.shape)
    emb.backward(R)
    ty = temb(torch.from_numpy(idx))
    ty.backward(torch.from_numpy(R))
    np.testing.assert_array_equal(y, ty.detach().numpy())
    np.testing.assert_allclose(emb.weight.grad, temb.weight.grad.numpy(), rtol=1e-12, atol=0)


def test_losses_match_torch():
    torch = _torch()
    F = torch.nn.functional
    pred, target = f64(4, 3), f64(4, 3)
    for red in ("mean", "sum"):
        loss, g = nn.mse_loss(pred, target, red)
        tp = torch.from_numpy(pred).requires_grad_(True)
        tl = F.mse_loss(tp, torch.from_numpy(target), reduction=red)
        tl.backward()
        assert loss == pytest.approx(tl.item(), rel=1e-12)
        np.testing.assert_allclose(g, tp.grad.numpy(), rtol=1e-12, atol=1e-15)
    logits = f64(2, 3, 5) * 3
    t = np.array([[0, 4, 2], [1, 1, 3]])
    for red, ign in (("mean", None), ("sum", None), ("mean", 4)):
        loss, g = nn.cross_entropy(logits, t, red, ignore_index=ign)
        # ringlet's class axis is the last one, torch's is axis 1: flatten both
        tz = torch.from_numpy(logits.reshape(-1, 5)).requires_grad_(True)
        tl = F.cross_entropy(tz, torch.from_numpy(t.reshape(-1)), reduction=red,
                             ignore_index=-100 if ign is None else ign)
        tl.backward()
        assert loss == pytest.approx(tl.item(), rel=1e-12)
        np.testing.assert_allclose(g.reshape(-1, 5), tz.grad.numpy(), rtol=1e-10, atol=1e-15)


# ---- gradients in place, hooks, context queues --------------------------------------------
def test_grads_accumulate_in_place_into_views():
    m = nn.Sequential(nn.Linear(3, 4, rng=0), nn.ReLU(), nn.Linear(4, 2, rng=1))
    ps = list(m.parameters())
    flat = np.zeros(sum(p.size for p in ps), np.float32)
    off = 0
    for p in ps:
        p.grad = flat[off:off + p.size].reshape(p.shape)
        off += p.size
    views = [p.grad for p in ps]
    x = RNG.standard_normal((5, 3)).astype(np.float32)
    m.backward(np.ones_like(m(x)))
    first = flat.copy()
    assert np.any(first != 0)
    m.backward(np.ones_like(m(x)))
    np.testing.assert_allclose(flat, 2 * first, rtol=1e-6)
    assert all(p.grad is v for p, v in zip(ps, views))
    m.zero_grad()
    assert np.all(flat == 0) and all(p.grad is v for p, v in zip(ps, views))


def test_hooks_fire_once_per_param_per_backward():
    m = nn.Sequential(nn.Linear(3, 4, rng=0), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2, rng=1))
    fired = []
    h = m.register_grad_ready_hook(lambda p: fired.append(id(p)))
    x = RNG.standard_normal((5, 3)).astype(np.float32)
    for _ in range(2):
        fired.clear()
        m.backward(np.ones_like(m(x)))
        assert sorted(fired) == sorted(id(p) for p in m.parameters())
    # reverse order of use: the last layer's parameters are ready first
    order = [id(p) for p in m.parameters()]
    assert set(fired[:2]) == set(order[-2:])
    h.remove()
    fired.clear()
    m.backward(np.ones_like(m(x)))
    assert fired == []


def test_tied_parameter_fires_after_last_use():
    emb = nn.Embedding(6, 4, dtype=np.float64, rng=0)
    head = nn.Linear(4, 6, bias=False, dtype=np.float64, rng=1)
    head.weight = emb.weight  # tied

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.ln, self.head = emb, nn.LayerNorm(4, dtype=np.float64), head

        def forward(self, idx):
            return self.head(self.ln(self.emb(idx)))

        def backward(self, g):
            return self.emb.backward(self.ln.backward(self.head.backward(g)))

    lm = LM()
    assert [n for n, _ in lm.named_parameters()] == ["emb.weight", "ln.weight", "ln.bias"]
    assert list(lm.state_dict()) == ["emb.weight", "ln.weight", "ln.bias", "head.weight"]
    snaps = []
    emb.weight.register_grad_ready_hook(lambda p: snaps.append(p.grad.copy()))
    idx = np.array([[0, 3, 5], [3, 3, 1]])
    R = f64(2, 3, 6)
    lm(idx)
    lm.backward(R)
    assert len(snaps) == 1
    np.testing.assert_array_equal(snaps[0], emb.weight.grad)  # fired with the full sum

    def f():
        with nn.no_grad():
            return float(np.sum(lm(idx) * R))
    sel = np.arange(emb.weight.size)
    np.testing.assert_allclose(emb.weight.grad.reshape(-1),
                               _numeric_grad(f, emb.weight.data, sel), rtol=1e-6, atol=1e-8)


def test_fifo_multiple_forwards_in_flight():
    m = nn.Sequential(nn.Linear(3, 5, dtype=np.float64, rng=0), nn.Dropout(0.0), nn.Tanh(),
                      nn.Linear(5, 2, dtype=np.float64, rng=1))
    xs = [f64(4, 3) for _ in range(3)]
    gs = [f64(4, 2) for _ in range(3)]
    # reference: one forward/backward at a time (gradients summed over the three)
    want_gx = []
    for x, g in zip(xs, gs):
        m(x)
        want_gx.append(m.backward(g))
    want_grads = [p.grad.copy() for p in m.parameters()]
    m.zero_grad()
    fired = []
    m.register_grad_ready_hook(lambda p: fired.append(p))
    for x in xs:  # three forwards in flight, then three backwards, oldest first
        m(x)
    assert m[0].num_saved_contexts() == 3
    got_gx = []
    for k, g in enumerate(gs):
        got_gx.append(m.backward(g))
        assert len(fired) == (4 if k == 2 else 0)  # ready only after the last micro-batch
    for a, b in zip(got_gx, want_gx):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    for p, w in zip(m.parameters(), want_grads):
        np.testing.assert_allclose(p.grad, w, rtol=1e-12)


def test_no_grad_and_clear_context():
    m = nn.Sequential(nn.Linear(3, 2, rng=0), nn.ReLU())
    x = np.ones((2, 3), np.float32)
    assert nn.is_grad_enabled()
    with nn.no_grad():
        assert not nn.is_grad_enabled()
        m(x)
        with nn.enable_grad():
            assert nn.is_grad_enabled()
    assert nn.is_grad_enabled()
    assert m[0].num_saved_contexts() == 0 and m.saved_bytes() == 0
    with pytest.raises(RuntimeError, match="no saved forward context"):
        m.backward(np.ones((2, 2), np.float32))
    fired = []
    m.register_grad_ready_hook(lambda p: fired.append(p))
    m(x)
    m(x.copy())
    # per forward: Linear keeps x (2x3 float32), ReLU its (2x2) bool mask
    assert m.saved_bytes() == 2 * (2 * 3 * 4 + 2 * 2)
    m.clear_context()
    assert m[0].num_saved_contexts() == 0
    m.backward(np.ones_like(m(x)))
    assert len(fired) == 2  # outstanding-use counts were reset by clear_context


def test_a_forward_that_raises_leaves_no_context_behind():
    """The layers that ran before a failure saved contexts for a backward that
    can never come; the next backward must not pop them (it would compute the
    gradient of the failed batch), and earlier outstanding forwards keep theirs."""

    class Boom(nn.Module):
        armed = False

        def forward(self, x):
            if self.armed:
                raise RuntimeError("boom")
            self._save(None)
            return x

        def backward(self, g):
            self._pop()
            return g

    def model():
        return nn.Sequential(nn.Linear(4, 4, rng=0), Boom(), nn.Linear(4, 2, rng=1))

    x0, x1, x2 = (RNG.standard_normal((3, 4)) for _ in range(3))
    g = np.ones((3, 2))
    want = model()
    want(x0)
    want.backward(g)
    want(x2)
    want.backward(g)
    m = model()
    fired = []
    m.register_grad_ready_hook(lambda p: fired.append(p))
    m(x0)                    # outstanding: must survive the failure below
    m[1].armed = True
    with pytest.raises(RuntimeError, match="boom"):
        m(x1)
    assert m[0].num_saved_contexts() == 1 and m[1].num_saved_contexts() == 1
    m[1].armed = False
    m.backward(g)            # the backward of x0
    assert len(fired) == 4   # the failed pass's uses were released: hooks fire as usual
    m(x2)
    m.backward(g)
    assert m.saved_bytes() == 0 and len(fired) == 8
    for p, w in zip(m.parameters(), want.parameters()):
        np.testing.assert_allclose(p.grad, w.grad, rtol=1e-12)


class _SaveThenRaise(nn.Module):
    """Scales by a parameter; when armed, raises after it has saved its context."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(np.full(4, 2.0))
        self.armed = False

    def forward(self, x):
        self._save(x, (self.w,))
        if self.armed:
            raise MemoryError("simulated: no room for the output")
        return x * self.w.data

    def backward(self, g):
        x = self._pop()
        self.w.accumulate_grad((g * x).sum(axis=0))
        return g * self.w.data


def test_a_call_that_raises_inside_a_forward_that_recovers_leaves_no_use_behind():
    """The enclosing forward catches the failure and carries on, so the pass
    succeeds: the failed call's contexts and parameter uses must still go, or
    the next backward pops the wrong context and the hooks wait for a use that
    never comes."""

    class Fallback(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, dtype=np.float64, rng=0)
            self.flaky = _SaveThenRaise()
            self.fast = nn.Sequential(self.lin, self.flaky)

        def forward(self, x):
            try:
                self.route = "fast"
                return self.fast(x)
            except MemoryError:
                self.route = "slow"
                return self.lin(x)

        def backward(self, g):
            return (self.fast if self.route == "fast" else self.lin).backward(g)

    m = Fallback()
    fired = []
    m.register_grad_ready_hook(lambda p: fired.append(p))
    x, g = f64(3, 4), f64(3, 4)
    m.flaky.armed = True
    m(x)
    assert m.lin.num_saved_contexts() == 1 and m.flaky.num_saved_contexts() == 0
    m.backward(g)
    assert {id(p) for p in fired} == {id(m.lin.weight), id(m.lin.bias)}
    np.testing.assert_allclose(m.lin.weight.grad, g.T @ x, rtol=1e-12)
    m.flaky.armed = False  # a normal pass afterwards: every hook fires once
    fired.clear()
    m(x)
    m.backward(g)
    assert sorted(id(p) for p in fired) == sorted(id(p) for p in m.parameters())
    assert m.saved_bytes() == 0


def test_a_backward_that_raises_after_taking_its_context_leaves_no_use_behind():
    """A backward that popped its context and then raised (a bad gradient, a
    refusing pre-accumulate hook) never accumulates that use: the next pass's
    hooks must still fire, and its gradients be exact."""
    lin = nn.Linear(3, 2, dtype=np.float64, rng=0)
    fired = []
    lin.register_grad_ready_hook(lambda p: fired.append(p))
    x, g = f64(4, 3), f64(4, 2)
    lin(x)
    with pytest.raises(ValueError, match="grad_output"):
        lin.backward(np.ones((4, 5)))  # raises after _pop(), before any gradient
    assert lin.num_saved_contexts() == 0 and fired == []

    armed = [True]

    def refuse_once(p):
        if armed:
            armed.pop()
            raise RuntimeError("refused")
    h = lin.bias.register_grad_pre_accumulate_hook(refuse_once)
    lin(x)
    with pytest.raises(RuntimeError, match="refused"):
        lin.backward(g)  # the weight's gradient went in (and fired), the bias's did not
    assert [id(p) for p in fired] == [id(lin.weight)]
    h.remove()
    lin.zero_grad()
    fired.clear()
    for _ in range(2):  # hooks fire once per backward again
        lin(x)
        lin.backward(g)
    assert [id(p) for p in fired] == [id(lin.weight), id(lin.bias)] * 2
    np.testing.assert_allclose(lin.weight.grad, 2 * g.T @ x, rtol=1e-12)
    np.testing.assert_allclose(lin.bias.grad, 2 * g.sum(axis=0), rtol=1e-12)


# ---- state dicts ----------------------------------------------------------------------------
def _model(seed):
    return nn.Sequential(nn.Linear(3, 4, rng=seed), nn.BatchNorm1d(4),
                         nn.Linear(4, 2, rng=seed + 1))


def test_state_dict_round_trip_in_place():
    a, b = _model(0), _model(10)
    with nn.no_grad():
        a(RNG.standard_normal((8, 3)))  # move the running stats
    sd = a.state_dict(copy=True)
    assert list(sd) == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                        "1.running_var", "1.num_batches_tracked", "2.weight", "2.bias"]
    assert [n for n, _ in a.named_buffers()] == ["1.running_mean", "1.running_var",
                                                 "1.num_batches_tracked"]
    before = {k: id(v) for k, v in b.state_dict().items()}
    res = b.load_state_dict(sd)
    assert res == ([], [])
    after = b.state_dict()
    assert {k: id(v) for k, v in after.items()} == before  # same arrays, new values
    for k in sd:
        np.testing.assert_array_equal(after[k], sd[k])
    x = RNG.standard_normal((5, 3))
    a.eval(), b.eval()
    with nn.no_grad():
        np.testing.assert_array_equal(a(x), b(x))


def test_load_state_dict_errors_change_nothing():
    m = _model(0)
    orig = m.state_dict(copy=True)
    sd = _model(5).state_dict(copy=True)
    bad = dict(sd)
    bad["2.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match="2.weight"):
        m.load_state_dict(bad)
    bad = dict(sd)
    bad["0.bias"] = sd["0.bias"].astype(np.float64)
    with pytest.raises(ValueError, match="0.bias.*dtype"):
        m.load_state_dict(bad)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, orig[k])
    partial = {k: v for k, v in sd.items() if k != "2.bias"}
    partial["extra.weight"] = np.zeros(1)
    with pytest.raises(KeyError) as ei:
        m.load_state_dict(partial)
    assert "2.bias" in str(ei.value) and "extra.weight" in str(ei.value)
    missing, unexpected = m.load_state_dict(partial, strict=False)
    assert missing == ["2.bias"] and unexpected == ["extra.weight"]
    np.testing.assert_array_equal(m.state_dict()["2.weight"], sd["2.weight"])
    with pytest.raises(TypeError):
        m.load_state_dict([1, 2])


# ---- argument checking ------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="4 features"):
        nn.Linear(4, 2)(np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match="positive"):
        nn.Linear(0, 2)
    with pytest.raises(TypeError, match="rng"):
        nn.Linear(2, 2, rng="seed")
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        nn.Embedding(5, 2)(np.array([0, 5]))
    with pytest.raises(TypeError, match="integer"):
        nn.Embedding(5, 2)(np.array([0.0]))
    with pytest.raises(TypeError, match="floating"):
        nn.ReLU()(np.array([1, 2]))
    with pytest.raises(ValueError, match=r"\(N, 3\)"):
        nn.BatchNorm1d(3)(np.zeros((4, 2), np.float32))
    lin = nn.Linear(2, 3)
    lin(np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match="grad_output"):
        lin.backward(np.zeros((4, 2), np.float32))
    with pytest.raises(TypeError, match="Parameter"):
        lin.weight = np.zeros((3, 2))
    with pytest.raises(NotImplementedError):
        nn.Module().backward(None)
    p = nn.Parameter(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="shape"):
        p.accumulate_grad(np.zeros(4))
    with pytest.raises(TypeError):
        nn.Parameter(np.zeros(3, np.int64))
    with pytest.raises(TypeError):
        p.register_grad_ready_hook("not callable")


def test_deepcopy_and_pickle_drop_hooks_keep_values():
    import copy
    import pickle

    m = nn.Sequential(nn.Linear(3, 2, rng=0), nn.BatchNorm1d(2))
    m.register_grad_ready_hook(lambda p: None)
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m.state_dict()))):
        sd = clone.state_dict() if isinstance(clone, nn.Module) else clone
        for k, v in m.state_dict().items():
            np.testing.assert_array_equal(sd[k], v)
    c = copy.deepcopy(m)
    assert all(not p._hooks for p in c.parameters())
    assert c[0].weight.data is not m[0].weight.data
    x = np.ones((4, 3), np.float32)
    np.testing.assert_array_equal(c(x), m(x))


def test_small_mlp_learns():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 2)).astype(np.float32)
    y = ((x[:, 0] * x[:, 1]) > 0).astype(np.int64)  # XOR-like quadrants
    from ringlet import optim
    m = nn.Sequential(nn.Linear(2, 32, rng=1), nn.ReLU(), nn.Linear(32, 2, rng=2))
    opt = optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    for _ in range(300):
        loss, g = nn.cross_entropy(m(x), y)
        opt.zero_grad()
        m.backward(g)
        opt.step()
    with nn.no_grad():
        acc = np.mean(np.argmax(m(x), -1) == y)
    assert acc > 0.95, (acc, loss)
