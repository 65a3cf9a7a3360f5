"""Shared helpers for the collective tests: per-rank inputs and numpy oracles.

Every rank can rebuild every other rank's input from a seed, so each rank
checks its own result against numpy without extra communication.  Floating
inputs are small integers, which makes sums, products, minima and maxima
exact in any order: a mismatch is a real bug, not rounding.
"""

from __future__ import annotations

import numpy as np

import ringlet
from ringlet import ReduceOp

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    BF16 = None

FLOATS = [np.float16, np.float32, np.float64] + ([BF16] if BF16 is not None else [])
INTS = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
DTYPES = FLOATS + INTS + [np.bool_]


def is_float(dt) -> bool:
    return np.dtype(dt) in [np.dtype(d) for d in FLOATS]


def ops_for(dt):
    dt = np.dtype(dt)
    if is_float(dt):
        return [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]
    return [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
            ReduceOp.BOR, ReduceOp.BXOR]


def data(rank: int, count: int, dt, op=ReduceOp.SUM, salt: int = 0) -> np.ndarray:
    """Deterministic input of `rank`; values chosen so float results are exact."""
    rng = np.random.default_rng(1000003 * salt + rank)
    dt = np.dtype(dt)
    if dt == np.bool_:
        return rng.random(count) < 0.5
    if is_float(dt):
        if op == ReduceOp.PROD:
            v = rng.choice([-1.0, 1.0, 2.0, 0.5], size=count)
        else:
            v = rng.integers(-8, 9, size=count).astype(np.float64)
        return v.astype(dt)
    info = np.iinfo(dt)
    if op == ReduceOp.PROD:
        return rng.integers(-3 if info.min < 0 else 0, 4, size=count).astype(dt)
    if dt == np.uint64:  # beyond int64: drawn as its own type
        return rng.integers(0, info.max, size=count, dtype=np.uint64, endpoint=True)
    return rng.integers(info.min, int(info.max) + 1, size=count, dtype=np.int64).astype(dt)


def reduce_np(arrays, op, dt):
    """numpy oracle of a reduction over ranks, with the C core's semantics."""
    dt = np.dtype(dt)
    if dt == np.bool_:
        fn = {ReduceOp.SUM: np.logical_or, ReduceOp.PROD: np.logical_and,
              ReduceOp.MIN: np.logical_and, ReduceOp.MAX: np.logical_or,
              ReduceOp.BAND: np.logical_and, ReduceOp.BOR: np.logical_or,
              ReduceOp.BXOR: np.logical_xor}[op]
        acc = arrays[0].copy()
        for a in arrays[1:]:
            acc = fn(acc, a)
        return acc
    work = np.float64 if is_float(dt) else dt
    fn = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
          ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and,
          ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}[op]
    acc = arrays[0].astype(work)
    for a in arrays[1:]:
        acc = fn(acc, a.astype(work))
    if op == ReduceOp.AVG:
        acc = acc / len(arrays)
    return acc.astype(dt)


# Unit roundoff of each float dtype (half an ulp at 1.0).
_EPS = {np.dtype(np.float16): 2.0 ** -11, np.dtype(np.float32): 2.0 ** -24,
        np.dtype(np.float64): 2.0 ** -53}
if BF16 is not None:
    _EPS[BF16] = 2.0 ** -8


def avg_tolerance(dt) -> float:
    """Relative bound on an AVG result: the C core rounds 1/P once and the
    product sum * (1/P) once (half-precision types widen to float32 first and
    round a third time), so the result is within 4 unit roundoffs of sum / P."""
    return 4 * _EPS[np.dtype(dt)]


def close(got, want, op) -> bool:
    """Reductions: exact for every op but AVG, which allows avg_tolerance."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if op == ReduceOp.AVG:
        g, w = got.astype(np.float64), want.astype(np.float64)
        return bool(np.all(np.abs(g - w) <= avg_tolerance(got.dtype) * np.abs(w)))
    return np.array_equal(got.view(np.uint8), want.view(np.uint8)) if got.dtype == BF16 else \
        np.array_equal(got, want)


def same(got, want) -> bool:
    """Ops that only move bytes (broadcast, gather, scatter, all_gather,
    all_to_all): the result is the input, bit for bit."""
    return (got.shape == want.shape and got.dtype == want.dtype
            and np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes())


def counts_for(P: int):
    return sorted({0, 1, max(P - 1, 0), P + 1, 3001})


__all__ = ["DTYPES", "FLOATS", "INTS", "BF16", "ops_for", "data", "reduce_np", "close", "same",
           "avg_tolerance", "counts_for", "ringlet"]
