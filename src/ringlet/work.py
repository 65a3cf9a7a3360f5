"""Asynchronous operations: ``Work`` handles and the per-group executors that run them.

Async collectives of one group run in issue order on that group's progress
thread.  The C call inside releases the GIL, so Python (backward passes,
data loading) keeps running while bytes move.  A ``Work`` holds references to
every array its operation touches until the operation has finished, so a
buffer can never be freed while C still writes into it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Optional

from ._timeout import seconds
from .errors import CollectiveTimeout

__all__ = ["Work"]


_log = logging.getLogger("ringlet")

# Guards the callback lists of every Work (callbacks are rare: one lock serves all).
_CALLBACKS = threading.Lock()


class Work:
    """Handle of an asynchronous operation (``async_op=True``, ``isend``, ``irecv``).

    Example::

        work = ringlet.all_reduce(grad, async_op=True)
        ...  # compute something else
        work.wait()  # raises the operation's error, if any
    """

    __slots__ = ("_done", "_fin", "_exc", "_result", "_keep", "_op", "_callbacks")

    def __init__(self, op: str, keep: tuple = ()) -> None:
        # Held from here until the operation finishes; a waiter blocks on it.
        # A bare lock: an Event costs several times more to make and to wait
        # on, a measurable share of a small asynchronous operation.
        self._done = threading.Lock()
        self._done.acquire()
        self._fin = False
        self._exc: Optional[BaseException] = None
        self._result: Any = None
        self._keep = keep  # arrays the C call uses; released once done
        self._op = op
        self._callbacks: Optional[list] = None

    def _finish(self, result: Any = None, exc: Optional[BaseException] = None) -> None:
        self._result = result
        self._exc = exc
        self._keep = ()
        with _CALLBACKS:
            self._fin = True
            callbacks, self._callbacks = self._callbacks, None
        self._done.release()
        if callbacks:
            for cb in callbacks:
                try:
                    cb(self)
                except Exception:  # noqa: BLE001 - must not end the progress thread
                    _log.exception("ringlet: a callback of %s work raised", self._op)

    def _add_done_callback(self, fn: Callable[["Work"], None]) -> None:
        """Run ``fn(self)`` once the operation finished (at once if it has): the torch
        adapter completes torch futures this way, without a thread per operation."""
        with _CALLBACKS:
            if not self._fin:
                if self._callbacks is None:
                    self._callbacks = []
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
        if not self._fin:
            if not self._done.acquire(True, -1 if timeout is None else timeout):
                raise CollectiveTimeout(f"Work.wait: {self._op} not finished after {timeout}s "
                                        f"(the operation continues in the background)",
                                        op=self._op, waited=timeout)
            self._done.release()  # for the next waiter
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not."""
        return self._fin

    def exception(self) -> Optional[BaseException]:
        """The operation's error once finished (None on success or while running)."""
        return self._exc

    def result(self) -> Any:
        """Wait, then return the operation's value (used by object collectives)."""
        self.wait()
        return self._result

    def __repr__(self) -> str:
        state = "failed" if self._exc else ("done" if self._fin else "pending")
        return f"<ringlet.Work {self._op} {state}>"


def _execute(fn: Callable[[], Any], work: Work) -> None:
    """Run ``fn`` and finish ``work`` with its result or its error."""
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the waiter
        work._finish(exc=exc)
    else:
        work._finish(result)


class SerialExecutor:
    """Runs submitted calls one at a time, in order, on one daemon thread.

    The thread is started on first use and exits after it has been idle for a
    while, so idle groups cost no thread.
    """

    _IDLE_EXIT = 5.0

    def __init__(self, name: str) -> None:
        self._name = name
        # The hand-off itself: a C queue whose get() waits without the GIL.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # _busy, _thread, _closed
        self._idle = threading.Condition(self._lock)  # drain() waits on it
        self._thread: Optional[threading.Thread] = None
        self._busy = 0  # queued + running
        self._closed = False

    def submit(self, fn: Callable[[], Any], work: Work) -> Work:
        if self._thread is threading.current_thread():
            # Issued by a done-callback of this executor's own job (a torch
            # future's .then(), as PowerSGD's hook): queued behind the callback
            # it would never start.  It runs here, next in issue order, which
            # is also where a rank whose job finished first runs the callback.
            _execute(fn, work)
            return work
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: executor is shut down")
            self._busy += 1
            self._queue.put((fn, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        return work

    def _run(self) -> None:
        q = self._queue
        while True:
            try:
                fn, work = q.get(True, self._IDLE_EXIT)
            except queue.Empty:
                fn = work = None
            if fn is None:  # idle for a while, or close()'s wake-up
                with self._lock:
                    # Under the lock a submit has either queued already or
                    # will start a new thread.
                    if q.empty():
                        self._thread = None
                        return
                continue
            try:
                _execute(fn, work)
            finally:
                # Drop our references now: an idle worker must not keep the last
                # closure (and the buffers it captured) alive until the next item.
                fn = work = None
                with self._lock:
                    self._busy -= 1
                    if not self._busy:
                        self._idle.notify_all()

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until everything submitted so far has run."""
        with self._lock:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._thread is not None:
                self._queue.put((None, None))  # wakes the worker; it leaves once drained
