"""numpy dtype <-> C dtype code, and which reductions each dtype allows."""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["ReduceOp", "dtype_code", "check_op"]


class ReduceOp(enum.IntEnum):
    """Reduction operations.  Values are the C core's rl_redop codes."""

    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    AVG = 4  #: floating dtypes only; the sum divided by the group size
    BAND = 5  #: integers and bool only
    BOR = 6
    BXOR = 7


# C rl_dtype codes (csrc/ringlet.h)
_CODES = {
    np.dtype(np.float16): 0,
    np.dtype(np.float32): 2,
    np.dtype(np.float64): 3,
    np.dtype(np.int8): 4,
    np.dtype(np.uint8): 5,
    np.dtype(np.int32): 6,
    np.dtype(np.int64): 7,
    np.dtype(np.bool_): 8,
}
_BF16 = 1
_FLOAT_CODES = {0, 1, 2, 3}
_BITWISE = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}

SUPPORTED = "float16, bfloat16 (ml_dtypes), float32, float64, int8, uint8, int32, int64, bool"


def dtype_code(dtype: np.dtype, what: str = "array") -> int:
    """The C code of a numpy dtype; TypeError naming it when unsupported.

    Native byte order only: the kernels read values as this machine stores
    them, and a byte-swapped array reduced as if native is garbage.  (The
    collectives map numpy's built-in types in the C binding,
    ``_core.array_code``, and come here for the rest.)
    """
    if not isinstance(dtype, np.dtype):
        dtype = np.dtype(dtype)
    code = _CODES.get(dtype)  # np.dtype(">f4") != np.dtype("<f4"): swapped types miss
    if code is not None:
        return code
    # ml_dtypes.bfloat16 is an extension dtype: match it by name so ml_dtypes
    # never has to be imported unless the user already uses it.
    if dtype.name == "bfloat16" and dtype.itemsize == 2 and dtype.isnative:
        return _BF16
    if not dtype.isnative:
        native = dtype.newbyteorder("=")
        if native in _CODES or native.name == "bfloat16":
            raise TypeError(f"{what} has dtype {dtype.str} ({native.name} in non-native byte order); "
                            f"convert it first, e.g. array.astype('{native.str}')")
    raise TypeError(f"{what} has unsupported dtype {dtype}; supported: {SUPPORTED}")


# (op, dtype code) pairs already validated: the common case costs one lookup.
_VALID: dict = {}


def check_op(op, code: int, dtype: np.dtype) -> int:
    """Validate a reduction for a dtype code; returns the C op code or raises ValueError."""
    key = (op, code)
    hit = _VALID.get(key)
    if hit is not None:
        return hit
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown reduction op {op!r}; use ringlet.ReduceOp") from None
    if op is ReduceOp.AVG and code not in _FLOAT_CODES:
        raise ValueError(f"ReduceOp.AVG is defined for floating dtypes only, not {np.dtype(dtype)}")
    if op in _BITWISE and code in _FLOAT_CODES:
        raise ValueError(f"ReduceOp.{op.name} is defined for integer and bool dtypes only, "
                         f"not {np.dtype(dtype)}")
    if isinstance(key[0], (int, ReduceOp)):  # hashable and stable: remember it
        _VALID[key] = int(op)
    return int(op)
