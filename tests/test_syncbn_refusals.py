"""SyncBatchNorm when one rank refuses its argument: every rank fails at once.

A rank whose input or ``grad_output`` has the wrong shape, or whose
pre-accumulate hook refuses a gradient, used to raise before the all-reduce
its peers were already waiting in, so they waited until their timeout and the
group was poisoned.  Now the refusing rank joins that all-reduce flagged: the
others raise ``ValueError`` well before the timeout, nothing is updated, and
the next step on the same group gives the unsplit ``BatchNorm1d``'s result.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

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


def _refuse(p):
    raise RuntimeError("refused by a pre-accumulate hook")


def _refusing_rank(rank, n, where):
    bn = SyncBatchNorm(C, dtype=np.float64, timeout=TIMEOUT)
    fired = []
    bn.register_grad_ready_hook(lambda p: fired.append(p))
    xs, gs = _global_batch(n)
    rows = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    x, g = xs[rows], gs[rows]
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
