"""One FSDP unit's parameters of one (dtype, requires_grad): flat layout, shard, live buffers."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from ringlet import nn

from ._flat import FlatLayout

__all__: List[str] = []

_NUMPY_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


class _FlatGroup:
    """One unit's parameters of one (dtype, requires_grad): layout, shard and live buffers."""

    def __init__(self, name: str, params: List[nn.Parameter], names: List[str],
                 dtype: np.dtype, requires_grad: bool, shards: int, shard_rank: int,
                 mp: Optional[Any]) -> None:
        self.name = name
        self.index = 0  # position among the wrapper's flat groups (set by the wrapper)
        self.params = params
        self.names = names
        self.dtype = np.dtype(dtype)
        self.requires_grad = requires_grad
        self.shard_rank = shard_rank
        self.layout = FlatLayout([p.shape for p in params], shards)
        pd = mp.param_dtype if mp is not None else None
        rd = mp.reduce_dtype if mp is not None else None
        self.comm_dtype = pd if pd is not None else self.dtype
        self.compute_dtype = (self.comm_dtype if self.comm_dtype in _NUMPY_FLOATS
                              else np.dtype(np.float32))
        self.reduce_dtype = rd if rd is not None else self.compute_dtype
        self.sentinels = []
        for p in params:
            s = np.empty((0,), self.dtype)
            s.flags.writeable = False
            self.sentinels.append(s)
        self.bindings: List[Tuple[nn.Module, str, int]] = []
        self.shard: Optional[nn.Parameter] = None
        # Views of the shard itself, never gathered nor freed (NO_SHARD, no cast;
        # a bfloat16 param_dtype computes in float32 but must still round).
        self.permanent = (shards == 1 and self.comm_dtype == self.dtype
                          and self.compute_dtype == self.dtype)
        self.full: Optional[np.ndarray] = None
        self.views: Optional[List[np.ndarray]] = None
        self.gather: Optional[Tuple[Any, np.ndarray, np.ndarray]] = None
        self.grad_full: Optional[np.ndarray] = None


class _Pending:
    """A unit's gradient reduction in flight."""

    __slots__ = ("fg", "work", "inp", "out", "stage")

    def __init__(self, fg: _FlatGroup, work: Any, inp: np.ndarray, out: np.ndarray,
                 stage: int) -> None:
        self.fg, self.work, self.inp, self.out, self.stage = fg, work, inp, out, stage
