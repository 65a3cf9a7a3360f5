"""DistributedDataParallel against a single process on the whole batch (numpy oracle),
overlap vs none, no_sync, buckets, unused parameters, comm hooks, broadcasts."""

from __future__ import annotations

import numpy as np
import pytest

import ringlet
from ringlet import nn, optim
from ringlet.parallel import DDP, DistributedDataParallel, comm_hooks
from ringlet.testing import WorldError, run_world

from conftest import require

B, DIN, NCLS = 24, 6, 4  # batch divisible by 1, 2, 3, 4


def make_model(dtype=np.float64, seed=0):
    return nn.Sequential(nn.Linear(DIN, 16, dtype=dtype, rng=seed), nn.GELU(),
                         nn.LayerNorm(16, dtype=dtype), nn.Linear(16, 8, dtype=dtype, rng=seed + 1),
                         nn.Tanh(), nn.Linear(8, NCLS, dtype=dtype, rng=seed + 2))


def batches(steps, dtype=np.float64, seed=42):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((B, DIN)).astype(dtype), rng.integers(0, NCLS, B))
            for _ in range(steps)]


def make_opt(kind, params):
    if kind == "sgd":
        return optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)
    return optim.AdamW(params, lr=1e-2, weight_decay=0.05)


def single_process(kind, data, dtype=np.float64):
    model = make_model(dtype)
    opt = make_opt(kind, model.parameters())
    for x, y in data:
        opt.zero_grad()
        _, g = nn.cross_entropy(model(x), y)
        model.backward(g)
        opt.step()
    return [p.data.copy() for p in model.parameters()]


def _train_ddp(rank, n, kind, data, dtype, ddp_kw):
    model = make_model(dtype, seed=0)
    ddp = DDP(model, **ddp_kw)
    opt = make_opt(kind, model.parameters())
    shard = slice(rank * B // n, (rank + 1) * B // n)
    for x, y in data:
        opt.zero_grad()
        _, g = nn.cross_entropy(ddp(x[shard]), y[shard])
        ddp.backward(g)
        ddp.sync_gradients()
        opt.step()
    return [p.data.copy() for p in model.parameters()]


# ---- equivalence with one process ---------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_ranks_on_shards_equal_one_process_on_batch(n, kind):
    data = batches(5)
    want = single_process(kind, data)
    res = run_world(_train_ddp, n, args=(kind, data, np.float64, dict(bucket_cap_mb=0.001)))
    for r in range(n):
        for got, w in zip(res[r], want):
            np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12)
        for got, r0 in zip(res[r], res[0]):
            np.testing.assert_array_equal(got, r0)  # replicas bit-identical


def test_float32_equivalence_and_process_mode():
    data = batches(3, np.float32)
    want = single_process("adamw", data, np.float32)
    res = run_world(_train_ddp, 2, mode="process", timeout=120,
                    args=("adamw", data, np.float32, {}))
    for got, w in zip(res[0], want):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)
    for a, b in zip(res[0], res[1]):
        np.testing.assert_array_equal(a, b)


def _grads_after_one_step(rank, n, ddp_kw, dtype=np.float32, hook=None):
    model = make_model(dtype)
    ddp = DDP(model, **ddp_kw)
    if hook is not None:
        ddp.register_comm_hook(hook)
    x, y = batches(1, dtype, seed=7 + rank)[0]
    _, g = nn.cross_entropy(ddp(x), y)
    ddp.backward(g)
    ddp.sync_gradients()
    return [p.grad.copy() for p in model.parameters()], [id(p.grad) for p in model.parameters()]


def _reference_mean_grads(n, dtype=np.float64):
    model = make_model(dtype)
    total = None
    for r in range(n):
        model.zero_grad()
        x, y = batches(1, dtype, seed=7 + r)[0]
        _, g = nn.cross_entropy(model(x), y)
        model.backward(g)
        gs = [p.grad.astype(np.float64) for p in model.parameters()]
        total = gs if total is None else [a + b for a, b in zip(total, gs)]
    return [t / n for t in total]


def test_overlapped_equals_not_overlapped_bit_for_bit():
    kw = dict(bucket_cap_mb=0.0005)
    on = run_world(_grads_after_one_step, 3, args=(dict(kw, overlap=True),))
    off = run_world(_grads_after_one_step, 3, args=(dict(kw, overlap=False),))
    copy = run_world(_grads_after_one_step, 3, args=(dict(kw, gradient_as_bucket_view=False),))
    want = _reference_mean_grads(3)
    for r in range(3):
        for a, b, c, w in zip(on[r][0], off[r][0], copy[r][0], want):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)
            np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-6)
        for a, r0 in zip(on[r][0], on[0][0]):
            np.testing.assert_array_equal(a, r0)


def _no_sync_run(rank, n, k):
    model = make_model()
    ddp = DDP(model)
    x, y = batches(1)[0]
    shard = slice(rank * B // n, (rank + 1) * B // n)
    xs, ys = np.array_split(x[shard], k), np.array_split(y[shard], k)
    sent = []
    with ddp.no_sync():
        for xm, ym in zip(xs[:-1], ys[:-1]):
            _, g = nn.cross_entropy(ddp(xm), ym)
            ddp.backward(g / k)
            ddp.sync_gradients()  # a no-op inside no_sync
            sent.append([p.grad.copy() for p in model.parameters()])
    _, g = nn.cross_entropy(ddp(xs[-1]), ys[-1])
    ddp.backward(g / k)
    ddp.sync_gradients()
    return [p.grad.copy() for p in model.parameters()], sent


def test_no_sync_accumulation_equals_one_big_batch():
    n, k = 2, 3
    res = run_world(_no_sync_run, n, args=(k,))
    model = make_model()
    x, y = batches(1)[0]
    _, g = nn.cross_entropy(model(x), y)
    model.backward(g)
    for r in range(n):
        for got, p in zip(res[r][0], model.parameters()):
            np.testing.assert_allclose(got, p.grad, rtol=1e-10, atol=1e-12)
    # inside no_sync the ranks' gradients were their own, not averaged
    assert any(not np.array_equal(a, b) for a, b in zip(res[0][1][0], res[1][1][0]))


# ---- buckets --------------------------------------------------------------------------------
def _bucket_layout(rank, n, cap_mb):
    model = make_model(np.float32)
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    names = [nm for nm, _ in model.named_parameters()]
    layout = [(b.index, list(b.names), b.nbytes) for b in ddp.buckets]
    buf = ddp.grad_buffers[np.dtype(np.float32)]
    views = all(np.shares_memory(p.grad, buf) for p in model.parameters())
    x, y = batches(1, np.float32, seed=rank)[0]
    _, g = nn.cross_entropy(ddp(x), y)
    ddp.backward(g)
    ddp.sync_gradients()
    grads = [p.grad.copy() for p in model.parameters()]
    return names, layout, views, grads, buf.size


@pytest.mark.parametrize("cap_mb", [1e-6, 300 / 2**20, 25])
def test_buckets_are_reverse_order_slices_under_the_cap(cap_mb):
    res = run_world(_bucket_layout, 2, args=(cap_mb,))
    names, layout, views, grads, size = res[0]
    assert views
    assert size == sum(g.size for g in grads)
    order = [nm for _, bnames, _ in layout for nm in bnames]
    assert order == names[::-1]  # reverse parameter order, every parameter once
    cap = cap_mb * 2**20
    for _, bnames, nbytes in layout:
        assert nbytes <= cap or len(bnames) == 1
    if cap_mb == 1e-6:  # cap smaller than any parameter: one bucket each
        assert len(layout) == len(names)
    elif cap_mb == 25:
        assert len(layout) == 1
    else:
        assert 1 < len(layout) < len(names)
    for a, b in zip(res[0][3], res[1][3]):
        np.testing.assert_array_equal(a, b)


def _mixed_dtypes(rank, n):
    model = nn.Sequential(nn.Linear(3, 5, dtype=np.float64, rng=0), nn.Tanh(),
                          nn.Linear(5, 2, dtype=np.float32, rng=1))
    ddp = DDP(model, bucket_cap_mb=1e-6)
    out = ddp(np.full((4, 3), rank + 1.0))
    ddp.backward(np.full(out.shape, rank + 1.0, np.float32))
    ddp.sync_gradients()
    return sorted(str(d) for d in ddp.grad_buffers), [p.grad.copy() for p in model.parameters()]


def test_one_buffer_per_dtype():
    res = run_world(_mixed_dtypes, 2)
    assert res[0][0] == ["float32", "float64"]
    for a, b in zip(res[0][1], res[1][1]):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


# ---- unused parameters ------------------------------------------------------------------------
class Branchy(nn.Module):
    """Uses ``extra`` only when asked to, so ranks can disagree about it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4, dtype=np.float64, rng=0)
        self.extra = nn.Linear(4, 4, dtype=np.float64, rng=1)
        self.head = nn.Linear(4, 2, dtype=np.float64, rng=2)
        self._used = []

    def forward(self, x, use_extra=True):
        h = self.body(x)
        if use_extra:
            h = self.extra(h)
        self._used.append(use_extra)
        return self.head(h)

    def backward(self, g):
        g = self.head.backward(g)
        if self._used.pop(0):
            g = self.extra.backward(g)
        return self.body.backward(g)


def _unused_run(rank, n, find_unused, skip_ranks):
    model = Branchy()
    ddp = DDP(model, find_unused_parameters=find_unused, bucket_cap_mb=1e-6)
    out = ddp(np.ones((2, 3)) * (rank + 1), use_extra=rank not in skip_ranks)
    ddp.backward(np.ones_like(out))
    try:
        ddp.sync_gradients()
    except RuntimeError as exc:
        err = str(exc)
    else:
        err = None
    # the job keeps working afterwards: a normal iteration succeeds everywhere
    model.zero_grad()
    out = ddp(np.ones((2, 3)))
    ddp.backward(np.ones_like(out))
    ddp.sync_gradients()
    return err, {nm: p.grad.copy() for nm, p in model.named_parameters()}


@pytest.mark.parametrize("skip_ranks", [(1,), (0, 1, 2)])
def test_unused_parameter_error_names_it_on_every_rank(skip_ranks):
    res = run_world(_unused_run, 3, args=(False, skip_ranks), timeout=60)
    for err, _ in res:
        assert err is not None
        assert "'extra.weight'" in err and "'extra.bias'" in err
        assert "rank 1" in err and "find_unused_parameters=True" in err
        assert "body.weight" not in err


def test_find_unused_parameters_contribute_zero():
    res = run_world(_unused_run, 3, args=(True, (1,)))
    assert all(err is None for err, _ in res)
    # rank 1 contributed zeros for extra.*; the others their gradient
    ref = Branchy()
    want = None
    for r in range(3):
        ref.zero_grad()
        out = ref(np.ones((2, 3)) * (r + 1), use_extra=r != 1)
        ref.backward(np.ones_like(out))
        g = {nm: p.grad.copy() for nm, p in ref.named_parameters()}
        want = g if want is None else {k: want[k] + g[k] for k in g}
    first = run_world(_find_unused_first_step, 3)
    for r in range(3):
        for k in want:
            np.testing.assert_allclose(first[r][k], want[k] / 3, rtol=1e-12, atol=1e-14)


def _find_unused_first_step(rank, n):
    model = Branchy()
    ddp = DDP(model, find_unused_parameters=True)
    out = ddp(np.ones((2, 3)) * (rank + 1), use_extra=rank != 1)
    ddp.backward(np.ones_like(out))
    ddp.sync_gradients()
    return {nm: p.grad.copy() for nm, p in model.named_parameters()}


# ---- comm hooks -----------------------------------------------------------------------------
@pytest.mark.parametrize("hook,rtol", [(comm_hooks.fp16_compress, 2e-3),
                                       (comm_hooks.bf16_compress, 1.6e-2)])
def test_compression_hooks_within_tolerance(hook, rtol):
    if hook is comm_hooks.bf16_compress:
        require("ml_dtypes")
    res = run_world(_grads_after_one_step, 3, args=(dict(bucket_cap_mb=0.0005),),
                    kwargs=dict(hook=hook))
    want = _reference_mean_grads(3)
    plain = run_world(_grads_after_one_step, 3, args=(dict(bucket_cap_mb=0.0005),))
    for r in range(3):
        for got, w, r0 in zip(res[r][0], want, res[0][0]):
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, r0)  # identical on every rank
            scale = np.max(np.abs(w))
            np.testing.assert_allclose(got, w, rtol=rtol, atol=rtol * scale)
        # the compression really happened: not the float32 reduction's bits
        assert not all(np.array_equal(a, b) for a, b in zip(res[r][0], plain[r][0]))


def _custom_hook_run(rank, n):
    calls = []

    def hook(state, bucket):
        # the first layer's saved context tells whether backward is still running
        state.append((bucket.index, model[0].num_saved_contexts(), bucket.is_last()))
        buf = bucket.buffer()
        work = ringlet.all_reduce(buf, ringlet.ReduceOp.SUM, group=bucket.group, async_op=True)
        return comm_hooks.then(work, lambda: np.divide(buf, bucket.world_size, out=buf))

    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    ddp.register_comm_hook(hook, calls)
    with pytest.raises(RuntimeError, match="already"):
        ddp.register_comm_hook(hook, calls)
    x, y = batches(1, seed=7 + rank)[0]
    ddp.backward(nn.cross_entropy(ddp(x), y)[1])
    ddp.sync_gradients()
    return calls, len(ddp.buckets), [p.grad.copy() for p in model.parameters()]


def test_custom_comm_hook():
    res = run_world(_custom_hook_run, 2)
    calls, nb, grads = res[0]
    assert [c[0] for c in calls] == list(range(nb)) and calls[-1][2] and not calls[0][2]
    assert nb > 2
    assert calls[0][1] == 1  # launched while backward had not reached the first layer
    assert calls[-1][1] == 0
    for got, w in zip(grads, _reference_mean_grads(2)):
        np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-14)


# ---- broadcasts -------------------------------------------------------------------------------
def _broadcast_run(rank, n):
    model = nn.Sequential(nn.Linear(3, 4, dtype=np.float64, rng=rank),
                          nn.BatchNorm1d(4, dtype=np.float64),
                          nn.Linear(4, 2, dtype=np.float64, rng=10 + rank))
    ids = [id(a) for a in model.state_dict().values()]
    ddp = DDP(model, init_sync=False, broadcast_buffers=False)
    opt = optim.AdamW(model.parameters(), lr=0.1)
    differs = ringlet.all_gather_object(float(model[0].weight.data[0, 0]))
    ddp.broadcast_parameters(src=1)
    same_ids = [id(a) for a in model.state_dict().values()] == ids
    after = [a.copy() for a in model.state_dict().values()]
    after_params = [p.data.copy() for p in model.parameters()]
    for step in range(3):
        opt.zero_grad()
        x = np.random.default_rng(rank * 10 + step).standard_normal((5, 3))
        ddp.backward(np.ones_like(ddp(x)))
        ddp.sync_gradients()
        opt.step()
    return differs, same_ids, after, [p.data.copy() for p in model.parameters()], after_params


def test_broadcast_parameters_makes_replicas_identical():
    res = run_world(_broadcast_run, 3)
    differs = res[0][0]
    assert len(set(differs)) == 3  # they really started different
    ref = nn.Sequential(nn.Linear(3, 4, dtype=np.float64, rng=1),
                        nn.BatchNorm1d(4, dtype=np.float64),
                        nn.Linear(4, 2, dtype=np.float64, rng=11))
    for r in range(3):
        _, same_ids, after, trained, after_params = res[r]
        assert same_ids  # in place
        for a, w in zip(after, ref.state_dict().values()):
            np.testing.assert_array_equal(a, w)  # rank 1's values
        for a, b, p0 in zip(trained, res[0][3], after_params):
            np.testing.assert_array_equal(a, b)  # optimizer kept them identical
            assert not np.array_equal(a, p0)  # and it did train them


def _buffers_run(rank, n):
    model = nn.Sequential(nn.Linear(3, 4, dtype=np.float64, rng=0),
                          nn.BatchNorm1d(4, dtype=np.float64))
    ddp = DDP(model)
    for step in range(2):
        x = np.random.default_rng(rank * 10 + step).standard_normal((6, 3))
        ddp.backward(np.ones_like(ddp(x)))
        ddp.sync_gradients()
    before = model[1].running_mean.copy()
    ddp.eval()  # so this forward does not update the statistics itself
    with nn.no_grad():
        ddp(np.zeros((2, 3)))  # the forward broadcasts rank 0's buffers first
    return before, model[1].running_mean.copy(), int(model[1].num_batches_tracked)


def test_broadcast_buffers_at_forward():
    res = run_world(_buffers_run, 2)
    assert not np.array_equal(res[0][0], res[1][0])  # local statistics diverged
    np.testing.assert_array_equal(res[1][1], res[0][0])  # then rank 0's won
    assert res[0][2] == res[1][2] == 2


# ---- misuse ------------------------------------------------------------------------------------
def _misuse_run(rank, n):
    model = make_model()
    ddp = DDP(model)
    x, y = batches(1)[0]
    ddp.backward(nn.cross_entropy(ddp(x), y)[1])
    errors = []
    try:
        ddp(x)
    except RuntimeError as exc:
        errors.append(str(exc))
    try:
        ddp.register_comm_hook(comm_hooks.fp16_compress)
    except RuntimeError as exc:
        errors.append(str(exc))
    ddp.sync_gradients()
    # a second forward/backward behind DDP's back, before syncing: refused, and
    # sync_gradients then names it on every rank (tests/test_ddp_late_grad.py)
    ddp.backward(nn.cross_entropy(ddp(x), y)[1])
    try:
        model.backward(nn.cross_entropy(model(x), y)[1])
    except RuntimeError as exc:
        errors.append(str(exc))
    try:
        ddp.sync_gradients()
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors


def test_misuse_raises_clear_errors():
    for errs in run_world(_misuse_run, 2):
        assert "sync_gradients() after backward" in errs[0]
        assert "between iterations" in errs[1]
        assert "second gradient for parameter '5.weight'" in errs[2]
        assert "rank 0: '5.weight'" in errs[3] and "rank 1: '5.weight'" in errs[3]
    with pytest.raises(WorldError, match="ringlet.nn.Module"):
        run_world(lambda r, n: DDP(object()), 1)
    with pytest.raises(WorldError, match="bucket_cap_mb"):
        run_world(lambda r, n: DDP(make_model(), bucket_cap_mb=0), 1)


def _layout_mismatch(rank, n):
    DistributedDataParallel(make_model() if rank == 0 else nn.Linear(DIN, 3))


def test_different_replicas_are_rejected():
    with pytest.raises(WorldError, match="different parameter layout"):
        run_world(_layout_mismatch, 2)

    # Options and buffers that decide the broadcasts: once found only as a
    # desync or a timeout in the first mismatched collective.
    def option(rank, n, kw):
        try:
            DDP(make_model(), **(kw if rank == 1 else {}))
        except ValueError as exc:
            return str(exc)

    for kw in (dict(broadcast_buffers=False), dict(init_sync=False)):
        for msg in run_world(option, 2, args=(kw,)):
            assert msg and "broadcast_buffers or init_sync than rank 0" in msg, (kw, msg)

    def buffers(rank, n):
        m = make_model()
        m.register_buffer("running", np.zeros(3 + rank))
        try:
            DDP(m)
        except ValueError as exc:
            return str(exc)

    assert all(m and "different buffers" in m for m in run_world(buffers, 2))


def test_wrapping_a_wrapped_module_again_is_refused():
    # Both wrappers' hooks fired: the second copied a buffer the first was
    # still reducing, and the error then blamed "became ready twice".
    def body(rank, n):
        model = make_model()
        first = DDP(model)
        with pytest.raises(ValueError, match="already wrapped by another DistributedDataParallel"):
            DDP(model)
        first.remove_hooks()
        second = DDP(model)  # fine once the first let go
        x, y = batches(1, seed=3 + rank)[0]
        second.backward(nn.cross_entropy(second(x), y)[1])
        second.sync_gradients()
        return [p.grad.copy() for p in model.parameters()]

    a, b = run_world(body, 2)
    for ga, gb in zip(a, b):
        np.testing.assert_array_equal(ga, gb)


def test_float16_gradients_average_without_overflow():
    # A weight gradient of 200 x 200 = 40000 on each of 2 ranks sums to inf in
    # float16 (largest 65504); the mean, 40000, fits.  Each rank divides first.
    def body(rank, n):
        model = nn.Linear(2, 1, dtype=np.float16, rng=0)
        ddp = DDP(model)
        out = ddp(np.full((1, 2), 200, np.float16))
        ddp.backward(np.full(out.shape, 200, np.float16))
        ddp.sync_gradients()
        return model.weight.grad.copy(), model.bias.grad.copy()

    for w, b in run_world(body, 2):
        assert w.dtype == np.float16 and np.all(w == 40000), w
        assert np.all(b == 200), b
