"""``ShardSpec`` and ``ShardedTensor``: one rank's piece of a global tensor.

Two kinds of piece are described:

* a **box** (hyper-rectangle): per-dimension ``offsets`` and ``lengths``; the
  local array has shape ``lengths``.  Tensor-parallel and row/column splits.
* a **flat range** ``[start, stop)`` of the global tensor flattened in C order;
  the local array is 1-D with ``stop - start`` elements.  This is what FSDP
  holds: each parameter's slice of a rank's part of a flat (padded) buffer.
  Padding is never part of a tensor: a rank whose part of the buffer misses a
  parameter entirely gives an empty range (``start == stop``, local size 0).

The dtype is the local array's; every rank must agree on it and on the
global shape.  In a state dict, a plain ``numpy.ndarray`` is a *full* tensor
(replicated: every rank that has the key holds the same values).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ._region import Region, numel

__all__ = ["ShardSpec", "ShardedTensor"]


def _ints(x: Any, what: str) -> Tuple[int, ...]:
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise TypeError(f"{what} must be a sequence of ints, got {type(x).__name__}")
    out = []
    for v in x:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{what} must contain ints, got {v!r}")
        out.append(int(v))
    return tuple(out)


def _int(v: Any, what: str) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {v!r}")
    return int(v)


class ShardSpec:
    """Where a piece lies inside a global tensor: a box or a flat range.

    Build one with ``ShardSpec.box(global_shape, offsets, lengths)`` or
    ``ShardSpec.flat(global_shape, start, stop)``.

    Attributes:
        global_shape: shape of the whole tensor.
        offsets, lengths: the box (None for a flat range).
        flat_range: ``(start, stop)`` in the C-order flattened tensor (None for a box).
        local_shape: shape the local array must have.

    Example::

        # rows 4..8 of a (16, 3) weight
        ShardSpec.box((16, 3), offsets=(4, 0), lengths=(4, 3))
        # elements 10..25 of the same weight flattened (FSDP)
        ShardSpec.flat((16, 3), 10, 25)
    """

    __slots__ = ("global_shape", "offsets", "lengths", "flat_range")

    def __init__(self, global_shape: Sequence[int], offsets: Optional[Sequence[int]] = None,
                 lengths: Optional[Sequence[int]] = None, *,
                 flat_range: Optional[Tuple[int, int]] = None) -> None:
        shape = _ints(global_shape, "global_shape")
        if any(d < 0 for d in shape):
            raise ValueError(f"global_shape has a negative dimension: {shape}")
        self.global_shape = shape
        self.offsets: Optional[Tuple[int, ...]] = None
        self.lengths: Optional[Tuple[int, ...]] = None
        self.flat_range: Optional[Tuple[int, int]] = None
        if flat_range is not None:
            if offsets is not None or lengths is not None:
                raise ValueError("give either offsets/lengths (a box) or flat_range, not both")
            if isinstance(flat_range, (str, bytes)) or len(flat_range) != 2:
                raise TypeError(f"flat_range must be a (start, stop) pair, got {flat_range!r}")
            start = _int(flat_range[0], "flat_range start")
            stop = _int(flat_range[1], "flat_range stop")
            n = numel(shape)
            if not 0 <= start <= stop <= n:
                raise ValueError(f"flat_range ({start}, {stop}) is not inside [0, {n}] for "
                                 f"global_shape {shape}")
            self.flat_range = (start, stop)
            return
        if offsets is None or lengths is None:
            raise ValueError("a box ShardSpec needs both offsets and lengths (or use "
                             "ShardSpec.flat)")
        off = _ints(offsets, "offsets")
        ln = _ints(lengths, "lengths")
        if len(off) != len(shape) or len(ln) != len(shape):
            raise ValueError(f"offsets {off} and lengths {ln} must have one entry per dimension "
                             f"of global_shape {shape}")
        for d, (o, l, s) in enumerate(zip(off, ln, shape)):
            if o < 0 or l < 0 or o + l > s:
                raise ValueError(f"dimension {d}: offset {o} + length {l} does not fit in "
                                 f"global size {s}")
        self.offsets, self.lengths = off, ln

    @classmethod
    def box(cls, global_shape: Sequence[int], offsets: Sequence[int],
            lengths: Sequence[int]) -> "ShardSpec":
        """The box ``[offsets, offsets + lengths)`` of a tensor of ``global_shape``."""
        return cls(global_shape, offsets, lengths)

    @classmethod
    def flat(cls, global_shape: Sequence[int], start: int, stop: int) -> "ShardSpec":
        """Elements ``[start, stop)`` of the C-order flattened tensor of ``global_shape``."""
        return cls(global_shape, flat_range=(start, stop))

    @property
    def is_flat(self) -> bool:
        return self.flat_range is not None

    @property
    def local_shape(self) -> Tuple[int, ...]:
        if self.flat_range is not None:
            return (self.flat_range[1] - self.flat_range[0],)
        return self.lengths  # type: ignore[return-value]

    @property
    def numel(self) -> int:
        return numel(self.local_shape)

    def region(self) -> Region:
        if self.flat_range is not None:
            return Region((0,) * len(self.global_shape), self.global_shape, *self.flat_range)
        return Region.whole_box(self.offsets, self.lengths)  # type: ignore[arg-type]

    def to_json(self) -> dict:
        if self.flat_range is not None:
            return {"flat": list(self.flat_range)}
        return {"offsets": list(self.offsets), "lengths": list(self.lengths)}  # type: ignore

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ShardSpec) and self.global_shape == other.global_shape
                and self.offsets == other.offsets and self.lengths == other.lengths
                and self.flat_range == other.flat_range)

    def __hash__(self) -> int:
        return hash((self.global_shape, self.offsets, self.lengths, self.flat_range))

    def __repr__(self) -> str:
        if self.flat_range is not None:
            start, stop = self.flat_range
            return f"ShardSpec.flat({self.global_shape}, {start}, {stop})"
        return f"ShardSpec.box({self.global_shape}, offsets={self.offsets}, lengths={self.lengths})"


class ShardedTensor:
    """A local numpy array holding the part of a global tensor that ``spec`` describes.

    Args:
        local: the piece; shape ``spec.local_shape`` (1-D for a flat range).  On
            load it is filled in place, so it must be writable there.
        spec: a ``ShardSpec``.
    Raises:
        TypeError: ``local`` is not an ndarray or ``spec`` not a ShardSpec.
        ValueError: shapes disagree.

    Example::

        w = np.arange(12, dtype=np.float32)           # rank 1's elements 12..24
        st = ShardedTensor(w, ShardSpec.flat((8, 3), 12, 24))
    """

    __slots__ = ("local", "spec")

    def __init__(self, local: np.ndarray, spec: ShardSpec) -> None:
        if not isinstance(local, np.ndarray):
            raise TypeError(f"ShardedTensor.local must be a numpy.ndarray, got "
                            f"{type(local).__name__}")
        if not isinstance(spec, ShardSpec):
            raise TypeError(f"ShardedTensor.spec must be a ShardSpec, got {type(spec).__name__}")
        if tuple(local.shape) != spec.local_shape:
            raise ValueError(f"local array has shape {tuple(local.shape)} but {spec!r} needs "
                             f"{spec.local_shape}")
        self.local = local
        self.spec = spec

    @property
    def dtype(self) -> np.dtype:
        return self.local.dtype

    @property
    def global_shape(self) -> Tuple[int, ...]:
        return self.spec.global_shape

    def __repr__(self) -> str:
        return f"ShardedTensor({self.local.dtype}, {self.spec!r})"
