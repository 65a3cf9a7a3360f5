"""The flat-buffer layout of the data-parallel wrappers, and FSDP's buffer accounting.

``FlatLayout`` places a list of parameters (one dtype) back to back in one
1-D buffer padded to a multiple of the shard count S.  FSDP lays out each
unit with S shards; DDP lays out each gradient buffer with S = 1 (the
unsharded case: it allocates just ``numel`` elements)::

    | p0 ........ | p1 .. | p2 ............ | pad |      padded = S * shard_numel
    |<- shard 0 ->|<- shard 1 ->|<- shard 2 ->|           shard r = [r*n, (r+1)*n)

Shard r owns elements ``[r * n, (r + 1) * n)`` of the padded buffer, whatever
parameters they belong to, so no parameter size needs to divide S.  Padding
sits at the end and only ever holds zeros (its gradient is zero too, so no
optimizer moves it).

``MemoryTracker`` counts the bytes of the buffers FSDP allocates, by
category, with peaks: the "buffers' own accounting" used by the memory
benchmark (docs/fsdp.md).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

__all__ = ["FlatLayout", "MemoryTracker", "CATEGORIES"]

#: What ``MemoryTracker`` counts.  sharded_*: persistent, 1/S of the unit;
#: full_*: a unit's gathered parameters and unsharded gradients (transient
#: under FULL_SHARD); comm: staging copies (low-precision casts, reduce-scatter
#: outputs, state-dict gathers).
CATEGORIES = ("sharded_params", "sharded_grads", "full_params", "full_grads", "comm")


class FlatLayout:
    """Where each parameter of one flat group lies in the padded buffer.

    Args:
        shapes: parameter shapes, in buffer order.
        shards: S, the number of shards (1: unsharded).
    """

    __slots__ = ("shapes", "sizes", "offsets", "numel", "padded", "shard_numel", "shards")

    def __init__(self, shapes: Sequence[Tuple[int, ...]], shards: int) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets: List[int] = []
        off = 0
        for n in self.sizes:
            self.offsets.append(off)
            off += n
        self.numel = off
        self.shards = int(shards)
        # At least one element per shard, so every all-gather moves something
        # (a unit whose parameters are all empty still has a valid buffer).
        self.shard_numel = max(1, -(-off // shards))
        self.padded = self.shard_numel * shards

    def shard_bounds(self, shard_rank: int) -> Tuple[int, int]:
        """``[lo, hi)`` of the padded buffer held by ``shard_rank``."""
        lo = shard_rank * self.shard_numel
        return lo, lo + self.shard_numel

    def param_range(self, i: int, shard_rank: int) -> Tuple[int, int]:
        """``[start, stop)`` of parameter ``i`` (flattened, C order) inside ``shard_rank``'s shard.

        Empty (``start == stop``) when the shard misses the parameter.
        """
        lo, hi = self.shard_bounds(shard_rank)
        off, n = self.offsets[i], self.sizes[i]
        start = min(max(lo - off, 0), n)
        stop = min(max(hi - off, 0), n)
        return start, max(start, stop)

    def shard_slice(self, i: int, shard_rank: int) -> slice:
        """Slice of the local shard array holding ``param_range(i, shard_rank)``."""
        start, stop = self.param_range(i, shard_rank)
        lo, _ = self.shard_bounds(shard_rank)
        base = self.offsets[i] - lo
        return slice(base + start, base + stop)

    def views(self, full: np.ndarray) -> List[np.ndarray]:
        """Each parameter's view (its shape) into a padded flat buffer ``full``."""
        return [full[o: o + n].reshape(s)
                for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def pack(self, arrays: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
        """A new padded flat buffer holding ``arrays`` (padding zero)."""
        out = np.zeros(self.padded, dtype)
        for a, o, n in zip(arrays, self.offsets, self.sizes):
            out[o: o + n] = np.asarray(a).reshape(-1)
        return out


class MemoryTracker:
    """Bytes held in FSDP's buffers, by category, and the peak of their sum.

    Buffers are registered when allocated (``alloc``/``track``) and dropped
    when FSDP releases them (``release``).  A released buffer may live on a
    little longer if something else still references it (a ``Work`` until its
    operation ends); the tracker counts FSDP's own holding.
    """

    def __init__(self) -> None:
        self._live: Dict[int, Tuple[str, int]] = {}
        self.current: Dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak: Dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0

    def track(self, category: str, array: np.ndarray) -> np.ndarray:
        """Count ``array`` under ``category`` until ``release(array)``; returns it."""
        if category not in self.current:
            raise ValueError(f"unknown memory category {category!r}")
        key = id(array)
        if key in self._live:
            return array
        self._live[key] = (category, array.nbytes)
        self.current[category] += array.nbytes
        self.peak[category] = max(self.peak[category], self.current[category])
        self.peak_total = max(self.peak_total, self.total)
        return array

    def alloc(self, category: str, n: int, dtype: np.dtype, *, zero: bool = False) -> np.ndarray:
        """A new 1-D buffer of ``n`` elements, counted under ``category``."""
        a = np.zeros(n, dtype) if zero else np.empty(n, dtype)
        return self.track(category, a)

    def release(self, array: np.ndarray) -> None:
        """Stop counting ``array`` (no-op for an untracked one)."""
        entry = self._live.pop(id(array), None)
        if entry is not None:
            self.current[entry[0]] -= entry[1]

    @property
    def total(self) -> int:
        return sum(self.current.values())

    def reset_peak(self) -> None:
        """Peaks restart from the current holdings."""
        self.peak = dict(self.current)
        self.peak_total = self.total

    def stats(self) -> Dict[str, int]:
        """``{category: bytes, "peak_<category>": bytes, "total": ..., "peak_total": ...}``."""
        out: Dict[str, int] = {}
        for c in CATEGORIES:
            out[c] = self.current[c]
            out[f"peak_{c}"] = self.peak[c]
        out["total"] = self.total
        out["peak_total"] = self.peak_total
        return out
