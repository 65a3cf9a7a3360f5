"""Pipeline × data × tensor parallelism on a tiny GPT, and ``finalize_model_grads``.

The main test trains a tiny GPT-like model (vocabulary-parallel embedding
tied with the output projection, two pre-LayerNorm MLP blocks with
tensor-parallel, sequence-parallel MLPs, a final LayerNorm, vocabulary-
parallel cross-entropy) on 8 ranks laid out as a 2×2×2 mesh
("pp", "dp", "tp"), with ``ringlet.pipeline``'s 1F1B runtime and
``finalize_model_grads``, and compares the loss curve and the final weights
with the same model trained unsplit in one process on the whole batch.

Oracle and tolerance: the unsplit model uses only plain ``ringlet.nn``
layers (Embedding, LayerNorm, Linear, GELU, cross_entropy) built from the
same seeds.  Everything runs in float64; the distributed run sums the same
products in a different order (microbatches, data-parallel average,
tensor-parallel partial sums), so losses and weights agree to 1e-9
relative over 5 SGD-with-momentum steps.

The other tests check ``finalize_model_grads`` piece by piece against numpy:
tied gradients across a 4-stage pipeline, expert-parallel gradients of a
small mixture of experts against its unsplit model, and the attribute
contract (``dp_reduced``, data-parallel wrappers).
"""

from __future__ import annotations

import numpy as np
import pytest

from ringlet import ReduceOp, nn, optim
from ringlet.mesh import DeviceMesh
from ringlet.nn.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                        VocabParallelEmbedding, mark_sequence_parallel,
                                        vocab_parallel_cross_entropy)
from ringlet.parallel.finalize import finalize_model_grads
from ringlet.pipeline import PipelineStage, Schedule1F1B
from ringlet.testing import WorldError, run_world

F64 = np.float64
V, H, FF, S = 11, 8, 16, 5          # vocabulary 11 and sequence 5 split unevenly over tp=2
BATCH, MICRO, STEPS, LR = 8, 2, 5, 0.2
RTOL = 1e-9


def _ln(seed):
    ln = nn.LayerNorm(H, dtype=F64)
    r = np.random.default_rng(seed)
    ln.weight.data[:] = r.uniform(0.5, 1.5, H)
    ln.bias.data[:] = r.uniform(-0.2, 0.2, H)
    return ln


class Block(nn.Module):
    """``x + fc2(gelu(fc1(ln(x))))``; tensor- and sequence-parallel when ``tp`` is a group."""

    def __init__(self, seed, tp=None):
        super().__init__()
        self.ln = _ln(seed)
        if tp is None:
            self.fc1 = nn.Linear(H, FF, dtype=F64, rng=seed + 1)
            self.fc2 = nn.Linear(FF, H, dtype=F64, rng=seed + 2)
        else:
            mark_sequence_parallel(self.ln)
            self.fc1 = ColumnParallelLinear(H, FF, group=tp, sequence_parallel=True, dtype=F64,
                                            rng=seed + 1)
            self.fc2 = RowParallelLinear(FF, H, group=tp, sequence_parallel=True, dtype=F64,
                                         rng=seed + 2)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))

    def backward(self, g):
        return g + self.ln.backward(self.fc1.backward(self.act.backward(self.fc2.backward(g))))


class RefGPT(nn.Module):
    """The unsplit model: embedding, 2 blocks, LayerNorm, output projection tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H, dtype=F64, rng=0)
        self.b1, self.b2 = Block(10), Block(20)
        self.ln_f = _ln(30)
        self.head = nn.Linear(H, V, bias=False, dtype=F64, rng=0)
        self.head.weight = self.emb.weight          # tied: one Parameter, two uses

    def forward(self, idx):
        return self.head(self.ln_f(self.b2(self.b1(self.emb(idx)))))

    def backward(self, g):
        g = self.b1.backward(self.b2.backward(self.ln_f.backward(self.head.backward(g))))
        self.emb.backward(g)


def _data(step):
    tokens = np.random.default_rng(1000 + step).integers(0, V, (BATCH, S + 1))
    return tokens[:, :S], tokens[:, 1:]


def _train_reference():
    model = RefGPT()
    opt = optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        opt.zero_grad()
        loss, g = nn.cross_entropy(model(x), y)
        model.backward(g)
        opt.step()
        losses.append(loss)
    return losses, model.emb.weight.data.copy(), model.b2.fc1.weight.data.copy()


def _stage_module(pp, tp):
    """This rank's pipeline stage of the 3-D model."""
    if pp == 0:
        emb = VocabParallelEmbedding(V, H, group=tp, sequence_parallel=True, dtype=F64, rng=0)
        emb.weight.shared_embedding = True
        return nn.Sequential(emb, Block(10, tp))
    full_table = nn.Embedding(V, H, dtype=F64, rng=0).weight.data
    tied = nn.Linear(H, V, bias=False, dtype=F64, rng=0)
    tied.weight.data[:] = full_table                 # same start as the embedding copy
    head = ColumnParallelLinear.from_full(tied, tp, sequence_parallel=True)
    head.weight.shared_embedding = True
    return nn.Sequential(Block(20, tp), mark_sequence_parallel(_ln(30)), head)


def _train_3d(rank, n):
    mesh = DeviceMesh((2, 2, 2), ("pp", "dp", "tp"))
    pp, dp, tp_rank = mesh.coordinate
    tp = mesh["tp"]
    stage = PipelineStage(_stage_module(pp, tp), pp, 2, group=mesh["pp"])

    def loss_fn(logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, V, group=tp)

    sched = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    opt = optim.SGD(stage.parameters(), lr=LR, momentum=0.9)
    per = BATCH // mesh.size("dp")
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        rows = slice(dp * per, (dp + 1) * per)       # this replica's share of the batch
        opt.zero_grad()
        loss = sched.step(x[rows] if pp == 0 else None, y[rows] if pp == 1 else None)
        finalize_model_grads(stage.module, mesh=mesh)
        opt.step()
        if pp == 1:
            buf = np.array([loss])
            mesh["dp"].all_reduce(buf, ReduceOp.AVG)   # mean over replicas = global mean
            losses.append(float(buf[0]))
    # Weights to compare: the tied table (both copies) and one column-parallel weight.
    table = stage.module[0].weight.data if pp == 0 else stage.module[2].weight.data
    fc1 = stage.module[1].fc1.weight.data if pp == 0 else stage.module[0].fc1.weight.data
    return dict(coord=(pp, dp, tp_rank), losses=losses, table=table.copy(), fc1=fc1.copy())


def test_gpt_pipeline_tensor_data_parallel_matches_single_process():
    ref_losses, ref_table, ref_fc1_b2 = _train_reference()
    assert ref_losses[-1] < ref_losses[0]                 # it is actually learning
    out = run_world(_train_3d, 8, timeout=120)
    vocab_rows = np.array_split(np.arange(V), 2)
    ff_rows = np.array_split(np.arange(FF), 2)
    for r in out:
        pp, dp, tp = r["coord"]
        if pp == 1:
            np.testing.assert_allclose(r["losses"], ref_losses, rtol=RTOL)
        # Both copies of the tied table took identical steps and match the reference.
        np.testing.assert_allclose(r["table"], ref_table[vocab_rows[tp]], rtol=RTOL, atol=1e-12)
        if pp == 1:
            np.testing.assert_allclose(r["fc1"], ref_fc1_b2[ff_rows[tp]], rtol=RTOL, atol=1e-12)


# ---- finalize_model_grads piece by piece ---------------------------------------------------

def _tied_four_stages(rank, n):
    # pp=4 × dp=2: tied copies live on stages 0 and 3 (a group created by finalize).
    mesh = DeviceMesh((4, 2), ("pp", "dp"))
    pp, dp = mesh.coordinate
    dense = nn.Parameter(np.zeros(3))
    dense.grad = np.full(3, float(rank))
    params = [dense]
    if pp in (0, 3):
        tied = nn.Parameter(np.zeros(2))
        tied.shared_embedding = True
        tied.grad = np.array([pp + 1.0, 10.0 * (dp + 1)])
        params.append(tied)
    finalize_model_grads(params, mesh=mesh)
    # dense: mean over dp of world ranks 2*pp + {0, 1}
    np.testing.assert_array_equal(dense.grad, np.full(3, 2 * pp + 0.5))
    if pp in (0, 3):
        # first + last copies (same dp), then averaged over dp.
        np.testing.assert_array_equal(params[1].grad, [1.0 + 4.0, 15.0 * 2])
    # Second call reuses the cached group.
    finalize_model_grads(params, mesh=mesh)
    return True


def test_finalize_tied_embeddings_across_four_stages():
    assert all(run_world(_tied_four_stages, 8))


def _tied_mismatch(rank, n):
    mesh = DeviceMesh((2,), ("pp",))
    p = nn.Parameter(np.zeros(4))
    p.grad = np.ones(4)
    p.shared_embedding = rank == 0                  # the last stage forgot to tie
    finalize_model_grads([p], mesh=mesh, timeout=20)


def test_finalize_detects_untied_last_stage():
    with pytest.raises(WorldError) as ei:
        run_world(_tied_mismatch, 2, timeout=60)
    assert "DesyncError" in str(ei.value)


class _FakeWrapper:
    """A data-parallel wrapper as finalize sees it: parameters() and sync_gradients()."""

    def __init__(self, params):
        self._params = params
        self.synced = 0

    def parameters(self):
        return iter(self._params)

    def sync_gradients(self):
        self.synced += 1


def _attribute_contract(rank, n):
    mesh = DeviceMesh((2, 2), ("dp", "tp"))
    dp, tp = mesh.coordinate
    plain = nn.Parameter(np.zeros(2))
    plain.grad = np.full(2, float(rank))
    already = nn.Parameter(np.zeros(2))
    already.dp_reduced = True
    already.grad = np.full(2, float(rank))
    sp = nn.Parameter(np.zeros(2))
    sp.sequence_parallel = True
    sp.grad = np.full(2, float(rank))
    wrapped = nn.Parameter(np.zeros(2))
    wrapped.grad = np.full(2, float(rank))
    nograd = nn.Parameter(np.zeros(2))            # no gradient yet: counts as zeros
    frozen = nn.Parameter(np.zeros(2), requires_grad=False)
    w = _FakeWrapper([wrapped])
    finalize_model_grads([plain, already, sp, nograd, frozen, w], mesh=mesh)
    assert w.synced == 1
    grid = np.arange(4).reshape(2, 2)
    np.testing.assert_array_equal(plain.grad, np.full(2, grid[:, tp].mean()))   # avg over dp
    np.testing.assert_array_equal(already.grad, np.full(2, float(rank)))        # untouched
    np.testing.assert_array_equal(wrapped.grad, np.full(2, float(rank)))        # wrapper's job
    # sum over tp, then average over dp
    np.testing.assert_array_equal(sp.grad, np.full(2, grid.sum(axis=1).mean()))
    np.testing.assert_array_equal(nograd.grad, np.zeros(2))
    assert frozen.grad is None
    with pytest.raises(TypeError, match="DeviceMesh"):
        finalize_model_grads([plain], mesh=object())
    with pytest.raises(TypeError, match="model_chunks"):
        finalize_model_grads([3], mesh=mesh)
    return True


def test_finalize_attribute_contract():
    assert all(run_world(_attribute_contract, 4))


# ---- experts ------------------------------------------------------------------------------
E_H, E_TOK = 4, 3        # hidden size; tokens per replica


class MoE(nn.Module):
    """Two experts, token i routed to expert ``route[i]``.

    Unsplit (``ep=None``): both experts here.  Expert-parallel: this rank holds
    expert ``ep.rank``; the ep group all-gathers its tokens, each rank applies
    its expert to the tokens routed to it, and a reduce-scatter returns every
    token's output to its owner (backward: the mirror image).
    """

    def __init__(self, ep=None):
        super().__init__()
        self.ep = ep
        if ep is None:
            self.e0 = nn.Linear(E_H, E_H, dtype=F64, rng=100)
            self.e1 = nn.Linear(E_H, E_H, dtype=F64, rng=101)
        else:
            self.mine = nn.Linear(E_H, E_H, dtype=F64, rng=100 + ep.rank)
            for p in self.mine.parameters():
                p.expert = True

    def forward(self, xr):
        x, route = xr
        if self.ep is None:
            out = np.zeros_like(x)
            for e, layer in enumerate((self.e0, self.e1)):
                sel = route == e
                out[sel] = layer(x[sel])
            self._save(route)
            return out
        k = self.ep.size
        xs = np.empty((k * x.shape[0], E_H))
        self.ep.all_gather(xs, np.ascontiguousarray(x))
        rs = np.empty(k * route.size, route.dtype)
        self.ep.all_gather(rs, route)
        sel = rs == self.ep.rank
        full = np.zeros_like(xs)
        full[sel] = self.mine(xs[sel])
        out = np.empty_like(x)
        self.ep.reduce_scatter(out, full)
        self._save(sel)
        return out

    def backward(self, g):
        if self.ep is None:
            route = self._pop()
            gx = np.zeros_like(g)
            for e, layer in ((1, self.e1), (0, self.e0)):
                sel = route == e
                gx[sel] = layer.backward(g[sel])
            return gx
        sel = self._pop()
        k = self.ep.size
        gs = np.empty((k * g.shape[0], E_H))
        self.ep.all_gather(gs, np.ascontiguousarray(g))
        gfull = np.zeros_like(gs)
        gfull[sel] = self.mine.backward(gs[sel])
        gx = np.empty_like(g)
        self.ep.reduce_scatter(gx, gfull)
        return gx


def _moe_data():
    r = np.random.default_rng(55)
    x = r.standard_normal((4 * E_TOK, E_H))
    route = r.integers(0, 2, 4 * E_TOK).astype(np.int64)
    target = r.standard_normal((4 * E_TOK, E_H))
    return x, route, target


def _moe_step(dense, moe, x, route, target):
    h = dense(x)
    y = moe((h, route))
    loss, g = nn.mse_loss(y, target)
    dense.backward(moe.backward(g))
    return loss


def _moe_rank(rank, n, ref):
    mesh = DeviceMesh((2, 2), ("dp", "ep"))
    dp, ep = mesh.coordinate
    dense = nn.Linear(E_H, E_H, dtype=F64, rng=7)
    moe = MoE(mesh["ep"])
    x, route, target = _moe_data()
    mine = slice(rank * E_TOK, (rank + 1) * E_TOK)   # replica (dp, ep) = world rank
    _moe_step(dense, moe, x[mine], route[mine], target[mine])
    finalize_model_grads([dense, moe], mesh=mesh)
    np.testing.assert_allclose(dense.weight.grad, ref["dense.weight"], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dense.bias.grad, ref["dense.bias"], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(moe.mine.weight.grad, ref[f"e{ep}.weight"], rtol=1e-12,
                               atol=1e-14)
    np.testing.assert_allclose(moe.mine.bias.grad, ref[f"e{ep}.bias"], rtol=1e-12, atol=1e-14)
    return True


def test_finalize_expert_gradients_match_unsplit_moe():
    dense = nn.Linear(E_H, E_H, dtype=F64, rng=7)
    moe = MoE()
    x, route, target = _moe_data()
    _moe_step(dense, moe, x, route, target)          # mean loss over all 4 replicas' tokens
    ref = {"dense.weight": dense.weight.grad, "dense.bias": dense.bias.grad,
           "e0.weight": moe.e0.weight.grad, "e0.bias": moe.e0.bias.grad,
           "e1.weight": moe.e1.weight.grad, "e1.bias": moe.e1.bias.grad}
    assert all(run_world(_moe_rank, 4, args=(ref,)))
