"""Remote references: a handle to a value that lives on one worker (its owner).

Reference counting (the rule that keeps it race-free, see docs/rpc.md):

* Every ``RRef`` object, on any worker, holds exactly one count in the
  owner's table.  The owner keeps the value while the count is above zero
  and drops it when the count reaches zero.
* ``remote()`` creates the entry with a count of one, for the caller's RRef.
  The entry is created when the owner's reader thread receives the request
  (or before sending, when the caller is the owner), so a release that
  follows on the same connection always finds it.
* Sending an RRef inside an RPC first creates a *new* count for the receiver:
  locally when the sender is the owner, otherwise by a synchronous
  ``RREF_INC`` round trip to the owner that completes *before* the message
  carrying the RRef is sent.  The sender's own count is untouched, so it may
  drop its RRef at once; the receiver's count already exists when the
  receiver (or anyone) can release it.  If the send fails, or the receiver
  refuses the frame without decoding it (its CLOSE names the request), the
  new count is released again.
* A request for an RRef's value or method holds a count on the owner from
  its arrival until it is answered, so the caller may drop its RRef at once.
* When an RRef object is garbage collected, its count is released: queued
  (from ``__del__``, via a reentrant-safe queue) and sent to the owner by the
  agent's release thread.

A count held by a worker that dies is never released (the value lives until
the owner shuts down).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from ringlet.errors import CollectiveTimeout, RingletError

from .current import current_agent
from .future import Future, RemoteError
from .protocol import WorkerInfo

__all__ = ["RRef", "OwnedTable", "RRefKey"]

RRefKey = Tuple[int, int]  # (creator rank, sequence number on the creator): unique per job


@dataclass
class _Owned:
    count: int
    ready: bool = False
    value: Any = None
    error: Optional[Tuple[str, str, str]] = None  # (type, message, traceback) if the creator raised
    function: str = ""
    waiters: List[Callable[["_Owned"], None]] = field(default_factory=list)
    event: threading.Event = field(default_factory=threading.Event)


class OwnedTable:
    """The owner-side table of values held for RRefs, with their reference counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: Dict[RRefKey, _Owned] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def create(self, key: RRefKey, function: str, count: int = 1) -> None:
        with self._lock:
            if key in self._entries:
                raise RingletError(f"RRef {key} already exists on its owner")
            self._entries[key] = _Owned(count=count, function=function)

    def create_ready(self, key: RRefKey, value: Any) -> None:
        """An entry for a value the owner already has (``RRef(value)``)."""
        with self._lock:
            entry = _Owned(count=1, ready=True, value=value, function="RRef")
            entry.event.set()
            self._entries[key] = entry

    def set_result(self, key: RRefKey, value: Any = None, error: Optional[Tuple[str, str, str]] = None) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return  # every reference was dropped while the value was being computed
            entry.value, entry.error, entry.ready = value, error, True
            waiters, entry.waiters = entry.waiters, []
            entry.event.set()
        for w in waiters:
            w(entry)

    def fail_pending(self, key: RRefKey, error: Tuple[str, str, str]) -> None:
        """Record ``error`` as the value of an entry that is still pending (its
        creating request failed before it could run); a ready entry is kept."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.ready:
                return
        self.set_result(key, error=error)

    def when_ready(self, key: RRefKey, callback: Callable[[_Owned], None]) -> None:
        """Run ``callback(entry)`` once the value exists (now, if it already does).

        Raises:
            KeyError: no such entry (never created, or already freed).
        """
        with self._lock:
            entry = self._entries[key]
            if not entry.ready:
                entry.waiters.append(callback)
                return
        callback(entry)

    def incref(self, key: RRefKey) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(key)
            entry.count += 1

    def decref(self, key: RRefKey) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.count -= 1
            if entry.count > 0:
                return
            del self._entries[key]
        # Drop the value outside the lock: its destructor may release other RRefs.
        entry.value = None

    def wait(self, key: RRefKey, timeout: float) -> _Owned:
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            raise RingletError(f"RRef {key} is not (or no longer) held by this owner")
        if not entry.event.wait(timeout):
            raise CollectiveTimeout(f"RRef value from {entry.function!r} not ready after {timeout:.3g} s",
                                    op="rref.local_value", waited=timeout)
        return entry

    def clear(self) -> None:
        with self._lock:
            entries, self._entries = self._entries, {}
        entries.clear()


class RRef:
    """A reference to a value owned by one worker.

    Created by :func:`ringlet.rpc.remote` (the value is the remote function's
    result, kept on the callee) or by ``RRef(value)`` (a local value offered
    to others).  RRefs can be passed as RPC arguments and results; the owner
    keeps the value alive while any RRef to it exists anywhere.

    Example::

        ps = ringlet.rpc.remote("ps", ParameterServer)        # runs on "ps"
        ps.rpc_sync().push(grads)                            # calls ps_obj.push(grads) there
        w = ps.rpc_sync().get_weights()
        local_copy = ps.to_here()                            # copies the object here (needs pickle
                                                             # for custom classes)
    """

    __slots__ = ("_agent", "_owner", "_key", "_created", "_released", "__weakref__")

    def __init__(self, value: Any = None, *, _agent: Any = None, _owner: int = -1,
                 _key: Optional[RRefKey] = None, _created: Optional[Future] = None) -> None:
        if _agent is None:
            agent = current_agent()  # a user-created RRef owns a local value
            key = agent.new_rref_key()
            agent.owned.create_ready(key, value)
            _agent, _owner, _key = agent, agent.rank, key
        self._agent = _agent
        self._owner = _owner
        self._key = _key
        self._created = _created
        self._released = False

    def __repr__(self) -> str:
        return f"RRef(owner={self.owner_name()!r}, id={self._key})"

    # ---- identity -----------------------------------------------------------
    def owner(self) -> "WorkerInfo":
        """The :class:`WorkerInfo` of the worker that holds the value."""
        return self._agent.worker_info(self._owner)

    def owner_name(self) -> str:
        """The name of the worker that holds the value."""
        return self._agent.worker_info(self._owner).name

    def is_owner(self) -> bool:
        """Whether this worker holds the value."""
        return self._owner == self._agent.rank

    # ---- values -------------------------------------------------------------
    def local_value(self, timeout: Optional[float] = None) -> Any:
        """The value itself (not a copy); only on the owner.

        Waits for the creating call to finish if it is still running.

        Raises:
            RingletError: called on a worker that is not the owner.
            RemoteError: the function that created the value raised.
            CollectiveTimeout: the value was not ready within ``timeout``
                (default: the agent's ``rpc_timeout``).
        """
        if not self.is_owner():
            raise RingletError(
                f"local_value() is only available on the owner {self.owner_name()!r}; use to_here() to copy it")
        entry = self._agent.owned.wait(self._key, self._agent.check_timeout(timeout))
        if entry.error is not None:
            t, m, tb = entry.error
            raise RemoteError(t, m, tb, worker=self._agent.name, function=entry.function,
                              rank=self._agent.rank, peer=self._agent.rank)
        return entry.value

    def to_here(self, timeout: Optional[float] = None) -> Any:
        """Copy the value to this worker (on the owner: return it as is).

        Raises:
            RemoteError: the creating function raised.
            CollectiveTimeout: no answer within ``timeout`` (default ``rpc_timeout``).
            PeerClosedError: the owner died.
            TypeError: the value is not serializable and pickle is not enabled
                (raised remotely, arrives as ``RemoteError``).
        """
        if self.is_owner():
            return self.local_value(timeout)
        return self._agent.rref_fetch(self, timeout).result()

    def confirmed(self, timeout: Optional[float] = None) -> bool:
        """Wait until the owner has finished creating the value; True if it succeeded.

        Raises:
            CollectiveTimeout: not confirmed within ``timeout``.
        """
        if self._created is None:
            return True
        return self._created.exception(timeout if timeout is not None else self._agent.rpc_timeout) is None

    # ---- method proxies -----------------------------------------------------
    def rpc_sync(self, timeout: Optional[float] = None) -> "_Proxy":
        """A proxy whose method calls run on the owner and return the result.

        ``rref.rpc_sync().push(g)`` runs ``value.push(g)`` on the owner.  Only
        public methods can be called (names starting with ``_`` are refused,
        here and by the owner).
        """
        return _Proxy(self, sync=True, timeout=timeout)

    def rpc_async(self, timeout: Optional[float] = None) -> "_Proxy":
        """Like :meth:`rpc_sync`, but each method call returns a :class:`Future`."""
        return _Proxy(self, sync=False, timeout=timeout)

    # ---- lifetime -----------------------------------------------------------
    def __del__(self) -> None:
        # __del__ can run on any thread at any allocation; release() only puts
        # the key on a reentrant-safe queue.
        try:
            if not self._released:
                self._released = True
                self._agent.release(self._owner, self._key)
        except Exception:
            pass

    def __reduce__(self) -> Any:
        raise TypeError("an RRef can only travel inside ringlet.rpc call arguments or results "
                        "(not pickle), so that the owner can count it")

    def __copy__(self) -> "RRef":
        return self._agent.clone_rref(self)

    def __deepcopy__(self, memo: Any) -> "RRef":
        return self._agent.clone_rref(self)


class _Proxy:
    __slots__ = ("_rref", "_sync", "_timeout")

    def __init__(self, rref: RRef, *, sync: bool, timeout: Optional[float]) -> None:
        self._rref = rref
        self._sync = sync
        self._timeout = rref._agent.check_timeout(timeout)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(f"RRef proxies only call public methods; {method!r} starts with '_'")
        rref, sync, timeout = self._rref, self._sync, self._timeout

        def call(*args: Any, **kwargs: Any) -> Any:
            fut = rref._agent.rref_call(rref, method, args, kwargs, timeout)
            return fut.result() if sync else fut

        call.__name__ = method
        return call

    def __repr__(self) -> str:
        return f"<RRef {'sync' if self._sync else 'async'} proxy for {self._rref!r}>"

