"""``Future`` (the result of ``rpc_async``) and ``RemoteError``."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, List, Optional

from ringlet._timeout import seconds
from ringlet.errors import CollectiveTimeout, RingletError

__all__ = ["Future", "RemoteError"]

_log = logging.getLogger("ringlet.rpc")


_TIMER_GRACE_S = 5.0  # past a call's deadline, before a wait stops trusting its timer


class RemoteError(RingletError):
    """A function called over RPC raised; this carries what was raised, where.

    Attributes:
        remote_type: qualified name of the remote exception type (e.g. ``"ValueError"``).
        remote_message: ``str()`` of the remote exception.
        remote_traceback: the formatted remote traceback (text).
        worker: name of the worker it was raised on.
        function: name of the registered function (or ``"RRef.method"``) that raised.
    """

    def __init__(self, remote_type: str, remote_message: str, remote_traceback: str, *,
                 worker: str, function: str, rank: Optional[int] = None, peer: Optional[int] = None) -> None:
        where = f"raised by {function!r} on worker {worker!r}" + (f" (rank {peer})" if peer is not None else "")
        text = f"{remote_type}: {remote_message}\n  [{where}]"
        if remote_traceback:
            text += "\n\nRemote traceback:\n" + remote_traceback.rstrip()
        super().__init__(text, rank=rank, peer=peer, op=f"rpc:{function}")
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.worker = worker
        self.function = function

    def __reduce__(self) -> Any:
        # The default rebuilds from ``args`` (the message alone), which the
        # keyword-only constructor refuses: multiprocessing, concurrent.futures
        # and copy could not carry a RemoteError.
        return (_rebuild_remote_error, (self.remote_type, self.remote_message, self.remote_traceback,
                                        self.worker, self.function, self.rank, self.peer), self.__dict__)


def _rebuild_remote_error(remote_type: str, remote_message: str, remote_traceback: str, worker: str,
                          function: str, rank: Optional[int], peer: Optional[int]) -> RemoteError:
    return RemoteError(remote_type, remote_message, remote_traceback, worker=worker, function=function,
                       rank=rank, peer=peer)


class Future:
    """The pending result of an asynchronous RPC.

    A future completes exactly once, with a value or an exception.  Every RPC
    future has a deadline (the call's timeout), so it always completes:
    with ``CollectiveTimeout`` if the callee did not answer in time, with
    ``PeerClosedError`` if the callee's connection died.

    Example::

        fut = ringlet.rpc.rpc_async("ps", "get_weights")
        fut.add_done_callback(lambda f: print("done", f.done()))
        weights = fut.result(timeout=10)
    """

    __slots__ = ("_desc", "_rank", "_peer", "_event", "_lock", "_value", "_exc", "_callbacks",
                 "_deadline", "_runner", "_link_s", "_follows")

    def __init__(self, description: str = "rpc", *, rank: Optional[int] = None, peer: Optional[int] = None) -> None:
        self._desc = description
        self._rank = rank
        self._peer = peer
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._value: Any = None
        self._exc: Optional[BaseException] = None
        self._callbacks: List[Callable[["Future"], None]] = []
        # The call's deadline (time.monotonic()), set by the agent: a wait
        # without a timeout ends a little after it even if the timer thread,
        # which completes timed-out calls, is held up by a done-callback.
        self._deadline: Optional[float] = None
        # Where done-callbacks run, set by the agent: off the RPC I/O threads,
        # whose replies a callback's own blocking call would wait for.
        self._runner: Optional[Callable[[Callable[[], None]], None]] = None
        # Seconds a then() callback gets past this future's deadline, set by the
        # agent; a future from then() has a deadline of its own with it.
        self._link_s: Optional[float] = None
        # Name of the then() callback that completes this future, if any.
        self._follows: Optional[str] = None

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exc is not None else "done")
        return f"<ringlet.rpc.Future {self._desc} {state}>"

    def done(self) -> bool:
        """True once the future has a value or an exception."""
        return self._event.is_set()

    def _wait(self, timeout: Optional[float]) -> None:
        if timeout is not None:
            timeout = seconds(timeout, zero=True)
        if self._event.is_set():
            return
        t0 = time.monotonic()
        late = timeout is None and self._deadline is not None
        if late:
            timeout = max(0.0, self._deadline - t0) + _TIMER_GRACE_S
        if not self._event.wait(timeout):
            if late and self._follows is not None:
                raise CollectiveTimeout(
                    f"{self._desc}: no result {_TIMER_GRACE_S:g} s past its deadline (the deadline "
                    f"of the future it follows plus {self._link_s:g} s): the callback "
                    f"{self._follows!r}, or a callback queued before it, has not returned "
                    f"(the future stays pending; wait(timeout=...) waits longer)",
                    rank=self._rank, peer=self._peer, op=self._desc, waited=time.monotonic() - t0)
            if late:
                raise CollectiveTimeout(
                    f"{self._desc}: no result {_TIMER_GRACE_S:g} s past the call's deadline "
                    f"(its timer did not fire: is a done-callback blocking the RPC timer "
                    f"thread?)", rank=self._rank, peer=self._peer, op=self._desc,
                    waited=time.monotonic() - t0)
            raise CollectiveTimeout(
                f"{self._desc}: no result after waiting {time.monotonic() - t0:.3g} s "
                "(the call is still pending)", rank=self._rank, peer=self._peer,
                op=self._desc, waited=time.monotonic() - t0)

    def result(self, timeout: Optional[float] = None) -> Any:
        """Wait for the call and return its value.

        Args:
            timeout: seconds to wait; None waits until the call completes
                (bounded by the call's own deadline; for a future from
                :meth:`then`, by the deadline of the future it follows plus
                the longer of that call's timeout and ``rpc_timeout``).

        Returns:
            The remote function's return value.

        Raises:
            RemoteError: the remote function raised.
            CollectiveTimeout: the call passed its deadline, or ``timeout``
                elapsed first (the call then stays pending), or a ``then``
                callback had not returned by its future's deadline (see above).
            PeerClosedError: the callee died or closed the connection.
            ValueError: ``timeout`` is negative or not a number.
        """
        self._wait(timeout)
        if self._exc is not None:
            raise self._exc
        return self._value

    wait = result  # torch.distributed.rpc spelling

    def value(self) -> Any:
        """The outcome of a future that has completed, without waiting (torch's ``Future.value``).

        Meant for a ``then`` or done-callback, or after :meth:`wait`.

        Returns:
            The remote function's return value.

        Raises:
            RingletError: the future has not completed yet.
            Exception: the call failed; its own error is raised
                (``RemoteError``, ``CollectiveTimeout``, ``PeerClosedError``...).

        Example::

            fut.then(lambda f: f.value() * 2)
        """
        if not self._event.is_set():
            raise RingletError(f"{self._desc}: value() called before the future completed; "
                               "use wait() or result() to wait for it",
                               rank=self._rank, peer=self._peer, op=self._desc)
        if self._exc is not None:
            raise self._exc
        return self._value

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """Wait like :meth:`result`, then return the exception (None on success)."""
        self._wait(timeout)
        return self._exc

    def add_done_callback(self, fn: Callable[["Future"], None]) -> None:
        """Call ``fn(future)`` when the future completes (at once if it already has).

        The callbacks of an RPC's future run, in the order they were added, on
        one of the agent's callback threads (``num_worker_threads`` of them),
        never on the thread that reads replies or fires timeouts: a callback
        may make blocking RPC calls, send RRefs or wait on other futures.
        One added to a future that is already done runs at once on the
        calling thread.  Graceful ``shutdown`` waits for running callbacks;
        exceptions they raise are logged.

        Raises:
            TypeError: ``fn`` is not callable.

        Example::

            fut = rpc.rpc_async("ps", "get_weights")
            fut.add_done_callback(lambda f: rpc.rpc_sync("ps", "ack", args=(len(f.result()),)))
        """
        if not callable(fn):
            raise TypeError(f"add_done_callback needs a callable, got {type(fn).__name__}")
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        self._run_callback(fn)

    def then(self, callback: Callable[["Future"], Any]) -> "Future":
        """A new future that completes with ``callback(self)`` once this one has completed.

        As ``torch.futures.Future.then``: ``callback`` gets this (completed)
        future and runs whether it succeeded or failed, so it may call
        :meth:`wait`, :meth:`result` or :meth:`value`, which raise its
        exception.  The returned future completes with what ``callback``
        returns, or fails with what it raises.  A future that ``callback``
        returns is the value as it is (not waited for), as in torch.

        ``callback`` runs like a done-callback (see :meth:`add_done_callback`):
        on the agent's callback threads, in the order callbacks were added to
        this future, at once on the calling thread if this future is already
        done, and waited for by graceful ``shutdown``.  Chained futures' own
        callbacks run on the callback threads too.

        The new future has a deadline: this one's, plus the longer of the
        call's timeout and ``rpc_timeout`` for ``callback`` to run.  A
        :meth:`wait` without a timeout ends there with ``CollectiveTimeout``
        naming ``callback`` if it (or a callback queued before it) has not
        returned; the future stays pending.

        Args:
            callback: called with this future as its only argument.

        Returns:
            A new :class:`Future` for ``callback``'s outcome.

        Raises:
            TypeError: ``callback`` is not callable.

        Example::

            fut = rpc.rpc_async("ps", "get_weights")
            small = fut.then(lambda f: len(f.wait())).then(lambda f: f.wait() < 10)
            print(small.wait())
        """
        if not callable(callback):
            raise TypeError(f"then needs a callable, got {type(callback).__name__}")
        name = getattr(callback, "__qualname__", type(callback).__name__)
        child = Future(f"{self._desc} .then({name})", rank=self._rank, peer=self._peer)
        # The child's callbacks go to the same pool: running them inline here
        # would nest one call frame per link of a long chain.
        child._runner = self._runner
        child._follows = name
        if self._deadline is not None and self._link_s is not None:
            # A callback that never returns must not make a wait on the chain hang.
            child._deadline = self._deadline + self._link_s
            child._link_s = self._link_s

        def chain(parent: "Future") -> None:
            try:
                value = callback(parent)
            except BaseException as exc:
                child._complete(exc=exc)
                if not isinstance(exc, Exception):
                    raise  # KeyboardInterrupt, SystemExit: the child has it, the thread too
                return
            child._complete(value)

        self.add_done_callback(chain)
        return child

    def _run_callback(self, fn: Callable[["Future"], None]) -> None:
        try:
            fn(self)
        except Exception:
            _log.exception("exception in a done-callback of %s", self._desc)

    def _complete(self, value: Any = None, exc: Optional[BaseException] = None) -> bool:
        """Set the outcome; the first completion wins.  Returns whether this one did."""
        with self._lock:
            if self._event.is_set():
                return False
            self._value = value
            self._exc = exc
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        if callbacks:
            if self._runner is not None:
                self._runner(lambda: self._run_callbacks(callbacks))
            else:
                self._run_callbacks(callbacks)
        return True

    def _run_callbacks(self, callbacks: List[Callable[["Future"], None]]) -> None:
        # After a SystemExit or KeyboardInterrupt the others still run: else
        # the futures their then() returned would never complete.
        first: Optional[BaseException] = None
        for fn in callbacks:
            try:
                self._run_callback(fn)
            except BaseException as exc:
                if first is None:
                    first = exc
        if first is not None:
            raise first
