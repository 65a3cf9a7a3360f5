"""Call deadlines: one timer thread fails each pending call at its deadline.
"""

from __future__ import annotations

import heapq
import time
from typing import List

from ringlet.errors import CollectiveTimeout

from .transport import POLL_INTERVAL



class _Timers:
    """Agent's timer thread (needs ``_heap``, ``_tcond``, ``_pending``, ``_complete``)."""

    def _timer_loop(self) -> None:
        while not self.stop.is_set():
            expired: List[int] = []
            with self._tcond:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    expired.append(heapq.heappop(self._heap)[1])
                if not expired:
                    if len(self._heap) > 1024 and len(self._heap) > 4 * len(self._pending):
                        # Entries of completed calls are removed lazily; compact now and then.
                        self._heap = [e for e in self._heap if e[1] in self._pending]
                        heapq.heapify(self._heap)
                    wait = self._heap[0][0] - now if self._heap else POLL_INTERVAL
                    self._tcond.wait(min(wait, POLL_INTERVAL))
                    continue
            for rid in expired:
                with self._plock:
                    p = self._pending.get(rid)
                if p is not None:
                    self._complete(rid, exc=CollectiveTimeout(
                        f"{p.desc} timed out after {p.timeout:.3g} s", rank=self.rank, peer=p.dst,
                        op="rpc", waited=p.timeout))
