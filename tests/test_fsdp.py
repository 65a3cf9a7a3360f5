"""FullyShardedDataParallel against single-process training on the whole batch (numpy oracle).

Every equivalence test trains float64 models for several steps on N ranks, each rank on
its slice of the batch, and compares the gathered model with one process trained on the
full batch.  Tolerance: rtol 1e-10, atol 1e-12 (only the reduction order differs; the
observed error is ~1e-16).  Mixed precision is compared with float32 training at the
tolerances stated in its tests.
"""

from __future__ import annotations

import numpy as np
import pytest

import ringlet
from ringlet import nn, optim
from ringlet.parallel._flat import FlatLayout
from ringlet.parallel.fsdp import FSDP, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from ringlet.testing import run_world

from _launchers import clean_env
from conftest import require

SS = ShardingStrategy
B = 24  # divisible by 1, 2, 3, 4
RTOL, ATOL = 1e-10, 1e-12


# ---- models and data ------------------------------------------------------------------------------
def seq_model(dtype=np.float64, seed=0):
    # Unit sizes 42, 24, 6, 8, 3: none a multiple of 3, most not of 4, the last smaller
    # than 4 ranks (some shards hold only padding).
    return nn.Sequential(nn.Linear(5, 7, dtype=dtype, rng=seed), nn.Tanh(),
                         nn.Linear(7, 3, dtype=dtype, rng=seed + 1), nn.LayerNorm(3, dtype=dtype),
                         nn.Linear(3, 2, dtype=dtype, rng=seed + 2), nn.GELU(),
                         nn.Linear(2, 1, dtype=dtype, rng=seed + 3))


class Net(nn.Module):
    """Root parameter + a head outside any Sequential + a nested Sequential."""

    def __init__(self, dtype=np.float64, seed=0):
        super().__init__()
        self.scale = nn.Parameter(np.linspace(0.5, 1.5, 4).astype(dtype))
        self.body = nn.Sequential(nn.Linear(5, 9, dtype=dtype, rng=seed), nn.Tanh(),
                                  nn.Sequential(nn.Linear(9, 6, dtype=dtype, rng=seed + 1),
                                                nn.GELU()),
                                  nn.Linear(6, 4, dtype=dtype, rng=seed + 2))
        self.head = nn.Linear(4, 1, dtype=dtype, rng=seed + 3)
        self.head2 = nn.Linear(4, 4, dtype=dtype, rng=seed + 4)

    def forward(self, x):
        z = self.head2(self.body(x))
        self._save(z, (self.scale,))
        return self.head(z * self.scale.data)

    def backward(self, g):
        z = self._pop()
        gh = self.head.backward(g)
        self.scale.accumulate_grad(np.sum(gh * z, axis=0))
        return self.body.backward(self.head2.backward(gh * self.scale.data))


def batches(steps, din=5, dout=1, dtype=np.float64, seed=7):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((B, din)).astype(dtype),
             rng.standard_normal((B, dout)).astype(dtype)) for _ in range(steps)]


def make_opt(kind, params):
    if kind == "sgd":
        return optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)
    return optim.AdamW(params, lr=2e-2, weight_decay=0.05)


def train_single(make, kind, data, steps_per_batch=1):
    model = make()
    opt = make_opt(kind, model.parameters())
    for x, y in data:
        opt.zero_grad()
        _, g = nn.mse_loss(model(x), y)
        model.backward(g)
        opt.step()
    return model.state_dict(copy=True)


def _steps(rank, n, f, data, kind):
    """Train the wrapped model on this rank's slice of every batch; return the optimizer."""
    opt = make_opt(kind, f.parameters())
    sl = slice(rank * B // n, (rank + 1) * B // n)
    for x, y in data:
        opt.zero_grad()
        _, g = nn.mse_loss(f(x[sl]), y[sl])
        f.backward(g)
        opt.step()
    return opt


def _train_fsdp(rank, n, make, kind, data, kw):
    fsdp_kw = kw(rank, n) if callable(kw) else dict(kw)
    f = FSDP(make(), **fsdp_kw)
    _steps(rank, n, f, data, kind)
    return f.full_state_dict(rank0_only=False), dict(f.stats)


def assert_state_close(got, want, rtol=RTOL, atol=ATOL):
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=k)


def hybrid_pair(rank, n):
    """2 x 2 grid: shard groups {0,1},{2,3}; replicate groups {0,2},{1,3}."""
    groups = [ringlet.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]
    mine = [g for g in groups if g.rank >= 0]
    return dict(strategy=SS.HYBRID_SHARD, group=(mine[0], mine[1]))


# ---- equivalence with one process ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", [SS.FULL_SHARD, SS.SHARD_GRAD_OP, SS.NO_SHARD])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_training_matches_single_process(strategy, kind, n):
    data = batches(4)
    want = train_single(seq_model, kind, data)
    out = run_world(_train_fsdp, n, args=(seq_model, kind, data, dict(strategy=strategy)))
    for sd, _ in out:
        assert_state_close(sd, want)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("how", ["pair", "shard_size", "mesh"])
def test_hybrid_shard_2x2_matches_single_process(how, kind):
    class Mesh:  # duck-typed 2-D mesh: dim 0 replicate, dim 1 shard
        ndim = 2

        def __init__(self, shard, rep):
            self.groups = {0: rep, 1: shard}

        def get_group(self, dim):
            return self.groups[dim]

    def kw(rank, n):
        if how == "pair":
            return hybrid_pair(rank, n)
        if how == "shard_size":
            return dict(strategy=SS.HYBRID_SHARD, shard_size=2)
        pair = hybrid_pair(rank, n)["group"]
        return dict(strategy=SS.HYBRID_SHARD, mesh=Mesh(*pair))

    def body(rank, n):
        sd, stats = _train_fsdp(rank, n, seq_model, kind, data, kw)
        return sd, stats

    data = batches(4)
    want = train_single(seq_model, kind, data)
    for sd, stats in run_world(body, 4):
        assert_state_close(sd, want)
        # 5 units x 4 steps: a reduce-scatter in the shard group, then an all-reduce
        # across the replica group, for every unit and step
        assert stats["reduce_scatters"] == stats["all_reduces"] == 20


def test_real_device_mesh():
    import ringlet.mesh as mesh_mod
    data = batches(3)
    want = train_single(seq_model, "adamw", data)

    def body(rank, n):
        mesh2 = mesh_mod.DeviceMesh((2, 2), ("replicate", "shard"))
        hybrid = FSDP(seq_model(), strategy=SS.HYBRID_SHARD, mesh=mesh2)
        assert (hybrid.shard_world_size, hybrid.replicate_world_size) == (2, 2)
        a = _train_fsdp_existing(rank, n, hybrid, data)
        full = FSDP(seq_model(), mesh=mesh_mod.DeviceMesh((4,), ("dp",)))
        assert full.shard_world_size == 4
        b = _train_fsdp_existing(rank, n, full, data)
        with pytest.raises(ValueError, match="1-D mesh"):
            FSDP(seq_model(), mesh=mesh2)
        return a, b

    for a, b in run_world(body, 4):
        assert_state_close(a, want)
        assert_state_close(b, want)


def test_hybrid_shards_within_the_shard_group_only():
    def body(rank, n):
        f = FSDP(seq_model(), **hybrid_pair(rank, n))
        return [p.size for p in f.parameters()], f.shard_world_size, f.replicate_world_size, f.rank

    out = run_world(body, 4)
    sizes = [-(-s // 2) for s in (42, 24, 6, 8, 3)]  # ceil(numel / 2)
    assert [o[0] for o in out] == [sizes] * 4
    assert [o[1:] for o in out] == [(2, 2, r) for r in range(4)]


@pytest.mark.parametrize("auto_wrap, units", [
    ("sequential", ["", "body.0", "body.2.0", "body.3"]),
    ((nn.Linear,), ["", "body.0", "body.2.0", "body.3", "head", "head2"]),
    (None, [""]),
    (lambda name, m: name in ("body", "body.2"), ["", "body", "body.2"]),  # nested units
])
@pytest.mark.parametrize("strategy", [SS.FULL_SHARD, SS.SHARD_GRAD_OP])
def test_units_nesting_and_root_parameters(auto_wrap, units, strategy):
    data = batches(3)
    want = train_single(Net, "adamw", data)

    def body(rank, n):
        f = FSDP(Net(), strategy=strategy, auto_wrap=auto_wrap)
        assert f.units == units
        return _train_fsdp_existing(rank, n, f, data)

    for sd in run_world(body, 3):
        assert_state_close(sd, want)


def _train_fsdp_existing(rank, n, f, data, kind="adamw"):
    _steps(rank, n, f, data, kind)
    return f.full_state_dict(rank0_only=False)


def test_frozen_parameters_stay_put_and_the_rest_trains_as_in_one_process():
    def make():
        m = seq_model()
        m[2].weight.requires_grad = False
        m[2].bias.requires_grad = False
        return m

    data = batches(3)
    want = train_single(make, "adamw", data)
    init = make().state_dict(copy=True)
    for sd, _ in run_world(_train_fsdp, 2, args=(make, "adamw", data, {})):
        assert_state_close(sd, want)
        np.testing.assert_array_equal(sd["2.weight"], init["2.weight"])


# ---- sharding layout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [[1], [7], [0, 5], [3, 13, 1], [42, 24, 6, 8, 3], [16]])
@pytest.mark.parametrize("S", [1, 2, 3, 4, 5, 8])
def test_flat_layout_covers_every_element_once(sizes, S):
    lay = FlatLayout([(k,) for k in sizes], S)
    assert lay.padded % S == 0 and lay.padded >= max(sum(sizes), 1)
    assert lay.padded - sum(sizes) < S or sum(sizes) == 0
    full = np.arange(lay.padded, dtype=np.float64)
    for i, n in enumerate(sizes):
        covered = np.zeros(n, int)
        for r in range(S):
            s, e = lay.param_range(i, r)
            lo, _ = lay.shard_bounds(r)
            shard = full[lo: lo + lay.shard_numel]
            covered[s:e] += 1
            np.testing.assert_array_equal(shard[lay.shard_slice(i, r)],
                                          full[lay.offsets[i] + s: lay.offsets[i] + e])
        assert (covered == 1).all()


def test_shards_hold_their_part_of_the_padded_buffer_and_padding_stays_zero():
    data = batches(3)

    def body(rank, n):
        f = FSDP(seq_model(), strategy=SS.FULL_SHARD)
        _train_fsdp_existing(rank, n, f, data, kind="adamw")
        out = []
        for p in f.parameters():
            full = np.empty(p.size * n, p.dtype)
            ringlet.all_gather(full, p.data)
            out.append(full)
        return out, f.full_state_dict(rank0_only=False)

    for gathered, sd in run_world(body, 4):
        names = [["0.weight", "0.bias"], ["2.weight", "2.bias"], ["3.weight", "3.bias"],
                 ["4.weight", "4.bias"], ["6.weight", "6.bias"]]
        for full, keys in zip(gathered, names):
            flat = np.concatenate([sd[k].reshape(-1) for k in keys])
            assert full.size == -(-flat.size // 4) * 4
            np.testing.assert_array_equal(full[:flat.size], flat)
            assert not full[flat.size:].any()  # padding: zero after AdamW with weight decay


# ---- prefetch, mixed precision, no_sync ----------------------------------------------------------------
@pytest.mark.parametrize("strategy", [SS.FULL_SHARD, SS.SHARD_GRAD_OP, SS.HYBRID_SHARD])
def test_prefetch_on_and_off_give_identical_results(strategy):
    data = batches(4)

    def body(rank, n, prefetch):
        kw = dict(strategy=strategy, prefetch=prefetch)
        if strategy is SS.HYBRID_SHARD:
            kw["shard_size"] = 2
        f = FSDP(Net(), auto_wrap=(nn.Linear,), **kw)
        return _train_fsdp_existing(rank, n, f, data), dict(f.stats)

    on = run_world(body, 4, args=(True,))
    off = run_world(body, 4, args=(False,))
    for (a, sa), (b, sb) in zip(on, off):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])  # bit-identical
        assert sa["all_gathers"] == sb["all_gathers"]
        assert sa["prefetches"] > 0 and sb["prefetches"] == 0


class ProbeLinear(nn.Linear):
    """A Linear that records the dtype it computed in and the weight values it saw."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.seen = []

    def forward(self, x):
        y = super().forward(x)
        self.seen.append((y.dtype, self.weight.data.copy()))
        return y


def _mp_train(rank, n, mp, data, steps_kind="adamw", strategy=SS.FULL_SHARD):
    probe = ProbeLinear(5, 7, dtype=np.float32, rng=0)  # same init as seq_model's first layer
    model = nn.Sequential(probe, *list(seq_model(np.float32))[1:])
    f = FSDP(model, mixed_precision=mp, strategy=strategy)
    opt = _steps(rank, n, f, data, steps_kind)
    sd = f.full_state_dict(rank0_only=False)
    states = [a for s in opt.state.values() for a in s.values() if isinstance(a, np.ndarray)]
    return (sd, probe.seen, [p.dtype for p in f.parameters()], [a.dtype for a in states])


def _mp_reference(data):
    return train_single(lambda: seq_model(np.float32), "adamw", data)


def test_mixed_precision_float16_computes_in_half_and_keeps_float32_shards():
    data = batches(3, dtype=np.float32)
    want = _mp_reference(data)
    mp = MixedPrecision(param_dtype=np.float16, reduce_dtype=np.float16)
    for sd, seen, shard_dtypes, state_dtypes in run_world(_mp_train, 2, args=(mp, data)):
        assert seen and {d for d, _ in seen} == {np.dtype(np.float16)}
        assert all(w.dtype == np.float16 and w.size == 35 for _, w in seen)
        assert set(shard_dtypes) == {np.dtype(np.float32)}
        assert state_dtypes and set(state_dtypes) == {np.dtype(np.float32)}
        for k in want:
            assert sd[k].dtype == np.float32
            # 3 AdamW steps of lr 2e-2 computed in float16 with float16 gradients:
            # within 5e-3 of float32 training (measured max 1.4e-3).
            np.testing.assert_allclose(sd[k], want[k], rtol=0, atol=5e-3, err_msg=k)


def test_float16_reduction_averages_without_overflow():
    # 200 x 200 = 40000 per weight on each rank: a float16 sum of 2 ranks is
    # inf, the mean fits.  Each rank divides before the reduce_scatter.
    mp = MixedPrecision(param_dtype=np.float16, reduce_dtype=np.float16)

    def body(rank, n):
        f = FSDP(nn.Linear(4, 1, dtype=np.float32, rng=0), mixed_precision=mp)
        out = f(np.full((1, 4), 200.0, np.float32))
        f.backward(np.full(out.shape, 200, out.dtype))
        return np.concatenate([p.grad.ravel() for p in f.parameters()])

    shards = run_world(body, 2)
    flat = np.concatenate(shards)[:5]  # 4 weights, 1 bias, then padding
    np.testing.assert_array_equal(flat, [40000, 40000, 40000, 40000, 200])


@pytest.mark.parametrize("strategy,world", [(SS.FULL_SHARD, 2), (SS.NO_SHARD, 2),
                                            (SS.FULL_SHARD, 1)])
def test_mixed_precision_bfloat16_gathers_rounded_values(strategy, world):
    # Without a gather (NO_SHARD, or one rank) the weights are still rounded
    # to bfloat16 before the float32 compute.
    ml_dtypes = require("ml_dtypes")
    data = batches(3, dtype=np.float32)
    want = _mp_reference(data)
    mp = MixedPrecision(param_dtype=ml_dtypes.bfloat16, reduce_dtype="bfloat16")
    for sd, seen, shard_dtypes, _ in run_world(_mp_train, world, args=(mp, data),
                                               kwargs=dict(strategy=strategy)):
        assert seen
        for dt, w in seen:
            assert w.size == 35
            assert dt == np.float32  # numpy computes bfloat16 values in float32
            np.testing.assert_array_equal(w, w.astype(ml_dtypes.bfloat16).astype(np.float32))
        assert set(shard_dtypes) == {np.dtype(np.float32)}
        for k in want:
            # bfloat16-rounded weights and gradients, float32 arithmetic: within 5e-3
            # of float32 training (measured max 7.7e-4).
            np.testing.assert_allclose(sd[k], want[k], rtol=0, atol=5e-3, err_msg=k)


def test_mixed_precision_with_float32_reduction_and_no_shard():
    data = batches(3, dtype=np.float32)
    want = _mp_reference(data)

    mp = MixedPrecision(param_dtype=np.float16, reduce_dtype=np.float32)
    for sd, seen, shard_dtypes, _ in run_world(_mp_train, 2, args=(mp, data),
                                               kwargs=dict(strategy=SS.NO_SHARD)):
        # the forward ran in float16 on float16 weights, over float32 masters
        assert seen and {d for d, _ in seen} == {np.dtype(np.float16)}
        assert all(w.dtype == np.float16 for _, w in seen)
        assert set(shard_dtypes) == {np.dtype(np.float32)}
        # Half-precision compute moves the result off float32 training (a run
        # that ignored mixed precision is within ~1e-7 of it), but not far.
        diff = max(float(np.max(np.abs(sd[k] - want[k]))) for k in want)
        assert 1e-4 < diff < 5e-3, diff


def test_no_shard_reduces_through_ddps_bucket_path_with_ddps_bits(monkeypatch):
    # NO_SHARD is the unsharded case: each unit's flat gradient is one GradBucket started
    # with DDP's default hook, so on 2 ranks (a + b is exact whatever the order) its
    # gradients equal DDP's bit for bit; with a float32 reduce_dtype the bucket is float32.
    from ringlet.parallel import comm_hooks
    from ringlet.parallel.ddp import DDP

    seen = []
    real = comm_hooks.allreduce_hook

    def spy(state, bucket):
        seen.append((bucket.dtype, bucket.numel, bucket.world_size, tuple(bucket.names)))
        return real(state, bucket)

    monkeypatch.setattr(comm_hooks, "allreduce_hook", spy)
    (x, y), = batches(1)

    def body(rank, n, mp):
        sl = slice(rank * B // n, (rank + 1) * B // n)
        ddp = DDP(seq_model())
        ddp.register_comm_hook(real)  # the oracle's buckets bypass the spy
        _, g = nn.mse_loss(ddp(x[sl]), y[sl])
        ddp.backward(g)
        ddp.sync_gradients()
        want = {k: p.grad.copy() for k, p in ddp.module.named_parameters()}
        f = FSDP(seq_model(), strategy=SS.NO_SHARD, mixed_precision=mp)
        _, g = nn.mse_loss(f(x[sl]), y[sl])
        f.backward(g)
        got = {name: v for fg in f._groups
               for name, v in zip(fg.names, fg.layout.views(fg.shard.grad))}
        return want, got, [(fg.layout.padded, tuple(fg.names)) for fg in f._groups]

    for mp, rdt in ((None, np.float64), (MixedPrecision(reduce_dtype=np.float32), np.float32)):
        seen.clear()
        res = run_world(body, 2, args=(mp,))
        for want, got, _ in res:
            assert sorted(got) == sorted(want)
            for k in want:
                assert got[k].dtype == want[k].dtype == np.float64, k
                if mp is None:
                    assert np.array_equal(got[k], want[k]), k
                else:  # float32 sums of the same local gradients
                    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
        units = res[0][2]
        assert len(units) == 5  # the four Linears and the LayerNorm
        want_buckets = [(np.dtype(rdt), pad, 2, names) for pad, names in units] * 2  # 2 ranks
        assert sorted(seen, key=repr) == sorted(want_buckets, key=repr)


def test_hybrid_replica_reduction_is_a_ddp_bucket_of_the_gradient_shard(monkeypatch):
    # The all-reduce across replicas is the same bucket path, on the reduced shard.
    from ringlet.parallel import comm_hooks

    seen = []
    real = comm_hooks.allreduce_hook

    def spy(state, bucket):
        seen.append((bucket.numel, bucket.world_size, bucket.buffer().dtype))
        return real(state, bucket)

    monkeypatch.setattr(comm_hooks, "allreduce_hook", spy)
    (x, y), = batches(1)

    def body(rank, n):
        f = FSDP(seq_model(), strategy=SS.HYBRID_SHARD, shard_size=2)
        sl = slice(rank * B // n, (rank + 1) * B // n)
        f.backward(nn.mse_loss(f(x[sl]), y[sl])[1])
        return sorted(fg.layout.shard_numel for fg in f._groups)

    shards = run_world(body, 4)
    assert sorted(seen) == sorted((k, 2, np.dtype(np.float64)) for s in shards for k in s)


@pytest.mark.parametrize("strategy", [SS.FULL_SHARD, SS.NO_SHARD, SS.HYBRID_SHARD])
def test_no_sync_accumulates_like_one_process(strategy):
    data = batches(4)
    micro = [data[0:2], data[2:4]]  # two steps of two micro-batches

    model = seq_model()
    opt = make_opt("sgd", model.parameters())
    for step in micro:
        opt.zero_grad()
        for x, y in step:
            _, g = nn.mse_loss(model(x), y)
            model.backward(g)
        opt.step()
    want = model.state_dict(copy=True)

    def body(rank, n):
        kw = dict(strategy=strategy)
        if strategy is SS.HYBRID_SHARD:
            kw["shard_size"] = 2
        f = FSDP(seq_model(), **kw)
        opt = make_opt("sgd", f.parameters())
        sl = slice(rank * B // n, (rank + 1) * B // n)
        counts = []
        for step in micro:
            opt.zero_grad()
            (x0, y0), (x1, y1) = step
            with f.no_sync():
                f.backward(nn.mse_loss(f(x0[sl]), y0[sl])[1])
            counts.append(f.stats["reduce_scatters"] + f.stats["all_reduces"])
            f.backward(nn.mse_loss(f(x1[sl]), y1[sl])[1])
            opt.step()
        return f.full_state_dict(rank0_only=False), counts

    for sd, counts in run_world(body, 4):
        assert_state_close(sd, want)
        assert counts[0] == 0  # nothing was reduced inside no_sync


@pytest.mark.parametrize("strategy", [SS.FULL_SHARD, SS.HYBRID_SHARD])
def test_gradients_accumulate_across_backwards_without_zero_grad(strategy):
    data = batches(3)
    model = seq_model()
    opt = make_opt("sgd", model.parameters())
    for x, y in data:  # no zero_grad: every step adds to the previous gradients
        model.backward(nn.mse_loss(model(x), y)[1])
        opt.step()
    want = model.state_dict(copy=True)

    def body(rank, n):
        kw = dict(shard_size=2) if strategy is SS.HYBRID_SHARD else {}
        f = FSDP(seq_model(), strategy=strategy, **kw)
        opt = make_opt("sgd", f.parameters())
        sl = slice(rank * B // n, (rank + 1) * B // n)
        for x, y in data:
            f.backward(nn.mse_loss(f(x[sl]), y[sl])[1])
            opt.step()
        return f.full_state_dict(rank0_only=False)

    for sd in run_world(body, 4):
        assert_state_close(sd, want)


def test_several_forwards_in_flight_then_backwards():
    """Micro-batches: forward 0, forward 1, backward 0, backward 1 (pipeline style)."""
    data = batches(2)
    model = seq_model()
    opt = make_opt("sgd", model.parameters())
    outs = [model(x) for x, _ in data]
    for o, (_, y) in zip(outs, data):
        model.backward(nn.mse_loss(o, y)[1])
    opt.step()
    want = model.state_dict(copy=True)

    def body(rank, n):
        f = FSDP(seq_model(), strategy=SS.FULL_SHARD)
        opt = make_opt("sgd", f.parameters())
        sl = slice(rank * B // n, (rank + 1) * B // n)
        outs = [f(x[sl]) for x, _ in data]
        for o, (_, y) in zip(outs, data):
            f.backward(nn.mse_loss(o, y[sl])[1])
        opt.step()
        return f.full_state_dict(rank0_only=False)

    for sd in run_world(body, 2):
        assert_state_close(sd, want)


def test_eval_under_no_grad_matches_and_frees_full_parameters():
    x = batches(1)[0][0]
    want = seq_model()(x)

    def body(rank, n):
        f = FSDP(seq_model(), strategy=SS.SHARD_GRAD_OP)
        with nn.no_grad():
            y = f(x)
        return y, f.memory_stats()["full_params"]

    for y, held in run_world(body, 3):
        np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)
        assert held == 0


def test_clip_grad_norm_matches_single_process():
    x, y = batches(1)[0]
    model = seq_model()
    model.backward(nn.mse_loss(model(x), y)[1])
    grads = np.concatenate([p.grad.reshape(-1) for p in model.parameters()])
    norm = float(np.linalg.norm(grads))

    def body(rank, n):
        f = FSDP(seq_model())
        sl = slice(rank * B // n, (rank + 1) * B // n)
        f.backward(nn.mse_loss(f(x[sl]), y[sl])[1])
        got = f.clip_grad_norm_(norm / 4)
        sq = sum(float(np.dot(p.grad, p.grad)) for p in f.parameters())
        tot = np.array([sq])
        ringlet.all_reduce(tot)
        return got, float(np.sqrt(tot[0]))

    for got, after in run_world(body, 3):
        assert got == pytest.approx(norm, rel=1e-12)
        assert after == pytest.approx(norm / 4, rel=1e-6)


# ---- memory accounting -------------------------------------------------------------------------------
def test_memory_full_shard_holds_a_shard_plus_at_most_two_units():
    unit_bytes = (16 * 16 + 16) * 8

    def body(rank, n, strategy, prefetch, overlap_reduce=True):
        f = FSDP(nn.Sequential(*[nn.Linear(16, 16, dtype=np.float64, rng=i) for i in range(6)]),
                 strategy=strategy, prefetch=prefetch, overlap_reduce=overlap_reduce)
        opt = optim.SGD(f.parameters(), lr=0.1)
        x = np.ones((4, 16))
        for _ in range(2):  # the second step follows the recorded order (prefetch)
            f.reset_peak_memory_stats()
            opt.zero_grad()
            f.backward(nn.mse_loss(f(x), x)[1])
            opt.step()
        return f.memory_stats()

    for st in run_world(body, 4, args=(SS.FULL_SHARD, True)):
        assert st["sharded_params"] == st["sharded_grads"] == 6 * unit_bytes // 4
        assert st["full_params"] == st["full_grads"] == 0  # nothing full between steps
        assert unit_bytes < st["peak_full_params"] <= 2 * unit_bytes  # current + prefetched
        assert st["peak_full_grads"] <= 2 * unit_bytes  # current + one reducing
        assert st["peak_comm"] == 0  # reduce-scatters land in the zeroed shard gradients
        assert st["peak_total"] <= 6 * unit_bytes // 2 + 4 * unit_bytes
    for st in run_world(body, 4, args=(SS.FULL_SHARD, False)):
        assert st["peak_full_params"] == unit_bytes
    for st in run_world(body, 4, args=(SS.FULL_SHARD, False, False)):
        # the lean setting: the running unit's full parameters and gradients only
        assert st["peak_full_params"] == st["peak_full_grads"] == unit_bytes
        assert st["peak_total"] == 6 * unit_bytes // 2 + 2 * unit_bytes
    for st in run_world(body, 4, args=(SS.SHARD_GRAD_OP, True)):
        assert st["peak_full_params"] == 6 * unit_bytes  # kept from forward to backward
    for st in run_world(body, 2, args=(SS.NO_SHARD, True)):
        assert st["sharded_params"] == st["sharded_grads"] == 6 * unit_bytes
        assert st["peak_full_params"] == st["peak_full_grads"] == 0  # DDP's footprint


# ---- state dicts and checkpoints ---------------------------------------------------------------------
def bn_model(seed=0):
    return nn.Sequential(nn.Linear(5, 6, dtype=np.float64, rng=seed), nn.BatchNorm1d(6, dtype=np.float64),
                         nn.Linear(6, 3, dtype=np.float64, rng=seed + 1))


@pytest.mark.parametrize("strategy", list(SS))
def test_full_state_dict_equals_rank0_model_unit_by_unit(strategy):
    want = bn_model(seed=0).state_dict(copy=True)

    def body(rank, n):
        m = bn_model(seed=rank)  # different per rank: construction syncs rank 0's values
        kw = dict(strategy=strategy)
        if strategy is SS.HYBRID_SHARD:
            kw["shard_size"] = 2
        f = FSDP(m, **kw)
        f.reset_peak_memory_stats()
        only0 = f.full_state_dict()
        peak = f.memory_stats()["peak_comm"]
        every = f.full_state_dict(rank0_only=False)
        return only0, every, peak

    out = run_world(body, 4)
    assert_state_close(out[0][0], want, rtol=0, atol=0)
    for r, (only0, every, peak) in enumerate(out):
        if r:
            assert only0 == {}
        assert_state_close(every, want, rtol=0, atol=0)
        # one unit's gather buffer at a time (the largest: 36 elements), never the
        # whole model (69 elements)
        assert peak <= 36 * 8


@pytest.mark.parametrize("rank0_only", [False, True])
def test_load_full_state_dict(rank0_only):
    src = seq_model(seed=11)
    x = batches(1)[0][0]
    want_y = src(x)
    sd = src.state_dict(copy=True)

    def body(rank, n):
        f = FSDP(seq_model(seed=0))
        res = f.load_full_state_dict(sd if (rank == 0 or not rank0_only) else None,
                                     rank0_only=rank0_only)
        with nn.no_grad():
            y = f(x)
        return f.full_state_dict(rank0_only=False), y, res

    for got, y, res in run_world(body, 3):
        assert res.missing_keys == [] and res.unexpected_keys == []
        assert_state_close(got, sd, rtol=0, atol=0)
        np.testing.assert_allclose(y, want_y, rtol=RTOL, atol=ATOL)


def test_load_full_state_dict_rejects_bad_entries_on_every_rank():
    good = seq_model().state_dict(copy=True)
    bad = dict(good)
    bad["2.weight"] = np.zeros((4, 4))

    def body(rank, n, sd, rank0_only):
        f = FSDP(seq_model())
        before = f.full_state_dict(rank0_only=False)
        try:
            f.load_full_state_dict(sd if rank == 0 or not rank0_only else None,
                                   rank0_only=rank0_only)
        except (ValueError, KeyError) as exc:
            after = f.full_state_dict(rank0_only=False)
            assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing changed
            return type(exc).__name__, str(exc)
        return None

    for rank0_only in (False, True):
        out = run_world(body, 2, args=(bad, rank0_only))
        assert all(o[0] == "ValueError" and "2.weight" in o[1] for o in out)
        missing = {k: v for k, v in good.items() if k != "0.bias"}
        out = run_world(body, 2, args=(missing, rank0_only))
        assert all(o[0] == "KeyError" and "0.bias" in o[1] for o in out)


def test_a_plan_that_fails_on_one_rank_fails_on_every_rank():
    # rank 1's wrap policy raises before the agreement: rank 0 must not wait in it
    def body(rank, n):
        def policy(name, m):
            if rank == 1:
                raise RuntimeError("policy broke on rank 1")
            return False

        try:
            FSDP(seq_model(), auto_wrap=policy)
        except (RuntimeError, ValueError) as exc:
            return type(exc).__name__, str(exc)
        return None

    out = run_world(body, 2, timeout=120)
    assert out[1] == ("RuntimeError", "policy broke on rank 1")
    assert out[0][0] == "ValueError" and "world ranks [1]" in out[0][1], out


def test_load_full_state_dict_rank0_only_with_a_non_string_key():
    # A key that names nothing (strict=False) on rank 0 must not stop rank 0
    # before the broadcast the other ranks wait in.
    src = seq_model(seed=11)
    sd = src.state_dict(copy=True)
    sd[1] = np.zeros(3)

    def body(rank, n):
        f = FSDP(seq_model(seed=0))
        res = f.load_full_state_dict(sd if rank == 0 else None, rank0_only=True,
                                     strict=False)
        return f.full_state_dict(rank0_only=False), res

    for got, res in run_world(body, 2):
        assert res.missing_keys == [] and res.unexpected_keys == [1]
        assert_state_close(got, {k: v for k, v in sd.items() if isinstance(k, str)},
                           rtol=0, atol=0)


def test_sharded_state_dict_round_trip_through_checkpoint(tmp_path):
    import ringlet.checkpoint as ckpt
    data = batches(2)
    path = str(tmp_path / "fsdp")

    def save_body(rank, n):
        f = FSDP(seq_model(), strategy=SS.FULL_SHARD)
        _train_fsdp_existing(rank, n, f, data)
        sd = f.sharded_state_dict()
        assert all(isinstance(v, ckpt.ShardedTensor) for k, v in sd.items())
        ckpt.save({"model": sd, "step": 2}, path)
        return f.full_state_dict(rank0_only=False)

    saved = run_world(save_body, 4)[0]

    def load_fsdp(rank, n, strategy):
        kw = dict(strategy=strategy)
        if strategy is SS.HYBRID_SHARD:
            kw["shard_size"] = 2
        f = FSDP(seq_model(seed=5), **kw)
        sd = f.sharded_state_dict()
        res = ckpt.load({"model": sd, "step": 0}, path)
        f.load_sharded_state_dict(sd)  # views: already in place; a no-op copy
        return f.full_state_dict(rank0_only=False), res.state_dict["step"]

    for strategy, n in ((SS.FULL_SHARD, 2), (SS.SHARD_GRAD_OP, 3), (SS.HYBRID_SHARD, 4),
                        (SS.NO_SHARD, 2)):
        for got, step in run_world(load_fsdp, n, args=(strategy,)):
            assert step == 2
            assert_state_close(got, saved, rtol=0, atol=0)

    def load_plain(rank, n):
        m = seq_model(seed=9)
        ckpt.load({"model": m.state_dict(), "step": 0}, path)
        return m.state_dict(copy=True)

    assert_state_close(run_world(load_plain, 1)[0], saved, rtol=0, atol=0)


def test_load_sharded_state_dict_from_copies_and_full_arrays():
    src = seq_model(seed=3).state_dict(copy=True)

    def body(rank, n):
        f = FSDP(seq_model(seed=3))
        sd = f.sharded_state_dict()
        copies = {k: (type(v)(v.local.copy(), v.spec) if hasattr(v, "spec") else v.copy())
                  for k, v in sd.items()}
        g = FSDP(seq_model(seed=4))
        g.load_sharded_state_dict(copies)
        a = g.full_state_dict(rank0_only=False)
        h = FSDP(seq_model(seed=4))
        h.load_sharded_state_dict(src)  # full arrays: this rank's part is taken
        b = h.full_state_dict(rank0_only=False)
        with pytest.raises(ValueError, match="ShardSpec"):
            wrong = dict(copies)
            k = "0.weight"
            v = copies[k]
            s, e = v.spec.flat_range
            other = type(v.spec).flat(v.spec.global_shape, s, s)  # an empty range instead
            wrong[k] = type(v)(np.zeros(0), other)
            g.load_sharded_state_dict(wrong)
        return a, b

    for a, b in run_world(body, 2):
        assert_state_close(a, src, rtol=0, atol=0)
        assert_state_close(b, src, rtol=0, atol=0)


# ---- errors ------------------------------------------------------------------------------------------
def _expect(fn, n=2):
    """Run fn on n ranks; every rank must return the message of the error it expected."""
    return run_world(fn, n)


def test_backward_without_forward_is_an_error():
    def body(rank, n):
        f = FSDP(seq_model())
        x, y = batches(1)[0]
        with pytest.raises(RuntimeError, match="no forward"):
            f.backward(np.ones((B // n, 1)))
        with nn.no_grad():
            out = f(x[: B // n])
        with pytest.raises(RuntimeError, match="no forward"):
            f.backward(np.ones_like(out))
        out = f(x[: B // n])
        f.backward(np.ones_like(out))
        with pytest.raises(RuntimeError, match="no forward"):
            f.backward(np.ones_like(out))  # twice
        with pytest.raises(RuntimeError, match="outside the FSDP wrapper"):
            f.module(x[: B // n])
        return True

    assert all(_expect(body))


def test_changing_a_parameter_after_wrapping_is_an_error():
    def body(rank, n):
        m = seq_model()
        f = FSDP(m)
        x = np.ones((2, 5))
        f.backward(np.ones_like(f(x)))
        m[2].weight.data = np.zeros((4, 7))  # a new shape
        with pytest.raises(ValueError, match=r"'2\.weight' changed after wrapping.*\(3, 7\)"):
            f(x)
        f.clear_context()
        g = FSDP(seq_model())
        g.module.to(np.float32)  # a new dtype
        with pytest.raises(ValueError, match="changed after wrapping"):
            g(x)
        h = FSDP(seq_model())
        h.module[0].weight = nn.Parameter(np.zeros((7, 5)))  # replaced through the wrapper
        with pytest.raises((RuntimeError, ValueError), match="0.weight"):
            h(x)
        return True

    assert all(_expect(body))


def test_ranks_that_disagree_get_an_error_everywhere():
    def strategies(rank, n):
        try:
            FSDP(seq_model(), strategy=SS.FULL_SHARD if rank == 0 else SS.SHARD_GRAD_OP)
        except ValueError as exc:
            return str(exc)
        return None

    out = _expect(strategies)
    assert all(o and "different" in o for o in out)

    def shapes(rank, n):
        m = seq_model() if rank else nn.Sequential(nn.Linear(5, 8, dtype=np.float64),
                                                   nn.Linear(8, 1, dtype=np.float64))
        try:
            FSDP(m, prefetch=True)
        except ValueError as exc:
            return str(exc)

    # Same number of elements per unit is not required to detect it: names and shapes differ.
    assert all(o and "ranks disagree" in o for o in run_world(shapes, 2))


def test_mismatched_groups_are_errors():
    def not_member(rank, n):
        g = ringlet.new_group([0, 1])
        if rank == 2:
            with pytest.raises(ValueError, match="not a member"):
                FSDP(seq_model(), group=g)
            return True
        FSDP(seq_model(), group=g)
        return True

    assert all(run_world(not_member, 3))

    def not_a_grid(rank, n):
        # shard groups {0,1},{2,3}; "replicate" groups {0,3},{1,2}: replicas would hold
        # different shard indices and average unrelated numbers
        gs = [ringlet.new_group(r) for r in ([0, 1], [2, 3], [0, 3], [1, 2])]
        mine = [g for g in gs if g.rank >= 0]
        try:
            FSDP(seq_model(), strategy=SS.HYBRID_SHARD, group=(mine[0], mine[1]))
        except ValueError as exc:
            return str(exc)

    assert all(o and ("grid" in o or "mismatch" in o) for o in run_world(not_a_grid, 4))

    def same_group_twice(rank, n):
        g = ringlet.new_group([0, 1])
        with pytest.raises(ValueError, match="share exactly this rank"):
            FSDP(seq_model(), strategy=SS.HYBRID_SHARD, group=(g, g))
        return True

    assert all(run_world(same_group_twice, 2))


def test_example_runs_under_the_launcher(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = clean_env(OPENBLAS_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "4",
                          os.path.join(root, "examples", "train_fsdp.py"), "--steps", "8",
                          "--checkpoint", str(tmp_path / "ckpt")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reloaded model identical: True" in out.stdout
    assert "plain copy agrees with FSDP: True" in out.stdout


def test_bad_arguments():
    assert FSDP is FullyShardedDataParallel

    def body(rank, n):
        with pytest.raises(TypeError, match="ringlet.nn.Module"):
            FSDP(object())
        with pytest.raises(ValueError, match="strategy"):
            FSDP(seq_model(), strategy="ZERO9")
        with pytest.raises(TypeError, match="prefetch"):
            FSDP(seq_model(), prefetch=1)
        with pytest.raises(TypeError, match="mixed_precision"):
            FSDP(seq_model(), mixed_precision=np.float16)
        with pytest.raises(TypeError, match="param_dtype"):
            MixedPrecision(param_dtype=np.int32)
        with pytest.raises(TypeError, match="auto_wrap"):
            FSDP(seq_model(), auto_wrap=3)
        with pytest.raises(ValueError, match="HYBRID_SHARD needs"):
            FSDP(seq_model(), strategy=SS.HYBRID_SHARD)
        with pytest.raises(ValueError, match="divide"):
            FSDP(seq_model(), strategy=SS.HYBRID_SHARD, shard_size=3)
        with pytest.raises(ValueError, match="shard_size is for HYBRID_SHARD"):
            FSDP(seq_model(), shard_size=2)
        with pytest.raises(ValueError, match="no parameters"):
            FSDP(nn.Sequential(nn.ReLU()))
        m = seq_model()
        f = FSDP(m)
        with pytest.raises(ValueError, match="already wrapped"):
            FSDP(m)
        with pytest.raises(ValueError, match="max_norm"):
            f.clip_grad_norm_(0)
        with pytest.raises(TypeError, match="mapping"):
            f.load_full_state_dict([1, 2])
        return True

    assert all(run_world(body, 2))


def test_parameter_shared_between_units_is_rejected():
    def body(rank, n):
        a, b = nn.Linear(3, 3, dtype=np.float64, rng=0), nn.Linear(3, 3, dtype=np.float64, rng=1)
        b.weight = a.weight  # tied across two Sequential children = two units
        with pytest.raises(ValueError, match="shared by units '0' and '1'"):
            FSDP(nn.Sequential(a, b))
        # one unit holding both is fine
        FSDP(nn.Sequential(a, b), auto_wrap=None)
        return True

    assert all(run_world(body, 2))


def test_construction_syncs_rank0_and_tied_weights_in_one_unit_train_correctly():
    def make():
        a, b = nn.Linear(5, 5, dtype=np.float64, rng=0), nn.Linear(5, 5, dtype=np.float64, rng=1)
        b.weight = a.weight
        return nn.Sequential(nn.Sequential(a, nn.Tanh(), b), nn.Linear(5, 1, dtype=np.float64, rng=2))

    data = batches(3)
    want = train_single(make, "adamw", data)

    def body(rank, n):
        f = FSDP(make(), auto_wrap=lambda name, m: name == "1")
        return _train_fsdp_existing(rank, n, f, data)

    for sd in run_world(body, 2):
        assert_state_close(sd, want)
        np.testing.assert_array_equal(sd["0.0.weight"], sd["0.2.weight"])
