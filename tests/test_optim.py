"""ringlet.optim against straightforward references of torch's update equations
(and torch.optim itself when torch is installed)."""

from __future__ import annotations

import numpy as np
import pytest

from ringlet import nn, optim


def _params(dtype=np.float64, seed=0, shapes=((3, 4), (4,), (2, 2, 3))):
    rng = np.random.default_rng(seed)
    return [nn.Parameter(rng.standard_normal(s).astype(dtype)) for s in shapes]


def _grads(params, steps, seed=1):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(p.shape).astype(p.dtype) for p in params] for _ in range(steps)]


def ref_sgd(ps, gs_steps, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    ps = [p.copy() for p in ps]
    bufs = [None] * len(ps)
    for gs in gs_steps:
        for i, g in enumerate(gs):
            g = g + weight_decay * ps[i]
            if momentum:
                if bufs[i] is None:
                    bufs[i] = g.copy()
                else:
                    bufs[i] = momentum * bufs[i] + (1 - dampening) * g
                g = g + momentum * bufs[i] if nesterov else bufs[i]
            ps[i] = ps[i] - lr * g
    return ps


def ref_adamw(ps, gs_steps, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
              amsgrad=False):
    b1, b2 = betas
    ps = [p.copy() for p in ps]
    m = [np.zeros_like(p) for p in ps]
    v = [np.zeros_like(p) for p in ps]
    vmax = [np.zeros_like(p) for p in ps]
    for t, gs in enumerate(gs_steps, start=1):
        for i, g in enumerate(gs):
            ps[i] = ps[i] * (1 - lr * weight_decay)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            vmax[i] = np.maximum(vmax[i], v[i])
            vv = vmax[i] if amsgrad else v[i]
            mhat = m[i] / (1 - b1 ** t)
            vhat = vv / (1 - b2 ** t)
            ps[i] = ps[i] - lr * mhat / (np.sqrt(vhat) + eps)
    return ps


def _run(opt_cls, params, gs_steps, **kw):
    opt = opt_cls(params, **kw)
    for gs in gs_steps:
        opt.zero_grad()
        for p, g in zip(params, gs):
            p.accumulate_grad(g)
        opt.step()
    return opt


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    dict(lr=0.05, momentum=0.8, weight_decay=0.1, nesterov=True),
]


@pytest.mark.parametrize("kw", SGD_CASES)
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 2e-6)])
def test_sgd_matches_reference(kw, dtype, rtol):
    ps = _params(dtype)
    start = [p.data.copy() for p in ps]
    gs = _grads(ps, 6)
    _run(optim.SGD, ps, gs, **kw)
    want = ref_sgd([s.astype(np.float64) for s in start],
                   [[g.astype(np.float64) for g in step] for step in gs], **kw)
    for p, w in zip(ps, want):
        assert p.dtype == dtype
        np.testing.assert_allclose(p.data, w, rtol=rtol, atol=rtol)


ADAM_CASES = [dict(), dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
              dict(lr=3e-3, weight_decay=0.0, amsgrad=True)]


@pytest.mark.parametrize("kw", ADAM_CASES)
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 2e-6)])
def test_adamw_matches_reference(kw, dtype, rtol):
    ps = _params(dtype)
    start = [p.data.copy() for p in ps]
    gs = _grads(ps, 6)
    _run(optim.AdamW, ps, gs, **kw)
    want = ref_adamw([s.astype(np.float64) for s in start],
                     [[g.astype(np.float64) for g in step] for step in gs], **kw)
    for p, w in zip(ps, want):
        np.testing.assert_allclose(p.data, w, rtol=rtol, atol=rtol)


def test_in_place_on_flat_views_and_skips_none():
    flat = np.random.default_rng(0).standard_normal(12 + 4)
    p1 = nn.Parameter(flat[:12].reshape(3, 4))
    p2 = nn.Parameter(flat[12:])
    frozen = nn.Parameter(np.ones(2))  # never gets a gradient
    gflat = np.zeros_like(flat)
    p1.grad, p2.grad = gflat[:12].reshape(3, 4), gflat[12:]
    gflat[:] = 1.0
    before = flat.copy()
    for cls, kw in ((optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)), (optim.AdamW, {})):
        opt = cls([p1, p2, frozen], **kw)
        opt.step()
        assert p1.data.base is flat and p2.data.base is flat  # never rebound
        assert np.all(flat != before)
        np.testing.assert_array_equal(frozen.data, 1.0)
        opt.zero_grad()
        assert np.all(gflat == 0) and p1.grad.base is gflat
        gflat[:] = 1.0
        before = flat.copy()


def test_param_groups():
    a, b = _params(shapes=((3,),)), _params(seed=1, shapes=((2,),))
    opt = optim.SGD([{"params": a}, {"params": b, "lr": 0.5}], lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    assert opt.param_groups[1]["momentum"] == 0.0
    a0, b0 = a[0].data.copy(), b[0].data.copy()
    a[0].accumulate_grad(np.ones(3))
    b[0].accumulate_grad(np.ones(2))
    opt.step()
    np.testing.assert_allclose(a[0].data, a0 - 0.1)
    np.testing.assert_allclose(b[0].data, b0 - 0.5)
    opt.param_groups[0]["lr"] = 1.0  # schedules edit groups between steps
    opt.step()
    np.testing.assert_allclose(a[0].data, a0 - 1.1)
    with pytest.raises(ValueError, match="more than once"):
        opt.add_param_group({"params": a})


@pytest.mark.parametrize("cls,kw", [(optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
                                    (optim.AdamW, dict(lr=1e-2, amsgrad=True))])
def test_state_dict_round_trip(cls, kw):
    ps = _params()
    gs = _grads(ps, 6)
    opt = _run(cls, ps, gs[:3], **kw)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2]
    assert sd["param_groups"][0]["params"] == [0, 1, 2]
    clone = [nn.Parameter(p.data.copy()) for p in ps]
    opt2 = cls(clone, lr=123.0)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == kw["lr"]
    for o, params in ((opt, ps), (opt2, clone)):
        for step in gs[3:]:
            o.zero_grad()
            for p, g in zip(params, step):
                p.accumulate_grad(g)
            o.step()
    for p, q in zip(ps, clone):
        np.testing.assert_array_equal(p.data, q.data)
    bad = opt.state_dict()
    bad["state"] = {0: {k: (v[:1] if isinstance(v, np.ndarray) else v)
                        for k, v in bad["state"][0].items()}}
    with pytest.raises(ValueError, match="shape"):
        cls(clone, lr=0.1).load_state_dict(bad)
    with pytest.raises(ValueError, match="groups"):
        cls(clone, lr=0.1).load_state_dict({"state": {}, "param_groups": []})


@pytest.mark.parametrize("cls,kw", [(optim.SGD, dict(lr=0.1, momentum=0.9)),
                                    (optim.AdamW, dict(lr=0.1, amsgrad=True))])
def test_a_scalar_parameter_resumes_exactly(cls, kw):
    # A scalar parameter's buffers are 0-d arrays; loaded as Python floats they
    # were never updated again, and the resumed run drifted.
    a, b = nn.Parameter(np.array(1.0)), nn.Parameter(np.array(1.0))
    oa, ob = cls([a], **kw), cls([b], **kw)
    for p, o in ((a, oa), (b, ob)):
        p.grad = np.array(0.5)
        o.step()
    ob.load_state_dict(oa.state_dict())
    for i in range(4):
        for p, o in ((a, oa), (b, ob)):
            p.grad = np.array(0.3 * i - 0.2)
            o.step()
    assert a.data.tobytes() == b.data.tobytes()
    wrong = oa.state_dict()
    name = next(k for k, v in wrong["state"][0].items() if isinstance(v, np.ndarray))
    wrong["state"][0][name] = np.zeros((3, 4))
    with pytest.raises(ValueError, match=rf"'{name}' of parameter 0 has shape \(3, 4\)"):
        cls([nn.Parameter(np.array(0.0))], **kw).load_state_dict(wrong)


def test_load_refuses_another_optimizers_state_and_changes_nothing_when_it_fails():
    ps = _params()
    gs = _grads(ps, 2)
    sgd = _run(optim.SGD, ps, gs, lr=0.1, momentum=0.9)
    adam = optim.AdamW([nn.Parameter(p.data.copy()) for p in ps], lr=0.01)
    with pytest.raises(ValueError, match=r"\['dampening', 'momentum', 'nesterov'\].*AdamW"):
        adam.load_state_dict(sgd.state_dict())
    sd = sgd.state_dict()
    sd["param_groups"][0] = {"params": sd["param_groups"][0]["params"], "lr": 0.1}
    sd["state"][0] = {"exp_avg": sd["state"][0]["momentum_buffer"]}
    fresh = optim.SGD([nn.Parameter(p.data.copy()) for p in ps], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="'exp_avg' of parameter 0 is not SGD state"):
        fresh.load_state_dict(sd)
    two = optim.SGD([{"params": ps[:1]}, {"params": ps[1:]}], lr=0.1)
    bad = two.state_dict()
    bad["param_groups"][0]["lr"] = 0.5
    bad["param_groups"][1]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        two.load_state_dict(bad)
    assert [g["lr"] for g in two.param_groups] == [0.1, 0.1]  # group 0 untouched too
    adam_sd = _run(optim.AdamW, ps, gs, lr=0.01).state_dict()
    adam_sd["state"][0]["step"] = -3
    with pytest.raises(ValueError, match="'step' of parameter 0 must be a count"):
        optim.AdamW(ps, lr=0.01).load_state_dict(adam_sd)


def test_bad_arguments():
    ps = _params()
    with pytest.raises(ValueError, match="empty"):
        optim.SGD([], lr=0.1)
    with pytest.raises(TypeError, match="iterable"):
        optim.SGD(ps[0], lr=0.1)
    with pytest.raises(TypeError, match="Parameter"):
        optim.SGD([np.zeros(3)], lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        optim.SGD(ps, lr=-1.0)
    with pytest.raises(ValueError, match="nesterov"):
        optim.SGD(ps, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        optim.AdamW(ps, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="unknown"):
        optim.SGD([{"params": ps, "betas": (0.9, 0.9)}], lr=0.1)


def test_matches_torch_when_installed():
    torch = pytest.importorskip("torch")
    for cls, tcls, kw in ((optim.SGD, torch.optim.SGD,
                           dict(lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=True)),
                          (optim.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))):
        ps = _params()
        tps = [torch.tensor(p.data.copy(), requires_grad=True) for p in ps]
        gs = _grads(ps, 5)
        _run(cls, ps, gs, **kw)
        topt = tcls(tps, **kw)
        for step in gs:
            for t, g in zip(tps, step):
                t.grad = torch.tensor(g)
            topt.step()
        for p, t in zip(ps, tps):
            np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_adamw_float16_parameters_follow_the_reference():
    # In float16, eps (1e-8) and (1 - beta2) * g**2 for |g| < 5e-3 round to
    # zero: the update divided 0 by 0 (NaN) or m by 0 (inf) on the first step.
    rng = np.random.default_rng(3)
    start = rng.uniform(-1, 1, 64).astype(np.float16)
    gs = [(rng.standard_normal(64) * 1e-3).astype(np.float16) for _ in range(5)]
    for g in gs:
        g[:8] = 0  # exact zeros: dead units, embedding rows not looked up
    p = nn.Parameter(start.copy())
    opt = optim.AdamW([p], lr=1e-2)
    for g in gs:
        p.grad = g.copy()
        opt.step()
    want = ref_adamw([start.astype(np.float64)], [[g.astype(np.float64)] for g in gs], lr=1e-2)
    assert p.dtype == np.float16 and np.all(np.isfinite(p.data))
    # five steps of about lr each; float16 rounds each to half an ulp (<= 5e-4 here)
    np.testing.assert_allclose(p.data, want[0], rtol=0, atol=3e-3)
    assert np.any(np.abs(p.data.astype(np.float64) - start) > 0.03)  # it did move
    st = opt.state[id(p)]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == np.float32
    # a resumed float16 run keeps float32 moments and continues bit for bit
    q = nn.Parameter(p.data.copy())
    opt2 = optim.AdamW([q], lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[id(q)]["exp_avg_sq"].dtype == np.float32
    for o, prm in ((opt, p), (opt2, q)):
        prm.grad = gs[0].copy()
        o.step()
    assert p.data.tobytes() == q.data.tobytes()


@pytest.mark.parametrize("cls,kw", [(optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
                                    (optim.AdamW, dict(lr=0.1))])
def test_step_refuses_a_gradient_that_is_not_the_parameters_shape(cls, kw):
    # .grad is a plain attribute (wrappers, a parameter server assign it): a
    # (4,) gradient for a (3, 4) weight, or a 0-d one, used to broadcast into
    # every row and update silently.
    a, b = nn.Parameter(np.ones((3, 4))), nn.Parameter(np.ones(4))
    opt = cls([a, b], **kw)
    for ga, gb, err, msg in (
            (np.ones((3, 4)), np.array(2.0), ValueError,
             r"parameter 1 \(group 0\) has shape \(4,\), its \.grad has shape \(\)"),
            (np.ones(4), np.ones(4), ValueError,
             r"parameter 0 \(group 0\) has shape \(3, 4\), its \.grad has shape \(4,\)"),
            (np.ones((3, 4)), 0.5, TypeError, r"parameter 1 \(group 0\).*float")):
        a.grad, b.grad = ga, gb
        with pytest.raises(err, match=msg):
            opt.step()
        # refused before anything changed
        np.testing.assert_array_equal(a.data, 1.0)
        np.testing.assert_array_equal(b.data, 1.0)
        assert opt.state == {}


def test_params_in_a_set_are_refused():
    # state_dict() numbers the parameters in order; a set's order differs from
    # one process to the next, so a resumed run would give each parameter
    # another one's momentum (silently when the shapes agree).
    ps = _params()
    with pytest.raises(TypeError, match="ordered collection.*not a set"):
        optim.SGD(set(ps), lr=0.1)
    opt = optim.SGD(ps[:1], lr=0.1)
    with pytest.raises(TypeError, match="group 1.*not a frozenset"):
        opt.add_param_group({"params": frozenset(ps[1:])})
    with pytest.raises(TypeError, match="group 0.*not a set"):
        optim.AdamW([{"params": set(ps)}])
    assert len(opt.param_groups) == 1
    assert len(optim.SGD((p for p in ps), lr=0.1).param_groups[0]["params"]) == 3  # iterables do
