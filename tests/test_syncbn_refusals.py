"""SyncBatchNorm when one rank refuses its argument: every rank fails at once.

A rank whose input or ``grad_output`` has the wrong shape, or whose
pre-accumulate hook refuses a gradient, used to raise before the all-reduce
its peers were already waiting in, so they waited until their timeout and the
group was poisoned.  Now the refusing rank joins that all-reduce flagged: the
others raise ``ValueError`` well before the timeout, nothing is updated, and
the next step on the same group gives the unsplit ``BatchNorm1d``'s result.

The same holds for a rank whose backward finds no saved forward context (its
forward failed, ran under ``no_grad()`` or was cleared; one backward too
many): it used to raise alone while its peers waited in backward's
all-reduce until their timeout.  Now every rank raises a ``RuntimeError``
naming the ranks without a context, well before the timeout.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import ringlet
from ringlet import nn
from ringlet.nn.sync_batchnorm import SyncBatchNorm
from ringlet.testing import run_world

C = 3
N_PER_RANK = 4
TIMEOUT = 20.0
BAD = 1


def _global_batch(n):
    g = np.random.default_rng(7)
    return (g.standard_normal((n * N_PER_RANK, C)) * 2 + 1,
            g.standard_normal((n * N_PER_RANK, C)))


def _rank_layer(rank, n):
    """A layer whose grad-ready hook records into ``fired``, and this rank's rows."""
    bn = SyncBatchNorm(C, dtype=np.float64, timeout=TIMEOUT)
    fired = []
    bn.register_grad_ready_hook(lambda p: fired.append(p))
    xs, gs = _global_batch(n)
    rows = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    return bn, fired, xs[rows], gs[rows]


def _refuse(p):
    raise RuntimeError("refused by a pre-accumulate hook")


def _refusing_rank(rank, n, where):
    bn, fired, x, g = _rank_layer(rank, n)
    bad = rank == BAD
    t0 = time.monotonic()
    err = None
    try:
        if where == "input":
            bn(x[:, :-1] if bad else x)
        else:
            bn(x)
            if where == "grad_output":
                bn.backward(g[:, :-1] if bad else g)
            else:
                h = bn.weight.register_grad_pre_accumulate_hook(_refuse) if bad else None
                try:
                    bn.backward(g)
                finally:
                    if h is not None:
                        h.remove()
    except Exception as e:  # noqa: BLE001 - inspected by the test
        err = (type(e).__name__, str(e))
    took = time.monotonic() - t0
    state = (int(bn.num_batches_tracked), bn.num_saved_contexts(),
             None if bn.weight.grad is None else bn.weight.grad.copy())
    # The same group carries on: a clean step, every hook firing once.
    bn.zero_grad()
    fired.clear()
    y = bn(x)
    gx = bn.backward(g)
    return err, took, state, len(fired), y, gx, int(bn.num_batches_tracked)


@pytest.mark.parametrize("where", ["input", "grad_output", "hook"])
def test_a_rank_refusing_its_argument_fails_every_rank_at_once(where):
    n = 3
    results = run_world(_refusing_rank, n, args=(where,), timeout=120)
    pattern = {"input": "expected input (N, 3)", "grad_output": "grad_output has shape",
               "hook": "refused by a pre-accumulate hook"}[where]
    for rank, (err, took, state, _, _, _, _) in enumerate(results):
        assert took < TIMEOUT / 2, f"rank {rank} took {took:.1f}s (timeout {TIMEOUT}s)"
        tracked, contexts, wgrad = state
        assert contexts == 0
        if rank == BAD:
            assert err is not None and pattern in err[1], err
        elif where == "hook":
            assert err is None  # its backward completed: the refusal came after the reduction
        else:
            when = "forward" if where == "input" else "backward"
            assert err == ("ValueError", f"SyncBatchNorm.{when}: 1 other rank(s) of the group "
                           f"refused their {where} (each raised why); this rank computed and "
                           f"updated nothing"), err
        if where == "input":
            assert tracked == 0  # no rank updated its running statistics
        if where == "grad_output" or (where == "hook" and rank == BAD):
            assert wgrad is None  # no gradient went in
    # The next step matches BatchNorm1d over the concatenated batch.
    xs, gs = _global_batch(n)
    ref = nn.BatchNorm1d(C, dtype=np.float64)
    if where != "input":  # the failed step's forward completed everywhere: one update
        with nn.no_grad():
            ref(xs)
    y_ref = ref(xs)
    gx_ref = ref.backward(gs)
    for rank, (_, _, _, fired, y, gx, tracked) in enumerate(results):
        rows = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
        np.testing.assert_allclose(y, y_ref[rows], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(gx, gx_ref[rows], rtol=1e-10, atol=1e-12)
        assert tracked == int(ref.num_batches_tracked)
        assert fired == 2  # weight and bias: no use left over from the failed step


REFUSER = 0  # refuses its grad_output while BAD has no context ("with_refusal")


class _FailsOn(nn.Module):
    """Identity that raises on one rank, after SyncBatchNorm's forward succeeded there."""

    def __init__(self, fail):
        super().__init__()
        self.fail = fail

    def forward(self, x):
        if self.fail:
            raise RuntimeError("a later layer failed on this rank")
        return x

    def backward(self, g):
        return g


def _no_context_message(missing, mine, where=None):
    where = where or f"rank(s) {missing} of the group"
    this = "this rank is one of them" if mine else "this rank computed and updated nothing"
    return (f"SyncBatchNorm.backward: {where} had no saved forward context (a forward that "
            f"failed or ran under no_grad(), a cleared context, or one backward too many); "
            f"every rank of the group raised this at once, {this}")


def _no_context_rank(rank, n, how):
    bn, fired, x, g = _rank_layer(rank, n)
    bad = rank == BAD
    if how == "forward_failed":  # bn's forward ran everywhere; BAD's call raised later
        model = nn.Sequential(bn, _FailsOn(bad))
        try:
            model(x)
        except RuntimeError:
            assert bad
    elif how == "no_grad" and bad:
        with nn.no_grad():
            bn(x)
    else:
        bn(x)
        if how in ("cleared", "with_refusal") and bad:
            bn.clear_context()
        elif how == "twice":  # every rank then calls backward once too often
            bn.backward(g)
    before = None if bn.weight.grad is None else bn.weight.grad.copy()
    gy = g[:, :-1] if how == "with_refusal" and rank == REFUSER else g
    t0 = time.monotonic()
    err = cause = None
    try:
        bn.backward(gy)
    except Exception as e:  # noqa: BLE001 - inspected by the test
        err = (type(e).__name__, str(e))
        cause = None if e.__cause__ is None else str(e.__cause__)
    took = time.monotonic() - t0
    after = None if bn.weight.grad is None else bn.weight.grad.copy()
    state = (bn.num_saved_contexts(), before, after)
    # The group carries on: a plain all_reduce, then a clean step.
    total = np.full(1, float(rank))
    ringlet.all_reduce(total, timeout=TIMEOUT)
    bn.zero_grad()
    fired.clear()
    y = bn(x)
    gx = bn.backward(g)
    return (err, cause, took, state, float(total[0]), len(fired), y, gx,
            int(bn.num_batches_tracked))


@pytest.mark.parametrize("how", ["forward_failed", "no_grad", "cleared", "twice",
                                 "with_refusal"])
def test_a_rank_without_a_saved_context_fails_every_rank_at_once(how):
    n = 3
    results = run_world(_no_context_rank, n, args=(how,), timeout=120)
    missing = list(range(n)) if how == "twice" else [BAD]
    for rank, (err, cause, took, state, total, _, _, _, _) in enumerate(results):
        assert took < TIMEOUT / 2, f"rank {rank} took {took:.1f}s (timeout {TIMEOUT}s)"
        mine = rank in missing
        assert err == ("RuntimeError", _no_context_message(missing, mine)), (rank, err)
        if mine:  # chained from this rank's own reason
            assert cause is not None and "no saved forward context (forward ran" in cause, cause
        elif how == "with_refusal" and rank == REFUSER:
            assert cause is not None and "grad_output has shape" in cause, cause
        else:
            assert cause is None, cause
        contexts, before, after = state
        assert contexts == 0
        if before is None:  # no gradient went in
            assert after is None
        else:
            np.testing.assert_array_equal(after, before)
        assert total == sum(range(n))
    # The next step matches BatchNorm1d over the concatenated batch (the failed
    # step's forward completed everywhere: one update of the running statistics).
    xs, gs = _global_batch(n)
    ref = nn.BatchNorm1d(C, dtype=np.float64)
    with nn.no_grad():
        ref(xs)
    y_ref = ref(xs)
    gx_ref = ref.backward(gs)
    for rank, (_, _, _, _, _, fired, y, gx, tracked) in enumerate(results):
        rows = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
        np.testing.assert_allclose(y, y_ref[rows], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(gx, gx_ref[rows], rtol=1e-10, atol=1e-12)
        assert tracked == int(ref.num_batches_tracked)
        assert fired == 2  # weight and bias: no use left over from the failed step


def _subgroup_rank(rank, n):
    sub = ringlet.new_group([0, 2])
    out = None
    if rank != 1:
        bn = SyncBatchNorm(C, dtype=np.float64, group=sub, timeout=TIMEOUT)
        xs, gs = _global_batch(n)
        x, g = xs[rank * N_PER_RANK:(rank + 1) * N_PER_RANK], gs[:N_PER_RANK]
        if rank == 2:
            with nn.no_grad():
                bn(x)
        else:
            bn(x)
        t0 = time.monotonic()
        err = None
        try:
            bn.backward(g)
        except RuntimeError as e:
            err = str(e)
        took = time.monotonic() - t0
        total = np.ones(1)
        ringlet.all_reduce(total, group=sub, timeout=TIMEOUT)
        out = (err, took, float(total[0]))
    ringlet.barrier(timeout=TIMEOUT)  # rank 1 stays until the members are done
    return out


def test_a_subgroup_rank_without_a_context_is_named_by_group_and_world_rank():
    results = run_world(_subgroup_rank, 3, timeout=120)
    where = "rank(s) [1] of the group (world rank(s) [2])"
    for rank in (0, 2):
        err, took, total = results[rank]
        assert took < TIMEOUT / 2, f"rank {rank} took {took:.1f}s (timeout {TIMEOUT}s)"
        assert err == _no_context_message([1], rank == 2, where), (rank, err)
        assert total == 2
