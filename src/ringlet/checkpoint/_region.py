"""Index arithmetic shared by save (coverage checks) and load (resharding).

Every piece of a tensor, on disk or in memory, is a ``Region``: the elements of
a box (``off``, ``ext``, in global coordinates) whose C-order index *inside
that box* lies in ``[start, stop)``.

* a box shard is ``Region(off, ext, 0, prod(ext))``;
* a flat shard ``[s, e)`` of a tensor of shape S is ``Region(0, S, s, e)``;
* a window of a box shard being read from disk is ``Region(off, ext, w0, w1)``.

A region's *storage* is a 1-D array whose element j is the region's element
with box-local index ``start + j`` (or, for a whole box, an array of shape
``ext``).  Resharding reduces to three steps: cut each region into at most
``2 * ndim - 1`` boxes (``range_to_boxes``), intersect boxes pairwise, and take
numpy views of both storages over each intersection (``view``), then copy.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, extents)


def numel(ext: Sequence[int]) -> int:
    n = 1
    for e in ext:
        n *= int(e)
    return n


def c_strides(ext: Sequence[int]) -> Tuple[int, ...]:
    """Element strides of a C-ordered array of shape ``ext``."""
    out = []
    s = 1
    for e in reversed(ext):
        out.append(s)
        s *= int(e)
    return tuple(reversed(out))


def ravel(idx: Sequence[int], ext: Sequence[int]) -> int:
    return sum(int(i) * s for i, s in zip(idx, c_strides(ext)))


def range_to_boxes(ext: Sequence[int], a: int, b: int) -> List[Box]:
    """Cut the C-order index range ``[a, b)`` of a box of shape ``ext`` into boxes.

    Along the leading dimension the range is a partial slab at the start, a run
    of whole slabs, and a partial slab at the end; the partial slabs recurse
    into the trailing dimensions.  So the result has at most ``2*ndim - 1``
    boxes, in index order, in the box's own coordinates.
    """
    ext = tuple(int(e) for e in ext)
    if a >= b:
        return []
    if not ext:
        return [((), ())]  # a 0-d tensor: its single element
    inner = numel(ext[1:])
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)
    if i0 == i1:  # the range stays inside one slab of dimension 0
        return [((i0,) + o, (1,) + e) for o, e in range_to_boxes(ext[1:], r0, r1)]
    out: List[Box] = []
    if r0:  # partial first slab
        out += [((i0,) + o, (1,) + e) for o, e in range_to_boxes(ext[1:], r0, inner)]
        i0 += 1
    if i1 > i0:  # whole slabs
        out.append(((i0,) + (0,) * (len(ext) - 1), (i1 - i0,) + ext[1:]))
    if r1:  # partial last slab
        out += [((i1,) + o, (1,) + e) for o, e in range_to_boxes(ext[1:], 0, r1)]
    return out


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The intersection of two boxes, or None when it is empty."""
    off, ext = [], []
    for ao, ae, bo, be in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + ae, bo + be)
        if hi <= lo:
            return None
        off.append(lo)
        ext.append(hi - lo)
    return tuple(off), tuple(ext)


class Region:
    """Elements of box (off, ext) whose box-local C-order index is in [start, stop)."""

    __slots__ = ("off", "ext", "start", "stop")

    def __init__(self, off: Sequence[int], ext: Sequence[int], start: int, stop: int) -> None:
        self.off = tuple(int(o) for o in off)
        self.ext = tuple(int(e) for e in ext)
        self.start = int(start)
        self.stop = int(stop)

    @classmethod
    def whole_box(cls, off: Sequence[int], ext: Sequence[int]) -> "Region":
        return cls(off, ext, 0, numel(ext))

    @property
    def size(self) -> int:
        return max(0, self.stop - self.start)

    @property
    def is_whole_box(self) -> bool:
        return self.start == 0 and self.stop == numel(self.ext)

    def key(self) -> tuple:
        return (self.off, self.ext, self.start, self.stop)

    def boxes(self) -> List[Box]:
        """This region as disjoint boxes in global coordinates."""
        return [(tuple(o + b for o, b in zip(lo, self.off)), le)
                for lo, le in range_to_boxes(self.ext, self.start, self.stop)]

    def sub(self, a: int, b: int) -> "Region":
        """Elements ``a:b`` of this region's storage, as a region."""
        return Region(self.off, self.ext, self.start + a, self.start + b)

    def span_of(self, box: Box) -> Tuple[int, int]:
        """Storage indices [first, last + 1) that ``box`` (inside this region) touches."""
        local = [o - ro for o, ro in zip(box[0], self.off)]
        last = [lo + e - 1 for lo, e in zip(local, box[1])]
        return ravel(local, self.ext) - self.start, ravel(last, self.ext) - self.start + 1

    def __repr__(self) -> str:
        return f"Region(off={self.off}, ext={self.ext}, [{self.start}, {self.stop}))"


def overlaps(a: Region, b: Region) -> List[Box]:
    """Boxes (global coordinates) of the elements two regions share."""
    out = []
    for x in a.boxes():
        for y in b.boxes():
            z = intersect(x, y)
            if z is not None:
                out.append(z)
    return out


def view(region: Region, storage: np.ndarray, box: Box) -> np.ndarray:
    """A numpy view of ``storage`` (holding ``region``) over global ``box``.

    ``box`` must lie inside the region.  Whole-box storage with the box's
    shape is sliced (any strides); otherwise storage must be 1-D and
    C-contiguous, and the view takes the strides of the region's box.
    """
    local = tuple(o - ro for o, ro in zip(box[0], region.off))
    if region.is_whole_box and storage.shape == region.ext:
        if not region.ext:
            return storage[...]
        return storage[tuple(slice(lo, lo + e) for lo, e in zip(local, box[1]))]
    if storage.ndim != 1 or not storage.flags.c_contiguous:
        raise ValueError("flat storage must be a 1-D C-contiguous array")
    first, end = region.span_of(box)
    if first < 0 or end > storage.size:  # guards as_strided against escaping the buffer
        raise AssertionError(f"box {box} lies outside {region} (storage of {storage.size})")
    isz = storage.itemsize
    # Strided over same-size raw bytes, then viewed back: as_strided goes through
    # the array interface, whose type string some ml_dtypes types (float8_e5m2:
    # '<f1') do not survive.
    raw = storage[first:].view(np.dtype((np.void, isz)))
    return as_strided(raw, shape=box[1],
                      strides=tuple(s * isz for s in c_strides(region.ext))).view(storage.dtype)


def check_cover(key: str, shape: Tuple[int, ...], items: List[Tuple[int, "Region"]]) -> None:
    """Distinct pieces of a sharded tensor must not overlap and must cover it."""
    n = numel(shape)
    flat = all(reg.ext == shape and not any(reg.off) for _, reg in items)
    if flat:  # FSDP-style ranges: sort and sweep
        order = sorted(items, key=lambda it: (it[1].start, it[1].stop))
        for (ra, a), (rb, b) in zip(order, order[1:]):
            if b.start < a.stop:
                raise ValueError(f"{key!r}: the flat shards of rank {ra} [{a.start}, {a.stop}) "
                                 f"and rank {rb} [{b.start}, {b.stop}) overlap")
    elif items:
        owner, lo, hi = [], [], []
        for i, (_r, reg) in enumerate(items):
            for off, ext in reg.boxes():
                owner.append(i)
                lo.append(off)
                hi.append([o + e for o, e in zip(off, ext)])
        lo_a = np.array(lo, dtype=np.int64).reshape(len(lo), len(shape))
        hi_a = np.array(hi, dtype=np.int64).reshape(len(hi), len(shape))
        own = np.array(owner)
        # boxes i and j overlap when they overlap along every dimension
        hit = np.all((lo_a[:, None, :] < hi_a[None, :, :]) & (lo_a[None, :, :] < hi_a[:, None, :]),
                     axis=2) & (own[:, None] != own[None, :])
        if hit.any():
            i, j = np.argwhere(hit)[0]
            ra, rb = items[own[i]][0], items[own[j]][0]
            raise ValueError(f"{key!r}: the shards of rank {ra} and rank {rb} overlap "
                             f"(identical shards are allowed, partial overlaps are not)")
    covered = sum(reg.size for _, reg in items)
    if covered != n:
        raise ValueError(f"{key!r}: the shards of all ranks cover {covered} of the {n} elements "
                         f"of shape {shape}; every element must be held by some rank")
