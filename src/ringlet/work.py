"""Asynchronous operations: ``Work`` handles and the per-group executors that run them.

Async collectives of one group run in issue order on that group's progress
thread.  The C call inside releases the GIL, so Python (backward passes,
data loading) keeps running while bytes move.  A ``Work`` holds references to
every array its operation touches until the operation has finished, so a
buffer can never be freed while C still writes into it.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Optional

from ._timeout import seconds
from .errors import CollectiveTimeout

__all__ = ["Work"]


class Work:
    """Handle of an asynchronous operation (``async_op=True``, ``isend``, ``irecv``).

    Example::

        work = ringlet.all_reduce(grad, async_op=True)
        ...  # compute something else
        work.wait()  # raises the operation's error, if any
    """

    __slots__ = ("_event", "_exc", "_result", "_keep", "_op", "_callbacks", "_lock")

    def __init__(self, op: str, keep: tuple = ()) -> None:
        self._event = threading.Event()
        self._exc: Optional[BaseException] = None
        self._result: Any = None
        self._keep = keep  # arrays the C call uses; released once done
        self._op = op
        self._callbacks: list = []
        self._lock = threading.Lock()

    def _finish(self, result: Any = None, exc: Optional[BaseException] = None) -> None:
        with self._lock:
            self._result = result
            self._exc = exc
            self._keep = ()
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def _add_done_callback(self, fn: Callable[["Work"], None]) -> None:
        """Run ``fn(self)`` once the operation finished (at once if it has): the torch
        adapter completes torch futures this way, without a thread per operation."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the operation finished; re-raise its error.

        Args:
            timeout: seconds to wait (None: until the operation's own deadline,
                which every operation has; 0 polls; huge values and inf are
                capped at ``ringlet.MAX_TIMEOUT``).
        Returns:
            True.
        Raises:
            ValueError: ``timeout`` is negative or NaN.
            CollectiveTimeout: ``timeout`` passed first (the operation goes on).
            RingletError: whatever the operation failed with.
        """
        if timeout is not None:
            timeout = seconds(timeout, zero=True)
        if not self._event.wait(timeout):
            raise CollectiveTimeout(f"Work.wait: {self._op} not finished after {timeout}s "
                                    f"(the operation continues in the background)",
                                    op=self._op, waited=timeout)
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not."""
        return self._event.is_set()

    def exception(self) -> Optional[BaseException]:
        """The operation's error once finished (None on success or while running)."""
        return self._exc

    def result(self) -> Any:
        """Wait, then return the operation's value (used by object collectives)."""
        self.wait()
        return self._result

    def __repr__(self) -> str:
        state = "failed" if self._exc else ("done" if self._event.is_set() else "pending")
        return f"<ringlet.Work {self._op} {state}>"


class SerialExecutor:
    """Runs submitted calls one at a time, in order, on one daemon thread.

    The thread is started on first use and exits after it has been idle for a
    while, so idle groups cost no thread.
    """

    _IDLE_EXIT = 5.0

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._busy = 0  # queued + running
        self._closed = False

    def submit(self, fn: Callable[[], Any], work: Work) -> Work:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._name}: executor is shut down")
            self._queue.append((fn, work))
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return work

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closed or not self._cond.wait(self._IDLE_EXIT):
                        if not self._queue:
                            self._thread = None
                            return
                fn, work = self._queue.popleft()
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                work._finish(exc=exc)
            else:
                work._finish(result)
            finally:
                # Drop our references now: an idle worker must not keep the last
                # closure (and the buffers it captured) alive until the next item.
                fn = work = result = None
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until everything submitted so far has run."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
