"""The gradient bucket and how its reduction starts: shared by DDP and FSDP's replica reductions.

A bucket is a flat, C-contiguous gradient slice of the unsharded layout
(``FlatLayout`` with one shard) plus the group to average it over.  DDP cuts
its per-dtype buffers into buckets of at most ``bucket_cap_mb``; FSDP reduces
each unit's flat gradient (NO_SHARD) or gradient shard (HYBRID_SHARD, across
replicas) as one bucket.  Both start the reduction through ``start_bucket``
with a communication hook (``comm_hooks.allreduce_hook`` unless DDP was given
another), so the data-parallel average is one code path.
"""

from __future__ import annotations

from typing import Any, Callable, List

import numpy as np

from ringlet import nn

__all__ = ["GradBucket", "start_bucket"]


class GradBucket:
    """One bucket as seen by a communication hook.

    Attributes:
        index: position in launch order (0 is launched first).
        parameters: the parameters whose gradients lie in the bucket, in buffer order.
        names: their dotted names.
        dtype: gradient dtype.
        group: the process group to reduce over (None: the default group).
        world_size, rank: of that group.
    """

    def __init__(self, index: int, buffer: np.ndarray, parameters: List[nn.Parameter],
                 names: List[str], group: Any, world_size: int, rank: int, is_last: bool) -> None:
        self.index = index
        self._buffer = buffer
        self.parameters = parameters
        self.names = names
        self.dtype = buffer.dtype
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self._is_last = is_last

    def buffer(self) -> np.ndarray:
        """The bucket's flat, C-contiguous gradient slice (reduce it in place)."""
        return self._buffer

    def is_last(self) -> bool:
        """True for the bucket launched last in an iteration."""
        return self._is_last

    @property
    def numel(self) -> int:
        return self._buffer.size

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    def __repr__(self) -> str:
        return (f"GradBucket(index={self.index}, dtype={self.dtype}, numel={self.numel}, "
                f"params={self.names})")


def start_bucket(hook: Callable[[Any, GradBucket], Any], state: Any, bucket: GradBucket,
                 who: str) -> Any:
    """Start ``bucket``'s reduction with ``hook(state, bucket)``; returns its handle.

    Once the handle's ``wait()`` returns, ``bucket.buffer()`` holds the mean
    over ``bucket.group``, the same bits on every rank.

    Raises:
        TypeError: the hook returned something without ``wait()`` (``who``
            names the wrapper in the message).
    """
    work = hook(state, bucket)
    if not callable(getattr(work, "wait", None)):
        raise TypeError(f"{who}: the comm hook returned {type(work).__name__}, not a handle "
                        f"with wait()")
    return work
