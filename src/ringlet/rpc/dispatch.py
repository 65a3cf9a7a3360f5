"""Requests to work: decode a request, run it on the worker pool, send the reply.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, List, Optional, Tuple

from ringlet.errors import ProtocolError, RingletError

from .._wire import codec as ser
from . import registry
from .protocol import (K_CALL, K_ERROR, K_REMOTE, K_RESULT, K_RREF_CALL, K_RREF_DEC, K_RREF_FETCH,
                       K_RREF_INC, _BadRequest, _exc_info, _is_int)
from .rref import RRefKey
from .transport import Connection, Stopped

_log = logging.getLogger("ringlet.rpc")


class _Dispatch:
    """Agent's request handlers (needs the attributes ``Agent.__init__`` sets)."""

    def _dispatch(self, conn: Connection, header: ser.Header, value: Any) -> None:
        kind, rid = header.kind, header.req_id
        if kind == K_RREF_DEC:
            for c, s in self._keys(value):
                self.owned.decref((c, s))
            return
        if kind not in (K_CALL, K_REMOTE, K_RREF_FETCH, K_RREF_CALL, K_RREF_INC):
            raise ProtocolError(f"unexpected frame kind {kind} on a request connection")
        try:
            if kind == K_CALL:
                self._on_call(conn, rid, value)
            elif kind == K_REMOTE:
                self._on_remote(conn, rid, value)
            elif kind == K_RREF_FETCH:
                self._on_fetch(conn, rid, value)
            elif kind == K_RREF_CALL:
                self._on_rref_call(conn, rid, value)
            else:
                for c, s in self._keys(value):
                    try:
                        self.owned.incref((c, s))
                    except KeyError:
                        raise _BadRequest(f"RRef {(c, s)} is not (or no longer) held by worker {self.name!r}") \
                            from None
                self._reply(conn, rid, value=None, fn="RRef")
        except _BadRequest as e:
            self._reply(conn, rid, error=("ValueError", str(e), ""), fn="rpc")

    @staticmethod
    def _keys(value: Any) -> List[Tuple[int, int]]:
        if type(value) is not list or not all(type(k) is list and len(k) == 2 and all(map(_is_int, k))
                                              for k in value):
            raise ProtocolError("malformed RRef key list")
        return [(k[0], k[1]) for k in value]

    @staticmethod
    def _call_parts(name: Any, args: Any, kwargs: Any) -> Tuple[str, tuple, dict]:
        if type(name) is not str:
            raise _BadRequest("function name must be a str")
        if type(args) not in (tuple, list):
            raise _BadRequest("args must be a tuple")
        if type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
            raise _BadRequest("kwargs must be a dict with str keys")
        return name, tuple(args), kwargs

    def _lookup(self, name: str) -> Callable[..., Any]:
        fn = registry.lookup(name)
        if fn is None:
            raise _BadRequest(f"no function registered as {name!r} on worker {self.name!r} "
                              "(only functions passed to ringlet.rpc.register can be called)")
        return fn

    def _on_call(self, conn: Connection, rid: int, value: Any) -> None:
        if type(value) is not list or len(value) != 3:
            raise _BadRequest("malformed call request")
        name, args, kwargs = self._call_parts(*value)
        fn = self._lookup(name)

        def job() -> None:
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # reported to the caller; the worker thread lives on
                self._reply(conn, rid, error=_exc_info(e), fn=name)
                return
            self._reply(conn, rid, value=result, fn=name)

        assert self._pool is not None
        self._pool.submit(job)

    def _on_remote(self, conn: Connection, rid: int, value: Any) -> None:
        if type(value) is not list or len(value) != 6 or not _is_int(value[0]) or not _is_int(value[1]) \
                or type(value[5]) is not bool:
            raise _BadRequest("malformed remote request")
        key = (value[0], value[1])
        name, args, kwargs = self._call_parts(value[2], value[3], value[4])
        if key[0] != conn.peer_rank or (value[5] and conn.peer_rank != self.rank):
            raise _BadRequest(f"RRef id {key} was not created by the calling worker")
        if not value[5]:
            # Created here, on the reader thread, so that a release arriving
            # later on this connection always finds the entry.
            try:
                self.owned.create(key, name)
            except RingletError as e:
                raise _BadRequest(str(e)) from None
        try:
            fn = self._lookup(name)
        except _BadRequest as e:
            self.owned.set_result(key, error=("ValueError", str(e), ""))
            raise

        def job() -> None:
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                info = _exc_info(e)
                self.owned.set_result(key, error=info)
                self._reply(conn, rid, error=info, fn=name)
                return
            self.owned.set_result(key, value=result)
            self._reply(conn, rid, value=None, fn=name)

        assert self._pool is not None
        self._pool.submit(job)

    def _when_ready(self, key: RRefKey, job: Callable[[Any], None]) -> None:
        # The request holds a count until it is answered: the caller may drop
        # its RRef right after sending it (a temporary), and that release, read
        # next on this connection, must not free the value this request uses.
        def run(entry: Any) -> None:
            try:
                job(entry)
            finally:
                self.owned.decref(key)

        try:
            self.owned.incref(key)
            self.owned.when_ready(key, lambda entry: self._pool.submit(lambda: run(entry)))  # type: ignore[union-attr]
        except KeyError:
            raise _BadRequest(f"RRef {key} is not (or no longer) held by worker {self.name!r}") from None

    def _on_fetch(self, conn: Connection, rid: int, value: Any) -> None:
        if type(value) is not list or len(value) != 2 or not all(map(_is_int, value)):
            raise _BadRequest("malformed RRef fetch request")

        def job(entry: Any) -> None:
            if entry.error is not None:
                self._reply(conn, rid, error=entry.error, fn=entry.function)
            else:
                self._reply(conn, rid, value=entry.value, fn=f"RRef.to_here ({entry.function})")

        self._when_ready((value[0], value[1]), job)

    def _on_rref_call(self, conn: Connection, rid: int, value: Any) -> None:
        if type(value) is not list or len(value) != 5 or not _is_int(value[0]) or not _is_int(value[1]):
            raise _BadRequest("malformed RRef method call")
        method, args, kwargs = self._call_parts(value[2], value[3], value[4])
        if not method.isidentifier() or method.startswith("_"):
            # The safety rule: only public methods; dunder/private names would
            # expose the object's internals (and, through them, everything).
            raise _BadRequest(f"refusing to call method {method!r} on an RRef value: only public "
                              "methods (names not starting with '_') can be called")

        def job(entry: Any) -> None:
            label = f"{type(entry.value).__name__}.{method}"
            if entry.error is not None:
                self._reply(conn, rid, error=entry.error, fn=entry.function)
                return
            try:
                m = getattr(entry.value, method)
                if not callable(m):
                    raise TypeError(f"attribute {method!r} of {type(entry.value).__name__} is not callable")
                result = m(*args, **kwargs)
            except BaseException as e:
                self._reply(conn, rid, error=_exc_info(e), fn=label)
                return
            self._reply(conn, rid, value=result, fn=label)

        self._when_ready((value[0], value[1]), job)

    def _encode_error(self, error: Tuple[str, str, str], fn: str, peer: int) -> ser.Encoded:
        """The ERROR reply's value, cut to the caller's ``max_frame_bytes``.

        A larger frame makes the caller drop the connection (failing every
        call on it with ProtocolError) instead of raising RemoteError.  The
        traceback's head goes first (its last lines show the raise), then
        the message's tail; each character cut is at least one byte.
        """
        t, msg, tb = error
        enc = ser.encode([t, msg, tb, fn])
        over = enc.payload_len - self._peer_limits[peer].max_frame_bytes
        if over > 0:
            cut = min(over, len(tb))
            tb, over = tb[cut:], over - cut
            msg = msg[: max(0, len(msg) - over)]
            enc = ser.encode([t, msg, tb, fn])
        return enc

    def _reply(self, conn: Connection, rid: int, *, value: Any = None, error: Optional[Tuple[str, str, str]] = None,
               fn: str) -> None:
        """Send the one reply a request gets (RESULT or ERROR), and count it as handled."""
        peer = conn.peer_rank
        transferred: List[Tuple[int, RRefKey]] = []
        deadline = time.monotonic() + self.rpc_timeout
        try:
            if error is None:
                try:
                    enc = ser.encode(value, limits=self._peer_limits[peer], allow_pickle=self._pickle_with(peer),
                                     ext_encode=self._ext_encoder(transferred, deadline), what=f"result of {fn!r}")
                    kind = K_RESULT
                except Exception as e:  # noqa: BLE001 - any failure becomes the one reply
                    self._release_transferred(transferred)
                    transferred = []
                    error = (type(e).__name__, f"the result cannot be sent back: "
                             f"{_exc_info(e)[1]}", "")
            if error is not None:
                enc = self._encode_error(error, fn, peer)
                kind = K_ERROR
            try:
                conn.send_frame(kind, rid, enc, deadline=deadline)
            except (RingletError, Stopped, OSError) as e:
                self._release_transferred(transferred)
                _log.debug("rpc: reply to %s lost: %s", self._label(peer), e)
        finally:
            with self._plock:
                self._n_handled += 1
                if 0 <= peer < self.world_size:
                    self._handled_from[peer] += 1
                self._pcond.notify_all()
