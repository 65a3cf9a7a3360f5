"""The store server: one selector thread serving every client.

One daemon thread runs a ``selectors`` loop over the listener and every
connection, with no thread per client.  The handshake is run by the same loop
as a small state machine over non-blocking sockets (the protocol steps are
shared with the blocking handshake in ``_auth``), so a client that connects
and then stalls costs one idle socket, never a blocked thread, and is dropped
at its handshake deadline (``handshake_timeout``, 5 s by default).  At most
``max_handshakes`` connections may be unauthenticated at once: a new one
evicts the oldest (preferring those that have not sent a well-formed hello),
and so does running out of descriptors, so a flood of idle or slow
connections can neither block nor delay genuine clients (which retry a
handshake the server dropped).  Warnings about refused connections are
rate-limited (docs/security.md, "The rendezvous store").  Blocking
``get``/``wait`` requests are parked in the loop and answered when the keys
are set, or with TIMEOUT at their deadline.

The server checks each request header before reading (or allocating for) the
body: an unknown op, an oversized length or a malformed body closes that
client's connection and counts it in ``StoreServer.rejected``; every other
client keeps being served.  A client that sends requests without reading the
replies is not read from while it has more than 4 MiB (or 4096 pieces) of
replies unsent, so what it costs the server stays bounded and its own TCP
window stalls it, never the loop.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import resource
import secrets
import selectors
import socket
import threading
import time
from typing import Deque, Dict, List, Optional, Set, Tuple, Union

from .. import _auth
from .._timeout import seconds
from ..errors import AuthenticationError
from .protocol import (I64 as _I64, MAX_KEY_BYTES, MAX_REQUEST as _MAX_REQUEST,
                       MAX_TIMEOUT_MS as _MAX_TIMEOUT_MS, MAX_VALUE_BYTES, OP_ADD, OP_CHECK,
                       OP_DELETE, OP_GET, OP_INFO, OP_NAMES as _OP_NAMES, OP_SET, OP_WAIT,
                       OP_WILL,
                       PURPOSE as _PURPOSE, RECV_CHUNK as _RECV_CHUNK, REQ as _REQ,
                       RESP as _RESP, ST_ERROR, ST_OK, ST_TIMEOUT,
                       decode_keys as _decode_keys, encode_keys as _encode_keys,
                       fmt_addr as _fmt_addr)

__all__ = ["StoreServer"]

_log = logging.getLogger("ringlet.store")

_HS_IN_CAP = _auth.HELLO_LEN + _auth.PROOF_LEN  # a client sends nothing else before READY
_MAX_HANDSHAKES = 512  # unauthenticated connections held at once (oldest evicted beyond)
_ACCEPT_BATCH = 64  # accepts per loop turn, so a flood cannot starve served clients
_ACCEPT_PAUSE = 0.1  # s the listener rests when out of descriptors with nothing to evict
_NO_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# A value at least this large, once its key is in, is received straight into
# a buffer of its own, which the store then keeps: it is never copied.
_BODY_MIN = 1 << 16
# Unsent replies one connection may hold before the server stops reading its
# requests (backpressure: its own TCP window then stalls it, nobody else); it
# reads again once they drain below half.  A Store client, one request at a
# time, never comes near; pieces are counted too, as a tiny reply costs ~200
# bytes of Python objects.
_OUT_MAX_BYTES = 4 << 20
_OUT_MAX_PARTS = 4096

# A stored value: bytes, or the bytearray a large one was received into
# (never resized or written once stored).
Value = Union[bytes, bytearray]


_HELLO, _PROOF, _READY = 0, 1, 2


_MAX_SELECT_S = 3600.0


def _default_max_handshakes() -> int:
    # The store lives in rank 0, beside the job's own sockets and files.
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return _MAX_HANDSHAKES
    return max(16, min(_MAX_HANDSHAKES, soft // 8))


class _Conn:
    """One client connection as the selector loop sees it."""

    __slots__ = ("sock", "addr", "state", "inbuf", "out", "out_bytes", "paused", "deadline",
                 "claim", "nonce_c", "nonce_s", "parked", "closing", "open", "events", "will",
                 "body")

    def __init__(self, sock: socket.socket, addr, deadline: float) -> None:
        self.sock = sock
        self.addr = addr
        self.state = _HELLO
        self.inbuf = bytearray()
        self.out: Deque[memoryview] = collections.deque()
        self.out_bytes = 0  # unsent bytes in `out`
        self.paused = False  # too much unsent: requests are neither read nor run
        self.deadline = deadline
        self.claim = b""
        self.nonce_c = b""
        self.nonce_s = b""
        self.parked: Optional[_Waiter] = None
        self.closing = False  # close once `out` is flushed
        self.open = True
        self.events = selectors.EVENT_READ
        self.will: Optional[Tuple[bytes, Value]] = None  # (key, value) set when it closes
        self.body: Optional[_Body] = None  # a large value being received


class _Body:
    """A request whose large value is being received into ``value``."""

    __slots__ = ("op", "key", "tmo", "value", "got")

    def __init__(self, op: int, key: bytes, tmo: int, value: bytearray, got: int) -> None:
        self.op = op
        self.key = key
        self.tmo = tmo
        self.value = value
        self.got = got


class _Waiter:
    """A parked GET or WAIT request."""

    __slots__ = ("conn", "op", "keys", "missing", "deadline", "done")

    def __init__(self, conn: _Conn, op: int, keys: List[bytes], missing: Set[bytes],
                 deadline: float) -> None:
        self.conn = conn
        self.op = op
        self.keys = keys
        self.missing = missing
        self.deadline = deadline
        self.done = False


class _Reject(Exception):
    """A client broke the protocol; its connection is closed and counted."""


class StoreServer:
    """The rendezvous store server (one background thread, any number of clients).

    Args:
        host: address to bind (IPv4 or IPv6 literal or hostname; "0.0.0.0"
            or "::" for all interfaces).
        port: TCP port; 0 lets the OS pick a free one (read it from ``.port``),
            which avoids the "find a free port, then bind" race.
        secret: the job secret clients must prove (non-empty bytes).
        job_id: identifier handed to every client (16 random bytes if None).
        handshake_timeout: seconds a new connection gets to authenticate.
        max_handshakes: unauthenticated connections held at once; beyond it
            the oldest is dropped to make room (genuine clients retry).  None:
            512, and at most an eighth of this process's descriptor limit, so a
            flood cannot take the descriptors the job itself needs.
    Attributes:
        host, port: where it listens.  job_id: bytes.
        rejected: connections refused so far (failed, stalled or evicted
            handshakes, garbage, malformed or oversized requests).
    Raises:
        OSError: the address cannot be bound (e.g. the port is taken).
        TypeError, ValueError: bad arguments.

    Example::

        with StoreServer(secret=key) as server:
            store = Store("127.0.0.1", server.port, secret=key)
            store.set("hello", b"world")
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes,
                 job_id: Optional[bytes] = None, handshake_timeout: float = 5.0,
                 max_handshakes: Optional[int] = None) -> None:
        if not isinstance(host, str) or not host:
            raise TypeError(f"host must be a non-empty str, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
        if not isinstance(secret, (bytes, bytearray)) or not secret:
            raise TypeError("secret must be non-empty bytes")
        if job_id is None:
            job_id = secrets.token_bytes(16)
        if not isinstance(job_id, (bytes, bytearray)) or not 1 <= len(job_id) <= 64:
            raise ValueError("job_id must be 1..64 bytes")
        handshake_timeout = seconds(handshake_timeout, "handshake_timeout")  # NaN refused
        if handshake_timeout > 600:  # a window, not a deadline: inf would keep stalled peers
            raise ValueError(f"handshake_timeout must be at most 600 s, got {handshake_timeout!r}")
        if max_handshakes is None:
            max_handshakes = _default_max_handshakes()
        if isinstance(max_handshakes, bool) or not isinstance(max_handshakes, int) \
                or max_handshakes < 1:
            raise ValueError(f"max_handshakes must be a positive int, got {max_handshakes!r}")
        self._secret = bytes(secret)
        self.job_id = bytes(job_id)
        self.rejected = 0
        self._hs_timeout = float(handshake_timeout)
        self._data: Dict[bytes, Value] = {}
        self._waiters: Dict[bytes, Set[_Waiter]] = {}
        self._timers: List[Tuple[float, int, object]] = []  # heap of (deadline, seq, conn|waiter)
        self._seq = itertools.count()
        self._compact_at = 1024
        self._conns: Set[_Conn] = set()
        # Unauthenticated connections, oldest first, for eviction: those still
        # without a well-formed hello (accept order), then those past it (hello
        # order).  Two dicts, so that picking a victim costs O(1) under a flood.
        self._pending_hello: Dict[_Conn, None] = {}
        self._pending_proof: Dict[_Conn, None] = {}
        self._max_handshakes = max_handshakes
        self._accept_paused_until: Optional[float] = None
        self._warn = _auth.LogBudget(_log)
        self._runnable: Deque[_Conn] = collections.deque()
        # Wills of closed connections, set by the loop (not inside _close_conn,
        # which runs in the middle of other requests' bookkeeping).
        self._wills: Deque[Tuple[bytes, Value]] = collections.deque()
        # Every read lands here first (one loop thread): no allocation per read.
        self._rbuf = memoryview(bytearray(_RECV_CHUNK))
        self._close_lock = threading.Lock()
        self._closed = False
        self._stop = False

        infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
        family, stype, proto, _, sockaddr = infos[0]
        self._listener = socket.socket(family, stype, proto)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(sockaddr)
            self._listener.listen(1024)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            raise
        self.host = host
        self.port = self._listener.getsockname()[1]
        owned = [self._listener]
        try:  # out of descriptors (a flood) or threads: nothing stays open, the port freed
            self._wake_r, self._wake_w = socket.socketpair()
            owned += [self._wake_r, self._wake_w]
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._sel = selectors.DefaultSelector()
            owned.append(self._sel)
            self._sel.register(self._listener, selectors.EVENT_READ, "listener")
            self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            self._thread = threading.Thread(target=self._run, name=f"ringlet-store:{self.port}",
                                            daemon=True)
            self._thread.start()
        except BaseException:
            for o in reversed(owned):
                o.close()
            raise

    # ---- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving and close every connection (idempotent; joins the thread)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._teardown()

    def __enter__(self) -> "StoreServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"StoreServer({_fmt_addr(self.host, self.port)}, keys={len(self._data)}, "
                f"clients={len(self._conns)}, rejected={self.rejected})")

    def _teardown(self) -> None:
        for conn in list(self._conns):
            self._close_conn(conn)
        for s in (self._listener, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        try:
            self._sel.close()
        except (OSError, ValueError):
            pass

    # ---- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            timeout = None
            if self._timers:
                timeout = max(0.0, self._timers[0][0] - time.monotonic())
            if self._accept_paused_until is not None:
                left = max(0.0, self._accept_paused_until - time.monotonic())
                timeout = left if timeout is None else min(timeout, left)
            if timeout is not None:
                # epoll takes at most ~24.8 days; a waiter due later just wakes the loop early.
                timeout = min(timeout, _MAX_SELECT_S)
            try:
                events = self._sel.select(timeout)
            except InterruptedError:
                continue
            for key, mask in events:
                if key.data == "listener":
                    self._accept()
                elif key.data == "wake":
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                elif key.data.open:
                    self._guarded(key.data, lambda c, m=mask: self._on_event(c, m))
            if (self._accept_paused_until is not None
                    and time.monotonic() >= self._accept_paused_until):
                self._accept_paused_until = None
                self._sel.register(self._listener, selectors.EVENT_READ, "listener")
            try:
                self._expire(time.monotonic())
            except Exception:  # noqa: BLE001 - a bug here must not end the store
                _log.exception("store: internal error while expiring deadlines")
            while self._runnable or self._wills:
                while self._wills:
                    key, value = self._wills.popleft()
                    if key not in self._data:
                        self._set(key, value)
                if self._runnable:
                    conn = self._runnable.popleft()
                    if conn.open and conn.parked is None:
                        self._guarded(conn, self._process)

    def _on_event(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and conn.open:
            self._on_readable(conn)

    def _guarded(self, conn: _Conn, fn) -> None:
        # No client may stop the loop: a protocol violation or an unexpected
        # error costs that one connection only.
        try:
            fn(conn)
        except _Reject as exc:
            self._reject(conn, str(exc))
        except Exception as exc:  # noqa: BLE001 - keep serving everyone else
            _log.exception("store: internal error serving %s", conn.addr)
            self._reject(conn, f"internal error: {exc!r}")

    def _reject(self, conn: _Conn, why: str) -> None:
        self.rejected += 1
        self._warn.warn("store: dropped connection from %s: %s", conn.addr, why)
        self._close_conn(conn)

    def _evict_oldest(self, why: str) -> bool:
        """Drop the oldest unauthenticated connection, preferring one still
        without a well-formed hello; False when there is none."""
        victim = next(iter(self._pending_hello), None)
        if victim is None:
            victim = next(iter(self._pending_proof), None)
        if victim is None:
            return False
        self.rejected += 1
        self._warn.warn("store: %s; dropped the oldest unauthenticated connection (from %s)",
                        why, victim.addr)
        self._close_conn(victim)
        return True

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while queued
            except OSError as exc:
                if exc.errno in _NO_FDS and self._evict_oldest(f"out of descriptors ({exc})"):
                    continue  # freed a descriptor: take the waiting client now
                if exc.errno in _NO_FDS:
                    # Nothing to evict: stop polling the listener briefly
                    # instead of spinning on a backlog the kernel keeps reporting.
                    self._sel.unregister(self._listener)
                    self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE
                self._warn.warn("store: accept failed: %s", exc)
                return
            try:
                sock.setblocking(False)
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                pending = len(self._pending_hello) + len(self._pending_proof)
                if pending >= self._max_handshakes:
                    self._evict_oldest(f"{pending} handshakes pending")
                conn = _Conn(sock, addr, time.monotonic() + self._hs_timeout)
                self._sel.register(sock, selectors.EVENT_READ, conn)
            except (OSError, ValueError) as exc:
                # A peer that reset at once, or the selector out of room: that
                # one connection goes, the loop serves on.
                sock.close()
                self._warn.warn("store: could not take a connection from %s: %s", addr, exc)
                continue
            self._conns.add(conn)
            self._pending_hello[conn] = None
            heapq.heappush(self._timers, (conn.deadline, next(self._seq), conn))
            # A client sends its hello right after connecting: answer it now,
            # so it leaves the evictable HELLO state at once.
            self._guarded(conn, self._on_readable)

    def _on_readable(self, conn: _Conn) -> None:
        if conn.body is not None:
            self._read_body(conn)
            return
        # Unauthenticated, a client gets no more than the handshake holds, and
        # one byte over to show it sent ahead.
        want = _HS_IN_CAP + 1 - len(conn.inbuf) if conn.state != _READY else _RECV_CHUNK
        try:
            n = conn.sock.recv_into(self._rbuf, want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if conn.state != _READY:
                self._reject(conn, f"connection failed during the handshake: {exc}")
            else:
                self._close_conn(conn)
            return
        if not n:
            if conn.state != _READY:
                self._reject(conn, "closed during the handshake (wrong secret, or not a "
                                   "ringlet client)")
            else:
                self._close_conn(conn)
            return
        conn.inbuf += self._rbuf[:n]
        cap = _HS_IN_CAP if conn.state != _READY else _MAX_REQUEST
        if len(conn.inbuf) > cap:
            self._reject(conn, f"sent {len(conn.inbuf)} bytes without waiting for replies")
            return
        if conn.parked is None:
            self._guarded(conn, self._process)

    def _read_body(self, conn: _Conn) -> None:
        """Receive more of ``conn.body``'s value; run its request once it is whole."""
        body = conn.body
        try:
            n = conn.sock.recv_into(memoryview(body.value)[body.got:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_conn(conn)
            return
        if not n:
            self._close_conn(conn)
            return
        body.got += n
        if body.got == len(body.value):
            conn.body = None
            self._execute(conn, body.op, body.key, body.value, body.tmo)

    def _process(self, conn: _Conn) -> None:
        """Consume whatever complete frames ``conn.inbuf`` holds."""
        while (conn.open and not conn.closing and conn.parked is None and conn.body is None
               and not conn.paused):
            buf = conn.inbuf
            if conn.state == _HELLO:
                if len(buf) < _auth.HELLO_LEN:
                    return
                try:
                    conn.claim, conn.nonce_c = _auth.parse_hello(buf[:_auth.HELLO_LEN])
                except AuthenticationError as exc:
                    raise _Reject(str(exc)) from None
                del buf[:_auth.HELLO_LEN]
                conn.nonce_s, reply = _auth.server_reply(self._secret, _PURPOSE, conn.claim,
                                                         conn.nonce_c)
                conn.state = _PROOF
                self._pending_hello.pop(conn, None)
                self._pending_proof[conn] = None
                self._queue(conn, reply)
            elif conn.state == _PROOF:
                if len(buf) < _auth.PROOF_LEN:
                    return
                proof = bytes(buf[:_auth.PROOF_LEN])
                del buf[:_auth.PROOF_LEN]
                if not _auth.verify_client_proof(self._secret, _PURPOSE, conn.claim,
                                                 conn.nonce_c, conn.nonce_s, proof):
                    self.rejected += 1
                    self._warn.warn("store: connection from %s failed authentication", conn.addr)
                    self._queue(conn, _auth.status_frame(_auth.STATUS_BAD_MAC))
                    conn.closing = True
                    if not conn.out:
                        self._close_conn(conn)
                    return
                conn.state = _READY
                self._pending_proof.pop(conn, None)
                self._queue(conn, _auth.status_frame(_auth.STATUS_OK))
            else:
                if len(buf) < _REQ.size:
                    return
                op, klen, vlen, tmo = _REQ.unpack_from(buf, 0)
                if op not in _OP_NAMES:
                    raise _Reject(f"unknown op {op}")
                if klen > MAX_KEY_BYTES or vlen > MAX_VALUE_BYTES:
                    raise _Reject(f"oversized request (key {klen} bytes, value {vlen} bytes; "
                                  f"limits {MAX_KEY_BYTES} and {MAX_VALUE_BYTES})")
                start = _REQ.size + klen
                need = start + vlen
                if len(buf) < need:
                    if vlen >= _BODY_MIN and len(buf) >= start:
                        # The rest of this request is all value: no more goes to inbuf.
                        value = bytearray(vlen)
                        got = len(buf) - start
                        value[:got] = memoryview(buf)[start:]
                        conn.body = _Body(op, bytes(buf[_REQ.size:start]),
                                          min(tmo, _MAX_TIMEOUT_MS), value, got)
                        del buf[:]
                    return
                key = bytes(buf[_REQ.size:start])
                value = bytes(memoryview(buf)[start:need])
                del buf[:need]
                self._execute(conn, op, key, value, min(tmo, _MAX_TIMEOUT_MS))

    # ---- requests -----------------------------------------------------------------------
    def _execute(self, conn: _Conn, op: int, key: bytes, value: Value, tmo: int) -> None:
        if op in (OP_WAIT, OP_INFO):
            if key:
                raise _Reject(f"{_OP_NAMES[op]} takes no key")
        elif not key:
            raise _Reject(f"{_OP_NAMES[op]} needs a key")
        if op == OP_SET:
            self._set(key, value)
            self._reply(conn, ST_OK)
        elif op == OP_GET:
            if key in self._data:
                self._reply(conn, ST_OK, self._data[key])
            elif tmo == 0:
                self._reply(conn, ST_TIMEOUT)
            else:
                self._park(conn, op, [key], {key}, tmo)
        elif op == OP_ADD:
            if len(value) != _I64.size:
                raise _Reject("add needs an 8-byte amount")
            (amount,) = _I64.unpack(value)
            old = self._data.get(key, b"0")
            try:
                cur = int(old.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                self._reply(conn, ST_ERROR, f"key {key!r} holds a value that is not a counter "
                                            f"({len(old)} bytes)".encode())
                return
            total = cur + amount
            if not -(1 << 63) <= total < (1 << 63):  # counters are int64, as the reply's reader
                self._reply(conn, ST_ERROR, f"adding {amount} to key {key!r} leaves the int64 "
                                            f"range of a counter".encode())
                return
            new = str(total).encode()
            self._set(key, new)
            self._reply(conn, ST_OK, new)
        elif op == OP_CHECK:
            self._reply(conn, ST_OK, b"\x01" if key in self._data else b"\x00")
        elif op == OP_DELETE:
            self._reply(conn, ST_OK, b"\x01" if self._data.pop(key, None) is not None
                        else b"\x00")
        elif op == OP_WAIT:
            keys = _decode_keys(value)
            if keys is None:
                raise _Reject("malformed key list in wait")
            missing = {k for k in keys if k not in self._data}
            if not missing:
                self._reply(conn, ST_OK)
            elif tmo == 0:
                self._reply(conn, ST_TIMEOUT, _encode_keys(sorted(missing)))
            else:
                self._park(conn, op, keys, missing, tmo)
        elif op == OP_WILL:
            conn.will = (key, value)
            self._reply(conn, ST_OK)
        else:  # OP_INFO
            self._reply(conn, ST_OK, self.job_id)

    def _set(self, key: bytes, value: Value) -> None:
        self._data[key] = value
        for w in list(self._waiters.pop(key, ())):
            if w.done:
                continue
            if w.op == OP_GET:
                self._finish(w, ST_OK, value)
            else:
                w.missing.discard(key)
                if not w.missing:
                    self._finish(w, ST_OK)

    def _park(self, conn: _Conn, op: int, keys: List[bytes], missing: Set[bytes],
              tmo: int) -> None:
        w = _Waiter(conn, op, keys, missing, time.monotonic() + tmo / 1000.0)
        conn.parked = w
        for k in missing:
            self._waiters.setdefault(k, set()).add(w)
        heapq.heappush(self._timers, (w.deadline, next(self._seq), w))

    def _unpark(self, w: _Waiter) -> None:
        w.done = True
        for k in w.missing:
            ws = self._waiters.get(k)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del self._waiters[k]
        if w.conn.parked is w:
            w.conn.parked = None

    def _finish(self, w: _Waiter, status: int, payload: Value = b"") -> None:
        self._unpark(w)
        if w.conn.open:
            self._reply(w.conn, status, payload)
            # Requests it sent meanwhile were held back; serve them next turn
            # (not recursively: a SET there could wake yet another waiter).
            if w.conn.inbuf:
                self._runnable.append(w.conn)

    def _expire(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, item = heapq.heappop(self._timers)
            if isinstance(item, _Waiter):
                if not item.done:
                    missing = _encode_keys(sorted(item.missing)) if item.op == OP_WAIT else b""
                    self._finish(item, ST_TIMEOUT, missing)
            elif item.open and item.state != _READY:
                if item.closing:  # already counted; its verdict could not be delivered
                    self._close_conn(item)
                else:
                    self._reject(item, "handshake not finished in time")
        if len(self._timers) > self._compact_at:
            # Answered waiters stay in the heap until their deadline; drop them
            # in bulk so many short requests with long timeouts cannot pile up.
            self._timers = [t for t in self._timers
                            if (not t[2].done if isinstance(t[2], _Waiter)
                                else t[2].open and t[2].state != _READY)]
            heapq.heapify(self._timers)
            self._compact_at = max(1024, 4 * len(self._timers))

    # ---- output -------------------------------------------------------------------------
    def _reply(self, conn: _Conn, status: int, payload: Value = b"") -> None:
        self._queue(conn, _RESP.pack(status, len(payload)))
        if payload:
            self._queue(conn, payload)

    def _queue(self, conn: _Conn, data: Value) -> None:
        view = memoryview(data)
        conn.out.append(view)
        conn.out_bytes += view.nbytes
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            head = conn.out[0]
            try:
                n = conn.sock.send(head)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close_conn(conn)
                return
            conn.out_bytes -= n
            if n == len(head):
                conn.out.popleft()
            else:
                conn.out[0] = head[n:]
                break
        if not conn.out and conn.closing:
            self._close_conn(conn)
            return
        if conn.paused:
            if conn.out_bytes <= _OUT_MAX_BYTES // 2 and len(conn.out) <= _OUT_MAX_PARTS // 2:
                conn.paused = False
                if conn.inbuf:  # requests read before the pause: next turn, not recursively
                    self._runnable.append(conn)
        elif conn.out_bytes > _OUT_MAX_BYTES or len(conn.out) > _OUT_MAX_PARTS:
            # The client sends but does not read: stop reading it (its requests
            # wait in its own socket) rather than queue replies without bound.
            conn.paused = True
            _log.debug("store: %s has %d unsent bytes in %d pieces; not reading it until "
                       "it reads its replies", conn.addr, conn.out_bytes, len(conn.out))
        # Paused means `out` is not empty, so the connection is always watched for something.
        want = ((0 if conn.paused else selectors.EVENT_READ)
                | (selectors.EVENT_WRITE if conn.out else 0))
        if want != conn.events:
            conn.events = want
            self._sel.modify(conn.sock, want, conn)

    def _close_conn(self, conn: _Conn) -> None:
        if not conn.open:
            return
        conn.open = False
        if conn.will is not None and not self._stop:
            self._wills.append(conn.will)
        conn.will = None
        conn.body = None
        self._pending_hello.pop(conn, None)
        self._pending_proof.pop(conn, None)
        if conn.parked is not None:
            self._unpark(conn.parked)
        self._conns.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass
        conn.out.clear()
        conn.out_bytes = 0
        conn.inbuf = bytearray()
