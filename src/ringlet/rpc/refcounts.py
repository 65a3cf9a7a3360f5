"""RRef reference counts: counting RRefs in and out of frames, and batched releases.

See docs/rpc.md, "RRefs": an RRef sent to another worker is counted with
the owner before the frame leaves; a dropped one is released by the
release thread.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ringlet.errors import ProtocolError, RingletError

from .._wire import codec as ser
from .current import _tls
from .protocol import EXT_RREF, K_RREF_DEC, K_RREF_INC, _is_int
from .rref import RRef, RRefKey
from .transport import POLL_INTERVAL, Stopped

_log = logging.getLogger("ringlet.rpc")


class _RefCounts:
    """Agent's reference counting (needs the attributes ``Agent.__init__`` sets)."""

    def new_rref_key(self) -> RRefKey:
        return (self.rank, next(self._rref_seq))

    def _ext_encoder(self, transferred: List[Tuple[int, RRefKey]], deadline: float) -> Callable[[Any], Any]:
        def enc(obj: Any) -> Optional[Tuple[int, Any]]:
            if not isinstance(obj, RRef):
                return None
            if obj._agent is not self:
                raise TypeError("an RRef of another RPC agent cannot be sent from this worker")
            self._add_count(obj._owner, obj._key, deadline)
            transferred.append((obj._owner, obj._key))
            return EXT_RREF, [obj._owner, obj._key[0], obj._key[1]]

        return enc

    def _add_count(self, owner: int, key: RRefKey, deadline: float) -> None:
        """Create one more count at the owner; returns only once the owner has it."""
        if owner == self.rank:
            try:
                self.owned.incref(key)
            except KeyError:
                raise RingletError(f"RRef {key} is no longer held by its owner {self.name!r}") from None
            return
        fut = self._call(K_RREF_INC, owner, [[key[0], key[1]]], max(1e-3, deadline - time.monotonic()),
                         f"RRef reference count increment on {self._label(owner)}")
        fut.result()

    def _release_transferred(self, transferred: List[Tuple[int, RRefKey]]) -> None:
        for owner, key in transferred:
            self.release(owner, key)

    def _ext_decode(self, code: int, value: Any) -> Any:
        if code != EXT_RREF or type(value) is not list or len(value) != 3 or not all(map(_is_int, value)):
            raise ProtocolError(f"malformed extension value (code {code})")
        owner, c, s = value
        if not 0 <= owner < self.world_size:
            raise ProtocolError(f"RRef owner rank {owner} out of range")
        return RRef(_agent=self, _owner=owner, _key=(c, s))

    def clone_rref(self, rref: RRef) -> RRef:
        self._add_count(rref._owner, rref._key, time.monotonic() + self.rpc_timeout)
        return RRef(_agent=self, _owner=rref._owner, _key=rref._key)

    def release(self, owner: int, key: RRefKey) -> None:
        """Drop one count of ``key`` at ``owner`` (called from ``RRef.__del__``: must not block)."""
        if not self.closed:
            self._release_q.put((owner, key))

    def _release_loop(self) -> None:
        _tls.agent = self
        while True:
            try:
                item = self._release_q.get(timeout=POLL_INTERVAL)
            except queue.Empty:
                if self.stop.is_set():
                    return
                continue
            if item is None:
                return
            batch = [item]
            while len(batch) < 4096:
                try:
                    nxt = self._release_q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._release_q.put(None)
                    break
                batch.append(nxt)
            by_owner: Dict[int, List[list]] = {}
            for owner, key in batch:
                if owner == self.rank:
                    self.owned.decref(key)
                else:
                    by_owner.setdefault(owner, []).append([key[0], key[1]])
            for owner, keys in by_owner.items():
                try:
                    deadline = time.monotonic() + self.rpc_timeout
                    conn = self._conn_to(owner, deadline)
                    conn.send_frame(K_RREF_DEC, 0, ser.encode(keys, limits=self._peer_limits[owner]),
                                    deadline=deadline)
                except (RingletError, OSError, Stopped) as e:
                    _log.debug("rpc: could not release %d RRef(s) on %s: %s", len(keys), self._label(owner), e)
