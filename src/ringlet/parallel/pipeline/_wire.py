"""The pipeline's wire format: channel declarations, microbatch frames and tags.

A *channel* is one direction between two neighbouring stages:
the activations stage s sends to s+1, or the gradients stage s sends to s-1.
In each step, the first message of a channel is a *declaration*, a 16 x int64
header (magic, kind, step, sending stage, dtype, ndim, dims); every
microbatch then travels as one *frame*: a 128-byte header (magic, kind, step,
stage, microbatch) followed by the array's bytes.  The receiver allocates
every frame from the declaration, so it can post the frame receives ahead of
time, and checks it once: an activation must match the receiving stage's
``input_shape``/``input_dtype`` when declared, a gradient must have exactly
the shape and dtype of the activations it belongs to.  All microbatches of a
channel have the declared shape (equal splits of the batch); a stage output
that differs is a ``ValueError``.  Tags encode the message type, the sending
stage and the microbatch, so no two messages of a step share a tag::

    tag = type << 28 | stage << 16 | microbatch
    type: 1 activation declaration, 2 activation frame, 3 gradient declaration,
          4 gradient frame (declarations use microbatch 0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

__all__: List[str] = []

_MAGIC = 0x524C5050  # "RLPP"
_HDR_LEN = 16  # int64 words: declarations are one header, frames start with one
_HDR_BYTES = _HDR_LEN * 8
_MAX_NDIM = _HDR_LEN - 8
_KIND_DATA, _KIND_POISON = 1, 2
# A declaration may not promise more than one frame can carry (the C core's
# default max_frame_bytes): the receiver allocates that much per frame.
_MAX_FRAME_BYTES = 1 << 40
_T_ACT_DECL, _T_ACT, _T_GRAD_DECL, _T_GRAD = 1, 2, 3, 4

from ..._dtypes import CORE_NAMES as _DTYPES  # noqa: E402 - frames carry the C core's codes
from ..._dtypes import dtype_from_code  # noqa: E402


def _dtype_code(dt: np.dtype) -> int:
    """The C core code of ``dt``; frames carry native byte order only.

    ``dt.name`` is 'float32' for '>f4' too, so a byte-swapped dtype is refused
    here (the runtime converts such arrays to native order before sending).
    """
    name = "bool" if dt == np.bool_ else dt.name
    if name not in _DTYPES:
        raise TypeError(f"pipeline messages cannot carry dtype {dt}; supported: "
                        f"{', '.join(_DTYPES)}")
    if not dt.isnative:
        raise TypeError(f"pipeline messages carry native byte order only, got dtype {dt.str} "
                        f"({name} in non-native byte order)")
    return _DTYPES.index(name)


def _dtype_of(code: int) -> np.dtype:
    return dtype_from_code(code)


def _tag(msg_type: int, stage: int, mb: int) -> int:
    return (msg_type << 28) | (stage << 16) | mb


def _declaration(step: int, stage: int, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if len(shape) > _MAX_NDIM:
        raise ValueError(f"stage {stage}: pipeline messages carry at most {_MAX_NDIM} "
                         f"dimensions, got an array of shape {shape}")
    h = np.zeros(_HDR_LEN, np.int64)
    h[:7] = (_MAGIC, _KIND_DATA, step, stage, 0, _dtype_code(dtype), len(shape))
    h[7:7 + len(shape)] = shape
    return h


def _poison_declaration(step: int, stage: int, origin: int) -> np.ndarray:
    h = np.zeros(_HDR_LEN, np.int64)
    h[:4] = (_MAGIC, _KIND_POISON, step, stage)
    h[15] = origin
    return h


def _frame(step: int, stage: int, mb: int, arr: Optional[np.ndarray], nbytes: int,
           origin: int = -1) -> np.ndarray:
    """A frame: header then ``nbytes`` of payload (``arr``'s bytes, or zeros for a poison)."""
    buf = np.empty(_HDR_BYTES + nbytes, np.uint8)
    h = buf[:_HDR_BYTES].view(np.int64)
    h[:] = 0
    h[:5] = (_MAGIC, _KIND_DATA if arr is not None else _KIND_POISON, step, stage, mb)
    h[15] = origin
    if arr is not None:
        buf[_HDR_BYTES:] = arr.reshape(-1).view(np.uint8)
    else:
        buf[_HDR_BYTES:] = 0
    return buf


def _poison_in_place(buf: np.ndarray, step: int, stage: int, origin: int) -> np.ndarray:
    """Rewrite a sent data frame's header as a POISON frame's (same size, nothing allocated)."""
    h = buf[:_HDR_BYTES].view(np.int64)
    h[:] = 0
    h[:5] = (_MAGIC, _KIND_POISON, step, stage, -1)
    h[15] = origin
    return buf


@dataclass
class _Decl:
    kind: int  # _KIND_DATA, _KIND_POISON, or 0 when malformed
    shape: Tuple[int, ...] = ()
    dtype: Optional[np.dtype] = None
    origin: int = -1
    error: Optional[str] = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # Python ints: no wrap-around


def _parse_declaration(h: np.ndarray, step: int, stage: int, what: str) -> _Decl:
    """Decode a channel declaration; ``error`` set (never raised) when it is malformed."""
    if int(h[0]) != _MAGIC or int(h[1]) not in (_KIND_DATA, _KIND_POISON):
        return _Decl(0, error=f"{what}: malformed pipeline header {h[:7].tolist()}")
    if (int(h[2]), int(h[3])) != (step, stage):
        return _Decl(0, error=f"{what}: declaration for step {int(h[2])}, stage {int(h[3])} "
                              f"where step {step}, stage {stage} was due (ranks run different "
                              f"schedules?)")
    if int(h[1]) == _KIND_POISON:
        return _Decl(_KIND_POISON, origin=int(h[15]))
    code, ndim = int(h[5]), int(h[6])
    if not 0 <= code < len(_DTYPES) or not 0 <= ndim <= _MAX_NDIM or (h[7:7 + ndim] < 0).any():
        return _Decl(0, error=f"{what}: malformed pipeline header {h.tolist()}")
    decl = _Decl(_KIND_DATA, tuple(int(d) for d in h[7:7 + ndim]), _dtype_of(code))
    if decl.nbytes > _MAX_FRAME_BYTES:
        return _Decl(0, error=f"{what}: pipeline header declares shape {decl.shape} of "
                              f"{decl.dtype}, more than {_MAX_FRAME_BYTES} bytes")
    return decl


def _parse_frame(buf: np.ndarray, step: int, stage: int, mb: int, what: str
                 ) -> Tuple[int, int, Optional[str]]:
    """(kind, origin, error) of a received frame."""
    h = buf[:_HDR_BYTES].view(np.int64)
    if int(h[0]) != _MAGIC or int(h[1]) not in (_KIND_DATA, _KIND_POISON):
        return 0, -1, f"{what}: malformed pipeline frame header {h[:5].tolist()}"
    if int(h[1]) == _KIND_POISON:
        return _KIND_POISON, int(h[15]), None
    if (int(h[2]), int(h[3]), int(h[4])) != (step, stage, mb):
        return 0, -1, (f"{what}: frame of step {int(h[2])}, stage {int(h[3])}, microbatch "
                       f"{int(h[4])} where step {step}, stage {stage}, microbatch {mb} was due")
    return _KIND_DATA, -1, None
