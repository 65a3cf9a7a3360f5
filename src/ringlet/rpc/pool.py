"""The worker pool: a fixed set of daemon threads running requests in arrival order."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

from .current import _tls

_log = logging.getLogger("ringlet.rpc")


class _Pool:
    """A fixed pool of daemon threads running submitted callables in order of arrival."""

    def __init__(self, n: int, name: str, agent: Any) -> None:
        self._q: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._agent = agent
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
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
            for _ in self._threads:
                self._q.put(None)
        deadline = time.monotonic() + join_timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
