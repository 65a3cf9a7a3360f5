"""ringlet: collectives for distributed training.

C kernels over authenticated TCP, driven from Python with the GIL released.

Example::

    import numpy as np
    import ringlet

    ringlet.init()                      # rank/world from the launcher
    x = np.full(4, ringlet.get_rank(), dtype=np.float32)
    ringlet.all_reduce(x)               # in place: sum over ranks
    ringlet.shutdown()

Launch with ``ringlet run -n 4 script.py``, ``mpirun``, ``srun`` or ``torchrun``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from . import errors
from ._dtypes import ReduceOp
from ._timeout import MAX_TIMEOUT
from ._world import (get_bind_address, get_rank, get_world_size, init, is_initialized,
                     job_key, new_group, shutdown)
from ._world import _require
from .errors import (AuthenticationError, CollectiveTimeout, DesyncError, GroupPoisonedError,
                     OutOfMemoryError, PeerClosedError, ProtocolError, RendezvousError,
                     RingletError)
from .group import ProcessGroup
from .group import _C as _Comm
from ._hier import Topology
from .work import Work
# After the core: the mesh builds on new_group.
from .parallel.dtensor import (DTensor, Partial, Placement, Replicate, Shard,  # noqa: E402
                               distribute)
from .parallel.mesh import DeviceMesh  # noqa: E402

from ._version import __version__  # noqa: E402

_SEND, _RECV = _Comm.send, _Comm.recv

__all__ = [
    "__version__", "init", "shutdown", "is_initialized", "get_rank", "get_world_size",
    "new_group", "job_key", "get_bind_address", "ReduceOp", "ProcessGroup", "Work", "MAX_TIMEOUT",
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_v", "reduce_scatter", "all_to_all",
    "all_to_all_v", "gather", "gather_v", "scatter", "scatter_v", "send", "recv", "isend", "irecv", "barrier",
    "broadcast_object", "all_gather_object", "errors", "get_topology", "Topology",
    "DeviceMesh", "DTensor", "Shard", "Replicate", "Partial", "Placement", "distribute",
    "RingletError", "CollectiveTimeout", "PeerClosedError", "DesyncError", "RendezvousError",
    "AuthenticationError", "GroupPoisonedError", "ProtocolError", "OutOfMemoryError",
]


# Module-level collectives act on `group` (default: the world).  Each is a
# one-line delegation so the docs and validation live in ProcessGroup.
def all_reduce(array: np.ndarray, op: ReduceOp = ReduceOp.SUM, *, group=None,
               async_op: bool = False, timeout: Optional[float] = None):
    """In-place all-reduce of ``array``; see ``ProcessGroup.all_reduce``."""
    return _require(group).all_reduce(array, op, async_op=async_op, timeout=timeout)


def broadcast(array: np.ndarray, src: int = 0, *, group=None, async_op: bool = False,
              timeout: Optional[float] = None):
    """Broadcast ``array`` from ``src``; see ``ProcessGroup.broadcast``."""
    return _require(group).broadcast(array, src, async_op=async_op, timeout=timeout)


def reduce(array: np.ndarray, dst: int = 0, op: ReduceOp = ReduceOp.SUM, *, group=None,
           async_op: bool = False, timeout: Optional[float] = None):
    """Reduce into ``array`` on ``dst``; see ``ProcessGroup.reduce``."""
    return _require(group).reduce(array, dst, op, async_op=async_op, timeout=timeout)


def all_gather(output: np.ndarray, input: np.ndarray, *, group=None, async_op: bool = False,
               timeout: Optional[float] = None):
    """Gather every rank's ``input`` into ``output``; see ``ProcessGroup.all_gather``."""
    return _require(group).all_gather(output, input, async_op=async_op, timeout=timeout)


def all_gather_v(output: np.ndarray, output_counts: Sequence[int], input: np.ndarray, *,
                 group=None, async_op: bool = False, timeout: Optional[float] = None):
    """Gather uneven blocks from every rank; see ``ProcessGroup.all_gather_v``."""
    return _require(group).all_gather_v(output, output_counts, input, async_op=async_op,
                                        timeout=timeout)


def reduce_scatter(output: np.ndarray, input: np.ndarray, op: ReduceOp = ReduceOp.SUM, *,
                   group=None, async_op: bool = False, timeout: Optional[float] = None):
    """Reduce then scatter; see ``ProcessGroup.reduce_scatter``."""
    return _require(group).reduce_scatter(output, input, op, async_op=async_op, timeout=timeout)


def all_to_all(output: np.ndarray, input: np.ndarray, *, group=None, async_op: bool = False,
               timeout: Optional[float] = None):
    """Equal-block all-to-all; see ``ProcessGroup.all_to_all``."""
    return _require(group).all_to_all(output, input, async_op=async_op, timeout=timeout)


def all_to_all_v(output: np.ndarray, output_counts: Sequence[int], input: np.ndarray,
                 input_counts: Sequence[int], *, group=None, async_op: bool = False,
                 timeout: Optional[float] = None):
    """All-to-all with per-rank counts; see ``ProcessGroup.all_to_all_v``."""
    return _require(group).all_to_all_v(output, output_counts, input, input_counts,
                                        async_op=async_op, timeout=timeout)


def gather(output: Optional[np.ndarray], input: np.ndarray, dst: int = 0, *, group=None,
           async_op: bool = False, timeout: Optional[float] = None):
    """Gather to ``dst``; see ``ProcessGroup.gather``."""
    return _require(group).gather(output, input, dst, async_op=async_op, timeout=timeout)


def scatter(output: np.ndarray, input: Optional[np.ndarray], src: int = 0, *, group=None,
            async_op: bool = False, timeout: Optional[float] = None):
    """Scatter from ``src``; see ``ProcessGroup.scatter``."""
    return _require(group).scatter(output, input, src, async_op=async_op, timeout=timeout)


def gather_v(output: Optional[np.ndarray], output_counts: Optional[Sequence[int]],
             input: np.ndarray, dst: int = 0, *, group=None, async_op: bool = False,
             timeout: Optional[float] = None):
    """Gather uneven blocks to ``dst``; see ``ProcessGroup.gather_v``."""
    return _require(group).gather_v(output, output_counts, input, dst, async_op=async_op,
                                    timeout=timeout)


def scatter_v(output: np.ndarray, input: Optional[np.ndarray],
              input_counts: Optional[Sequence[int]], src: int = 0, *, group=None,
              async_op: bool = False, timeout: Optional[float] = None):
    """Scatter uneven blocks from ``src``; see ``ProcessGroup.scatter_v``."""
    return _require(group).scatter_v(output, input, input_counts, src, async_op=async_op,
                                     timeout=timeout)


def send(array: np.ndarray, dst: int, tag: int = 0, *, group=None,
         timeout: Optional[float] = None) -> None:
    """Blocking tagged send; see ``ProcessGroup.send``."""
    # ProcessGroup.send's body, one call shallower: a small message's latency
    # is mostly its Python frames (docs/experiments.md).
    _require(group)._p2p(_SEND, "send", array, dst, tag, timeout, False, "dst")


def recv(array: np.ndarray, src: Optional[int] = None, tag: int = 0, *, group=None,
         timeout: Optional[float] = None) -> int:
    """Blocking tagged receive (``src=None``: from any rank); returns the sender's
    group rank.  See ``ProcessGroup.recv``."""
    return _require(group)._p2p(_RECV, "recv", array, src, tag, timeout, False, "src")


def isend(array: np.ndarray, dst: int, tag: int = 0, *, group=None,
          timeout: Optional[float] = None) -> Work:
    """Asynchronous tagged send; returns a ``Work``."""
    return _require(group).isend(array, dst, tag, timeout=timeout)


def irecv(array: np.ndarray, src: Optional[int] = None, tag: int = 0, *, group=None,
          timeout: Optional[float] = None) -> Work:
    """Asynchronous tagged receive; returns a ``Work`` whose ``result()`` is the sender."""
    return _require(group).irecv(array, src, tag, timeout=timeout)


def barrier(*, group=None, async_op: bool = False, timeout: Optional[float] = None):
    """Wait for every rank of the group."""
    return _require(group).barrier(async_op=async_op, timeout=timeout)


def broadcast_object(obj: Any = None, src: int = 0, *, group=None,
                     timeout: Optional[float] = None) -> Any:
    """Broadcast a small Python object (no pickle); returns it on every rank."""
    return _require(group).broadcast_object(obj, src, timeout=timeout)


def all_gather_object(obj: Any, *, group=None, timeout: Optional[float] = None) -> list:
    """Gather a small Python object from every rank (no pickle); list in rank order."""
    return _require(group).all_gather_object(obj, timeout=timeout)


def get_topology(group=None) -> Topology:
    """Which ranks of ``group`` (default: the world) share a host; see ``ringlet.Topology``.

    Example::

        t = ringlet.get_topology()
        print(t.num_hosts, t.ranks_per_host, t.local_rank)
    """
    return _require(group).topology
