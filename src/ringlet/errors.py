"""ringlet's exceptions.

One base class, ``RingletError`` (a ``RuntimeError``), and one subclass per way a
distributed operation can fail.  The ones that match a builtin category also
derive from it (``CollectiveTimeout`` is a ``TimeoutError``, ``PeerClosedError``
a ``ConnectionError``, ``OutOfMemoryError`` a ``MemoryError``) so generic handlers
keep working.

Each error carries the context needed to debug a job from one rank's log:
``rank`` (this rank in the group), ``peer`` (the other rank involved, or None),
``op`` (operation name), ``seq`` (the group's operation sequence number) and
``waited`` (seconds spent before giving up, where that applies).  The message
already names them; the attributes are for programs.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "RingletError",
    "CollectiveTimeout",
    "PeerClosedError",
    "DesyncError",
    "RendezvousError",
    "AuthenticationError",
    "GroupPoisonedError",
    "ProtocolError",
    "OutOfMemoryError",
]


class RingletError(RuntimeError):
    """Base class of every error ringlet raises for a failed distributed operation."""

    def __init__(
        self,
        message: str,
        *,
        rank: Optional[int] = None,
        peer: Optional[int] = None,
        op: Optional[str] = None,
        seq: Optional[int] = None,
        waited: Optional[float] = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.op = op
        self.seq = seq
        self.waited = waited


class CollectiveTimeout(RingletError, TimeoutError):
    """An operation passed its deadline (a peer is hung, stopped or very slow)."""


class PeerClosedError(RingletError, ConnectionError):
    """A peer closed or reset its connection: it crashed, exited or aborted."""


class DesyncError(RingletError):
    """Ranks disagree on the operation: different op, dtype, size, root or order."""


class RendezvousError(RingletError):
    """Ranks could not find each other (store unreachable, a rank never joined)."""


class AuthenticationError(RingletError):
    """A connection failed the HMAC handshake (wrong or missing job secret)."""


class GroupPoisonedError(RingletError):
    """The group failed earlier; the original error is the ``__cause__``.

    Recovery is ``ringlet.shutdown()`` followed by a new ``ringlet.init()``.
    """


class ProtocolError(RingletError):
    """A peer sent a malformed or oversized frame."""


class OutOfMemoryError(RingletError, MemoryError):
    """The C core could not allocate memory during an operation.

    Also a ``MemoryError``, so ``except MemoryError`` keeps catching it; as a
    ``RingletError`` it poisons the group and stops the other ranks like any failure.
    """
