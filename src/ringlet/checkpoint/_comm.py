"""The few collectives the checkpoint layer needs, and the agreement vote.

Checkpointing uses only ringlet's public API (``get_rank``, ``get_world_size``,
``all_gather_object``, ``broadcast_object``).  When ringlet is not
initialised and no group is given, a checkpoint is saved or loaded by this
process alone (a world of one), so the same code serves notebooks and tools.

Every phase of a save or load ends in ``agree``: each rank contributes either
its result or its error, so a failure on one rank becomes an error on every
rank at the same point, instead of one rank raising while the others wait in
the next collective until they time out.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .._timeout import seconds
from ..errors import RingletError
from .errors import CheckpointError


class Comm:
    """Object collectives over a ringlet group, or a world of one."""

    def __init__(self, group: Any, timeout: Optional[float]) -> None:
        self.group = group
        self.timeout = timeout
        self.local = False
        import ringlet

        if timeout is not None:
            self.timeout = seconds(timeout)
        if group is None and not ringlet.is_initialized():
            self.local = True
            self.rank, self.size = 0, 1
            return
        self.rank = ringlet.get_rank(group)
        self.size = ringlet.get_world_size(group)
        if self.rank < 0:
            raise ValueError(f"this rank is not a member of {group!r}; only members may save "
                             f"or load through it")

    def all_gather_object(self, obj: Any) -> List[Any]:
        if self.local:
            return [obj]
        import ringlet

        return ringlet.all_gather_object(obj, group=self.group, timeout=self.timeout)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.local:
            return obj
        import ringlet

        return ringlet.broadcast_object(obj, src, group=self.group, timeout=self.timeout)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def agree(comm: Comm, what: str, error: Optional[BaseException], payload: Any = None) -> List[Any]:
    """All-gather (error, payload) from every rank; raise on every rank if any failed.

    The failing rank re-raises its own exception (so bad arguments stay a
    ``TypeError``/``ValueError`` there; a ringlet error gets this rank's
    number); every other rank raises a ``CheckpointError`` naming the failing
    ranks and their messages, with ``file`` and ``key`` of the lowest one.

    Returns:
        The payloads, in rank order, when no rank failed.
    """
    mine = None
    if error is not None:
        where = (error.file, error.key) if isinstance(error, CheckpointError) else (None, None)
        mine = [describe(error)[:2000], *where]
    got = comm.all_gather_object([mine, payload])
    failed: Dict[int, str] = {r: m[0] for r, (m, _) in enumerate(got) if m is not None}
    if not failed:
        return [p for _, p in got]
    others = {r: m for r, m in failed.items() if r != comm.rank}
    if error is not None:
        if isinstance(error, RingletError) and error.rank is None:
            # Raised below the collectives, which know the rank: name it here.
            error.rank, error.op = comm.rank, error.op or what
            if comm.size > 1 and error.args:
                error.args = (f"rank {comm.rank}: {error.args[0]}",) + error.args[1:]
        if others and hasattr(error, "add_note"):
            error.add_note(f"{what} also failed on rank(s) {sorted(others)}")
        raise error
    lines = "\n".join(f"  rank {r}: {m}" for r, m in sorted(failed.items()))
    _, file, key = got[min(failed)][0]
    raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)} (this is rank "
                          f"{comm.rank}):\n{lines}", failed_ranks=failed, rank=comm.rank,
                          op=what, file=file, key=key)
