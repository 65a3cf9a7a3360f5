"""What data-parallel replicas must agree on, checked and copied the same way by DDP and FSDP.

- ``layout_digest`` / ``gather_layouts``: every member's digest of its layout description (names,
  shapes, dtypes, options), so a rank whose model differs is named before
  any collective of mismatched size can hang or corrupt.
- ``broadcast_packed``: copy the source's arrays into every replica in place,
  small arrays packed into one buffer per dtype (one collective each).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

import ringlet

__all__: List[str] = []


def layout_digest(description: Any) -> str:
    """SHA-256 of ``repr(description)``: any value whose repr captures the layout."""
    return hashlib.sha256(repr(description).encode()).hexdigest()


def gather_layouts(digest: str, group: Any, *extra: Any) -> List[list]:
    """``[digest, *extra]`` of every member of ``group`` (None: the world), in group-rank order.

    Collective over ``group``; only the digests (and ``extra``) travel.
    """
    return ringlet.all_gather_object([digest, *extra], group=group)


def broadcast_packed(arrays: Sequence[np.ndarray], bcast: Callable[[np.ndarray], None], *,
                     is_src: bool, alone_bytes: Optional[int] = None) -> None:
    """Copy the source's ``arrays`` into every replica's, in place.

    Args:
        arrays: the same shapes and dtypes, in the same order, on every rank.
        bcast: broadcasts one array in place from the source (collective).
        is_src: whether this rank is the source.
        alone_bytes: arrays at least this large that are contiguous and
            writable are broadcast on their own (no copy); None packs all.
    """
    small: Dict[np.dtype, List[np.ndarray]] = {}
    for a in arrays:
        if alone_bytes is not None and a.nbytes >= alone_bytes and a.flags.c_contiguous \
                and a.flags.writeable:
            bcast(a)
        else:
            small.setdefault(a.dtype, []).append(a)
    for dt, lst in small.items():  # one broadcast per dtype, in first-seen order
        packed = np.concatenate([a.reshape(-1) for a in lst]) if is_src \
            else np.empty(sum(a.size for a in lst), dt)
        bcast(packed)
        if not is_src:
            off = 0
            for a in lst:
                a[...] = packed[off: off + a.size].reshape(a.shape)
                off += a.size
