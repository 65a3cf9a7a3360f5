"""The worker pool: daemon threads running submitted jobs in arrival order."""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterator, List, Optional

from .current import _tls

_log = logging.getLogger("ringlet.rpc")


class _Pool:
    """``n`` daemon threads running submitted callables in order of arrival.

    A job that waits for jobs queued behind it gets one more thread for as
    long as it waits with :meth:`one_more_thread`.
    """

    def __init__(self, n: int, name: str, agent: Any) -> None:
        self._q: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._agent = agent
        self._name = name
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._threads: List[threading.Thread] = []  # every thread started; those stopped stay
        for _ in range(n):
            self._start_thread()

    def _start_thread(self) -> None:
        t = threading.Thread(target=self._run, name=f"{self._name}-{next(self._ids)}", daemon=True)
        self._threads.append(t)
        t.start()

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue ``job``; False (and not queued) once the pool is closed."""
        with self._lock:
            if self._closed:
                return False
            self._q.put(job)
            return True

    def owns(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` is one of this pool's threads."""
        return thread in self._threads

    @contextlib.contextmanager
    def one_more_thread(self) -> Iterator[None]:
        """While the block runs, the pool has one thread more.

        For a job that waits for jobs queued behind it, which with one thread
        would never run.  On leaving, one thread (whichever is idle first)
        stops; a closed pool gets none.
        """
        with self._lock:
            added = not self._closed
            if added:
                self._start_thread()
        try:
            yield
        finally:
            with self._lock:
                if added and not self._closed:
                    self._q.put(None)

    def _run(self) -> None:
        _tls.agent = self._agent
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job()
            except BaseException:  # a job must never take a pool thread down
                _log.exception("rpc: internal error in a worker job")
            # Drop the finished job now: an idle thread must not keep its
            # arguments (e.g. RRefs) alive until the next job arrives.
            job = None

    def close(self, join_timeout: float) -> None:
        """Let the queued jobs finish, then stop the threads (joined up to ``join_timeout``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:  # one too many after one_more_thread: harmless
                self._q.put(None)
        deadline = time.monotonic() + join_timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
