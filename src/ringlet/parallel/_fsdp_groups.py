"""FSDP's process groups: the shard group and, for HYBRID_SHARD, the replicate group.

A shard x replicate layout is a 2-D ``DeviceMesh`` (dim 0 replicate, dim 1
shard); ``shard_size=`` builds that mesh over the parent group.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np

import ringlet

from .mesh import DeviceMesh

__all__: List[str] = []


class _Grp:
    """A group as FSDP uses it: the handle passed to collectives, size, rank, world ranks."""

    __slots__ = ("pg", "size", "rank", "ranks")

    def __init__(self, pg: Any, size: int, rank: int, ranks: Sequence[int]) -> None:
        self.pg, self.size, self.rank, self.ranks = pg, size, rank, list(ranks)

    @classmethod
    def of(cls, pg: Any, what: str) -> "_Grp":
        if pg is None:
            n = ringlet.get_world_size()
            return cls(None, n, ringlet.get_rank(), range(n))
        if not all(hasattr(pg, a) for a in ("rank", "size", "ranks")):
            raise TypeError(f"FSDP: {what} must be a ringlet.ProcessGroup or None, got "
                            f"{type(pg).__name__}")
        if pg.rank < 0:
            raise ValueError(f"FSDP: this rank (world rank {ringlet.get_rank()}) is not a member "
                             f"of {what} (world ranks {list(pg.ranks)})")
        return cls(pg, int(pg.size), int(pg.rank), pg.ranks)


def _mesh_group(mesh: Any, dim: int) -> Any:
    get = getattr(mesh, "get_group", None)
    if not callable(get):
        raise TypeError(f"FSDP: mesh must have a get_group(dim) method (a DeviceMesh), got "
                        f"{type(mesh).__name__}")
    return get(dim)


def _hybrid_groups(parent: Any, shard_size: Any) -> Tuple[Any, Any]:
    if isinstance(shard_size, bool) or not isinstance(shard_size, (int, np.integer)):
        raise TypeError(f"FSDP: shard_size must be an int, got {type(shard_size).__name__}")
    p = _Grp.of(parent, "group")
    s = int(shard_size)
    if s < 1 or p.size % s:
        raise ValueError(f"FSDP: shard_size={s} must be positive and divide the group size "
                         f"{p.size}")
    # Consecutive blocks of s ranks shard; the same position in every block replicates.
    mesh = DeviceMesh((p.size // s, s), ("replicate", "shard"), ranks=p.ranks, group=parent)
    return mesh.get_group("shard"), mesh.get_group("replicate")
