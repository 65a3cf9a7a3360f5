"""The dtype registry: every dtype ringlet puts on a wire or in a file, once.

One table (``REGISTRY``) says, per numpy dtype, its code in the C core
(``rl_dtype`` in csrc/ringlet.h; the collectives, point-to-point and the
pipeline's frames use it), whether the object codec carries it (RPC, the
store's objects, ``broadcast_object``) and its safetensors code
(checkpoints).  The other tables are derived from it, and
tests/test_wire.py checks the C codes and names against ringlet.h and
kernels.c.  This module also says which reductions each dtype allows.
"""

from __future__ import annotations

import enum
from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np

__all__ = ["ReduceOp", "dtype_code", "check_op", "REGISTRY", "CORE_NAMES", "CODEC_DTYPES",
           "SAFETENSORS_CODES"]


class DTypeEntry(NamedTuple):
    name: str  #: numpy's name (ml_dtypes' for bfloat16 and float8)
    c_name: Optional[str]  #: the rl_dtype enumerator, None when the C core has no kernels for it
    core: Optional[int]  #: its value
    codec: bool  #: the object codec carries it
    safetensors: Optional[str]  #: the safetensors dtype code, None when checkpoints refuse it


REGISTRY: Tuple[DTypeEntry, ...] = (
    DTypeEntry("float16", "RL_F16", 0, True, "F16"),
    DTypeEntry("bfloat16", "RL_BF16", 1, False, "BF16"),
    DTypeEntry("float32", "RL_F32", 2, True, "F32"),
    DTypeEntry("float64", "RL_F64", 3, True, "F64"),
    DTypeEntry("int8", "RL_I8", 4, True, "I8"),
    DTypeEntry("uint8", "RL_U8", 5, True, "U8"),
    DTypeEntry("int32", "RL_I32", 6, True, "I32"),
    DTypeEntry("int64", "RL_I64", 7, True, "I64"),
    DTypeEntry("bool", "RL_BOOL", 8, True, "BOOL"),
    DTypeEntry("int16", "RL_I16", 9, True, "I16"),
    DTypeEntry("uint16", "RL_U16", 10, True, "U16"),
    DTypeEntry("uint32", "RL_U32", 11, True, "U32"),
    DTypeEntry("uint64", "RL_U64", 12, True, "U64"),
    DTypeEntry("complex64", None, None, True, None),
    DTypeEntry("complex128", None, None, True, None),
    DTypeEntry("float8_e4m3fn", None, None, False, "F8_E4M3"),
    DTypeEntry("float8_e5m2", None, None, False, "F8_E5M2"),
)

#: The C core's dtypes by code: CORE_NAMES[code] is the numpy name.
CORE_NAMES = [e.name for e in sorted((e for e in REGISTRY if e.core is not None),
                                     key=lambda e: e.core)]
#: numpy name -> safetensors code, for the dtypes checkpoints store.
SAFETENSORS_CODES: Dict[str, str] = {e.name: e.safetensors for e in REGISTRY if e.safetensors}
#: The codec's dtypes as little-endian ``dtype.str`` ("|" where byte order does not apply).
CODEC_DTYPES = frozenset(np.dtype(e.name).newbyteorder("<").str for e in REGISTRY if e.codec)


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


# numpy's own dtypes -> C code; bfloat16 is an extension type, matched by name.
_CODES = {np.dtype(e.name): e.core for e in REGISTRY if e.core is not None and e.name != "bfloat16"}
_BF16 = CORE_NAMES.index("bfloat16")
_FLOAT_CODES = {e.core for e in REGISTRY if e.core is not None and e.name.startswith(("float", "bfloat"))}
_BITWISE = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}

SUPPORTED = ", ".join(n + " (ml_dtypes)" if n == "bfloat16" else n for n in CORE_NAMES)


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
    """Validate a reduction for a dtype code; returns the C op code or raises ValueError.

    ``op`` is a ``ReduceOp`` or its integer value (``int`` or a numpy integer);
    a bool, float, string or any other object is an unknown op, even one whose
    value equals a code (``True == 1``, ``1.0 == 1``)."""
    if type(op) is not ReduceOp and type(op) is not int:
        if isinstance(op, (bool, np.bool_)) or not isinstance(op, (int, np.integer)):
            raise ValueError(f"unknown reduction op {op!r}; use ringlet.ReduceOp")
        op = int(op)  # an int subclass or a numpy integer: its value
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


def dtype_from_code(code: int) -> np.dtype:
    """The numpy dtype of a C core code: the inverse of ``dtype_code``.

    bfloat16 comes from ml_dtypes, imported only when that code arrives.
    Raises ValueError for a code the C core does not have.
    """
    code = int(code)
    if not 0 <= code < len(CORE_NAMES):
        raise ValueError(f"unknown dtype code {code}; the C core has codes "
                         f"0..{len(CORE_NAMES) - 1}")
    name = CORE_NAMES[code]
    if name == "bfloat16":
        import ml_dtypes  # only needed when a peer sends bfloat16

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
