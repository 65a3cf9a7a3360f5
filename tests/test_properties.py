"""Property-based tests: random sequences of collectives over random sizes, dtypes and ops."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringlet
from ringlet.testing import run_world

from _oracle import DTYPES, close, data, ops_for, reduce_np, same

_kinds = st.sampled_from(["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
                          "all_to_all"])


@st.composite
def _steps(draw):
    out = []
    for _ in range(draw(st.integers(1, 6))):
        dt = np.dtype(draw(st.sampled_from(DTYPES)))
        out.append((draw(_kinds), dt.str if dt.name != "bfloat16" else "bfloat16",
                    draw(st.integers(0, 70_000)), int(draw(st.sampled_from(ops_for(dt)))),
                    draw(st.integers(0, 7)), draw(st.integers(0, 2**16))))
    return out


def _dtype(s):
    if s == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(s)


def _run_steps(rank, P, steps):
    bad = []
    for kind, dts, n, op, root, salt in steps:
        dt, root = _dtype(dts), root % P
        op = ringlet.ReduceOp(op)
        if kind in ("all_reduce", "reduce"):
            ins = [data(r, n, dt, op, salt) for r in range(P)]
            x = ins[rank].copy()
            if kind == "all_reduce":
                ringlet.all_reduce(x, op)
                want = reduce_np(ins, op, dt)
            else:
                ringlet.reduce(x, dst=root, op=op)
                want = reduce_np(ins, op, dt) if rank == root else ins[rank]
            # a non-root's buffer is only read: exact whatever the op
            ok = close(x, want, op) if kind == "all_reduce" or rank == root else same(x, want)
        elif kind == "broadcast":
            ins = [data(r, n, dt, salt=salt) for r in range(P)]
            x = ins[rank].copy()
            ringlet.broadcast(x, src=root)
            ok = same(x, ins[root])  # bytes only move: exact whatever op was drawn
        elif kind == "all_gather":
            m = n // P
            ins = [data(r, m, dt, salt=salt) for r in range(P)]
            out = np.empty(m * P, dt)
            ringlet.all_gather(out, ins[rank])
            ok = same(out, np.concatenate(ins)) and same(ins[rank], data(rank, m, dt, salt=salt))
        elif kind == "reduce_scatter":
            m = n // P
            ins = [data(r, m * P, dt, op, salt) for r in range(P)]
            out = np.empty(m, dt)
            ringlet.reduce_scatter(out, ins[rank], op)
            ok = close(out, reduce_np(ins, op, dt)[rank * m:(rank + 1) * m], op) and \
                same(ins[rank], data(rank, m * P, dt, op, salt))
        else:
            m = n // P
            ins = [data(r, m * P, dt, salt=salt) for r in range(P)]
            out = np.empty(m * P, dt)
            ringlet.all_to_all(out, ins[rank])
            want = np.concatenate([ins[s][rank * m:(rank + 1) * m] for s in range(P)])
            ok = same(out, want)
        if not ok:
            bad.append((kind, dts, n, op.name, root))
    return bad


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=_steps(), P=st.sampled_from([2, 3, 5]))
def test_random_collective_sequences(steps, P):
    results = run_world(_run_steps, P, mode="thread", timeout=120, args=(steps,))
    assert results == [[]] * P, results
