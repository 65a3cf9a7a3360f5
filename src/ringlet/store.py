"""Rendezvous key-value store: how the ranks of a job find each other.

One process (rank 0, or the ``ringlet run`` launcher) runs a ``StoreServer``;
every rank connects a ``Store`` client to it, authenticated with the job
secret (``ringlet._auth``, purpose ``b"store"``).  Ranks publish their
endpoints, count arrivals and wait for each other through it.

Server design: one daemon thread runs a ``selectors`` loop over the listener
and every connection, with no thread per client.  The handshake is run by the
same loop as a small state machine over non-blocking sockets (the protocol
steps are shared with the blocking handshake in ``_auth``), so a client that
connects and then stalls costs one idle socket, never a blocked thread, and is
dropped at its handshake deadline (``handshake_timeout``, 5 s by default).
At most ``max_handshakes`` connections may be unauthenticated at once: a new
one evicts the oldest (preferring those that have not sent a well-formed
hello), and so does running out of descriptors, so a flood of idle or slow
connections can neither block nor delay genuine clients (which retry a
handshake the server dropped).  Warnings about refused connections are
rate-limited (docs/security.md, "The rendezvous store").
Blocking ``get``/``wait`` requests are parked in the loop and answered when
the keys are set, or with TIMEOUT at their deadline.

Wire format after the handshake (integers big-endian)::

    request   op u8 | key_len u32 | val_len u64 | timeout_ms u64 | key | value
    response  status u8 | len u64 | payload

    op  1 SET     key, value                   -> OK
        2 GET     key, timeout_ms              -> OK value | TIMEOUT
        3 ADD     key, value = i64 amount      -> OK new value (ASCII decimal) | ERROR
        4 CHECK   key                          -> OK b"\\x01" (present) or b"\\x00"
        5 DELETE  key                          -> OK b"\\x01" (deleted) or b"\\x00"
        6 WAIT    value = keys, each u32 len | key; timeout_ms
                                               -> OK | TIMEOUT (payload: missing keys, same encoding)
        7 INFO    (no key)                     -> OK job_id
    status  0 OK, 1 TIMEOUT, 2 ERROR (payload: UTF-8 message)

Keys are 1..4096 bytes of UTF-8, values at most 64 MiB.  The server checks
the header before reading (or allocating for) the body: an unknown op, an
oversized length or a malformed body closes that client's connection and
counts it in ``StoreServer.rejected``; every other client keeps being served.
Counters (``add``) are stored as ASCII decimal, so ``get`` on one returns e.g.
``b"3"``.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Deque, Dict, Iterable, List, Optional, Set, Tuple, Union

from . import _auth
from ._timeout import seconds
from .errors import AuthenticationError, RendezvousError

__all__ = ["StoreServer", "Store", "MAX_KEY_BYTES", "MAX_VALUE_BYTES"]

_log = logging.getLogger("ringlet.store")

MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 20
_PURPOSE = b"store"
_REQ = struct.Struct("!BIQQ")  # op, key_len, val_len, timeout_ms
_RESP = struct.Struct("!BQ")  # status, len
_I64 = struct.Struct("!q")
_U32 = struct.Struct("!I")
OP_SET, OP_GET, OP_ADD, OP_CHECK, OP_DELETE, OP_WAIT, OP_INFO = range(1, 8)
_OP_NAMES = {OP_SET: "set", OP_GET: "get", OP_ADD: "add", OP_CHECK: "check",
             OP_DELETE: "delete", OP_WAIT: "wait", OP_INFO: "info"}
ST_OK, ST_TIMEOUT, ST_ERROR = 0, 1, 2
# A parked request may wait at most this long server-side (~31 years of ms
# would overflow nothing, but a sane cap keeps the heap arithmetic in floats).
_MAX_TIMEOUT_MS = 10 ** 10
_MAX_REQUEST = _REQ.size + MAX_KEY_BYTES + MAX_VALUE_BYTES
_RECV_CHUNK = 1 << 20
# How long a client waits for a store's handshake answer before it counts the
# listener as silent (the server's own default handshake_timeout).
_SILENT_S = 5.0
_HS_IN_CAP = _auth.HELLO_LEN + _auth.PROOF_LEN  # a client sends nothing else before READY
_MAX_HANDSHAKES = 512  # unauthenticated connections held at once (oldest evicted beyond)
_ACCEPT_BATCH = 64  # accepts per loop turn, so a flood cannot starve served clients
_ACCEPT_PAUSE = 0.1  # s the listener rests when out of descriptors with nothing to evict
_NO_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def _fmt_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _encode_keys(keys: Iterable[bytes]) -> bytes:
    return b"".join(_U32.pack(len(k)) + k for k in keys)


def _decode_keys(blob: bytes) -> Optional[List[bytes]]:
    """Inverse of ``_encode_keys``; None when malformed."""
    out, i = [], 0
    while i < len(blob):
        if i + 4 > len(blob):
            return None
        (n,) = _U32.unpack_from(blob, i)
        i += 4
        if n == 0 or n > MAX_KEY_BYTES or i + n > len(blob):
            return None
        out.append(blob[i:i + n])
        i += n
    return out


# ==== server =============================================================================
_HELLO, _PROOF, _READY = 0, 1, 2


class _Conn:
    """One client connection as the selector loop sees it."""

    __slots__ = ("sock", "addr", "state", "inbuf", "out", "deadline", "claim", "nonce_c",
                 "nonce_s", "parked", "closing", "open", "events")

    def __init__(self, sock: socket.socket, addr, deadline: float) -> None:
        self.sock = sock
        self.addr = addr
        self.state = _HELLO
        self.inbuf = bytearray()
        self.out: Deque[memoryview] = collections.deque()
        self.deadline = deadline
        self.claim = b""
        self.nonce_c = b""
        self.nonce_s = b""
        self.parked: Optional[_Waiter] = None
        self.closing = False  # close once `out` is flushed
        self.open = True
        self.events = selectors.EVENT_READ


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
            the oldest is dropped to make room (genuine clients retry).
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
                 max_handshakes: int = _MAX_HANDSHAKES) -> None:
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
        if not handshake_timeout or handshake_timeout <= 0:
            raise ValueError(f"handshake_timeout must be positive, got {handshake_timeout!r}")
        if isinstance(max_handshakes, bool) or not isinstance(max_handshakes, int) \
                or max_handshakes < 1:
            raise ValueError(f"max_handshakes must be a positive int, got {max_handshakes!r}")
        self._secret = bytes(secret)
        self.job_id = bytes(job_id)
        self.rejected = 0
        self._hs_timeout = float(handshake_timeout)
        self._data: Dict[bytes, bytes] = {}
        self._waiters: Dict[bytes, Set[_Waiter]] = {}
        self._timers: List[Tuple[float, int, object]] = []  # heap of (deadline, seq, conn|waiter)
        self._seq = itertools.count()
        self._compact_at = 1024
        self._conns: Set[_Conn] = set()
        # Unauthenticated connections in accept order (oldest first), for eviction.
        self._pending: Dict[_Conn, None] = {}
        self._max_handshakes = max_handshakes
        self._accept_paused_until: Optional[float] = None
        self._warn = _auth.LogBudget(_log)
        self._runnable: Deque[_Conn] = collections.deque()
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
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listener")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name=f"ringlet-store:{self.port}",
                                        daemon=True)
        self._thread.start()

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
            while self._runnable:
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
        victim = next((c for c in self._pending if c.state == _HELLO), None)
        if victim is None:
            victim = next(iter(self._pending), None)
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
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(self._pending) >= self._max_handshakes:
                self._evict_oldest(f"{len(self._pending)} handshakes pending")
            conn = _Conn(sock, addr, time.monotonic() + self._hs_timeout)
            self._conns.add(conn)
            self._pending[conn] = None
            self._sel.register(sock, selectors.EVENT_READ, conn)
            heapq.heappush(self._timers, (conn.deadline, next(self._seq), conn))
            # A client sends its hello right after connecting: answer it now,
            # so it leaves the evictable HELLO state at once.
            self._guarded(conn, self._on_readable)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(_RECV_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if conn.state != _READY:
                self._reject(conn, f"connection failed during the handshake: {exc}")
            else:
                self._close_conn(conn)
            return
        if not chunk:
            if conn.state != _READY:
                self._reject(conn, "closed during the handshake (wrong secret, or not a "
                                   "ringlet client)")
            else:
                self._close_conn(conn)
            return
        conn.inbuf += chunk
        cap = _HS_IN_CAP if conn.state != _READY else _MAX_REQUEST
        if len(conn.inbuf) > cap:
            self._reject(conn, f"sent {len(conn.inbuf)} bytes without waiting for replies")
            return
        if conn.parked is None:
            self._guarded(conn, self._process)

    def _process(self, conn: _Conn) -> None:
        """Consume whatever complete frames ``conn.inbuf`` holds."""
        while conn.open and not conn.closing and conn.parked is None:
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
                self._pending.pop(conn, None)
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
                need = _REQ.size + klen + vlen
                if len(buf) < need:
                    return
                key = bytes(buf[_REQ.size:_REQ.size + klen])
                value = bytes(buf[_REQ.size + klen:need])
                del buf[:need]
                self._execute(conn, op, key, value, min(tmo, _MAX_TIMEOUT_MS))

    # ---- requests -----------------------------------------------------------------------
    def _execute(self, conn: _Conn, op: int, key: bytes, value: bytes, tmo: int) -> None:
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
            new = str(cur + amount).encode()
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
        else:  # OP_INFO
            self._reply(conn, ST_OK, self.job_id)

    def _set(self, key: bytes, value: bytes) -> None:
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

    def _finish(self, w: _Waiter, status: int, payload: bytes = b"") -> None:
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
    def _reply(self, conn: _Conn, status: int, payload: bytes = b"") -> None:
        self._queue(conn, _RESP.pack(status, len(payload)))
        if payload:
            self._queue(conn, payload)

    def _queue(self, conn: _Conn, data: bytes) -> None:
        conn.out.append(memoryview(data))
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
            if n == len(head):
                conn.out.popleft()
            else:
                conn.out[0] = head[n:]
                break
        if not conn.out and conn.closing:
            self._close_conn(conn)
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if want != conn.events:
            conn.events = want
            self._sel.modify(conn.sock, want, conn)

    def _close_conn(self, conn: _Conn) -> None:
        if not conn.open:
            return
        conn.open = False
        self._pending.pop(conn, None)
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
        conn.inbuf = bytearray()


# ==== client =============================================================================
def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}")
    kb = key.encode("utf-8")
    if not kb:
        raise ValueError("store key must not be empty")
    if len(kb) > MAX_KEY_BYTES:
        raise ValueError(f"store key is {len(kb)} bytes; the limit is {MAX_KEY_BYTES}")
    return kb


def _describe_oserror(exc: BaseException) -> str:
    # Names the error without its strerror text: some say "timed out", which
    # callers could mistake for a get() deadline (those carry ``waited``).
    code = getattr(exc, "errno", None)
    name = errno.errorcode.get(code, "") if code is not None else ""
    return f"{type(exc).__name__}{' [' + name + ']' if name else ''}"


class Store:
    """Client of a ``StoreServer``.

    Connecting retries (exponential backoff capped at 0.2 s) until
    ``timeout``, so ranks may start before the server.  Thread-safe: one lock
    serialises requests on the single connection, so a blocked ``get`` holds
    the connection until it returns; use one ``Store`` per thread where
    several threads must block concurrently.

    Args:
        host, port: the server's address.
        secret: the job secret (bytes).
        timeout: seconds to keep trying to connect, and the default wait for
            ``get``/``wait`` and for any reply.
    Attributes:
        job_id: the job's id (bytes), fetched from the server at connect.
    Raises:
        RendezvousError: the server could not be reached within ``timeout``.
        AuthenticationError: the server holds a different secret.

    Example::

        store = Store("10.0.0.1", 29500, secret=key, timeout=60)
        store.set("ep/3", b"10.0.0.4:41000")
        peer = store.get("ep/0")
        n = store.add("arrived", 1)
    """

    def __init__(self, host: str, port: int, *, secret: bytes, timeout: float = 300.0) -> None:
        if not isinstance(host, str) or not host:
            raise TypeError(f"host must be a non-empty str, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
            raise ValueError(f"port must be an int in [1, 65535], got {port!r}")
        if not isinstance(secret, (bytes, bytearray)) or not secret:
            raise TypeError("secret must be non-empty bytes")
        timeout = seconds(timeout)
        self.host = host
        self.port = port
        self._secret = bytes(secret)
        self._timeout = float(timeout)
        self._lock = threading.Lock()
        self._closed = False
        self._broken: Optional[str] = None
        self._sock = self._connect()
        try:
            self.job_id = self._request(OP_INFO, b"", b"", 0, "info")[1]
        except BaseException:
            self.close()
            raise

    @property
    def _where(self) -> str:
        return _fmt_addr(self.host, self.port)

    def _connect(self) -> socket.socket:
        start = time.monotonic()
        deadline = start + self._timeout
        delay, attempts, last = 0.005, 0, "no attempt"
        silent = 0  # handshakes in a row the listener accepted but never answered
        while True:
            attempts += 1
            left = max(deadline - time.monotonic(), 0.01)  # one last short try at the deadline
            sock = None
            try:
                sock = socket.create_connection((self.host, self.port), timeout=min(left, 5.0))
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _auth.client_handshake(sock, self._secret, _PURPOSE,
                                       deadline=min(deadline, time.monotonic() + _SILENT_S))
                return sock
            except _auth.HandshakeAborted as exc:
                last = f"handshake interrupted: {exc}"  # server restarting or overloaded
                silent = 0
            except AuthenticationError as exc:
                if sock is not None:
                    sock.close()
                if "timed out" not in str(exc):
                    raise AuthenticationError(f"rendezvous store at {self._where}: {exc}") from None
                last = str(exc)
                silent += 1
                if silent >= 2 or time.monotonic() >= deadline:
                    # A store answers a hello from its loop at once, and drops a
                    # silent handshake itself after 5 s: this is another program.
                    raise RendezvousError(
                        f"{self._where} accepted the connection but never answered the ringlet "
                        f"handshake ({last}, {silent} time(s)): it is not a ringlet store "
                        f"(another program holds this port?); check MASTER_ADDR/MASTER_PORT",
                        waited=time.monotonic() - start) from None
            except OSError as exc:
                last = _describe_oserror(exc)
                silent = 0
            if sock is not None:
                sock.close()
            left = deadline - time.monotonic()
            if left <= 0:
                waited = time.monotonic() - start
                raise RendezvousError(
                    f"could not reach the rendezvous store at {self._where} after {waited:.1f}s "
                    f"and {attempts} attempts (last error: {last}); is rank 0 (or the launcher) "
                    f"running, and are the address and port right?", waited=waited)
            time.sleep(min(delay, left))  # backoff between connection attempts
            delay = min(delay * 2, 0.2)

    # ---- requests -----------------------------------------------------------------------
    def _request(self, op: int, key: bytes, value: bytes, timeout_ms: int,
                 desc: str, wait: float = 0.0) -> Tuple[int, bytes]:
        """Send one request and read its response (holding the connection lock)."""
        deadline = time.monotonic() + wait + self._timeout
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise RendezvousError(f"store {desc}: another thread held this Store's connection "
                                  f"too long; use one Store per thread for concurrent blocking "
                                  f"calls")
        try:
            if self._closed or self._broken is not None:
                raise RendezvousError(f"store {desc}: the client is closed"
                                      + (f" (lost the server earlier: {self._broken})"
                                         if self._broken else ""))
            sock = self._sock
            try:
                head = _REQ.pack(op, len(key), len(value), timeout_ms) + key
                if len(value) <= 65536:
                    self._sendall(sock, head + bytes(value), deadline)
                else:
                    self._sendall(sock, head, deadline)
                    self._sendall(sock, value, deadline)
                status, n = _RESP.unpack(self._recv_exact(sock, _RESP.size, deadline))
                if status not in (ST_OK, ST_TIMEOUT, ST_ERROR) or n > MAX_VALUE_BYTES + 8:
                    raise _BadReply(f"malformed reply (status {status}, length {n})")
                payload = self._recv_exact(sock, n, deadline) if n else b""
                return status, payload
            except BaseException as exc:
                # The stream position is unknown now; this connection is done.
                self._broken = (_describe_oserror(exc) if isinstance(exc, OSError)
                                else str(exc) or type(exc).__name__)
                try:
                    sock.close()
                except OSError:
                    pass
                if isinstance(exc, (OSError, _BadReply)):
                    if self._closed:
                        raise RendezvousError(f"store {desc}: the client was closed") from None
                    if isinstance(exc, socket.timeout):
                        msg = f"the server sent no reply within {self._timeout:g}s (hung?)"
                    elif isinstance(exc, _BadReply):
                        msg = str(exc)
                    else:
                        msg = self._broken
                    raise RendezvousError(
                        f"store {desc}: lost the connection to the rendezvous store at "
                        f"{self._where} ({msg}); the process serving it (rank 0 or the "
                        f"launcher) probably exited") from None
                raise
        finally:
            self._lock.release()

    @staticmethod
    def _sendall(sock: socket.socket, data, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout()
        sock.settimeout(left)
        sock.sendall(data)

    @staticmethod
    def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout()
            sock.settimeout(left)
            k = sock.recv_into(view[got:], min(n - got, _RECV_CHUNK * 8))
            if k == 0:
                raise ConnectionResetError(errno.ECONNRESET, "the server closed the connection")
            got += k
        return bytes(buf)

    def _wait_arg(self, timeout: Optional[float]) -> float:
        if timeout is None:
            return self._timeout
        return seconds(timeout, zero=True)

    def set(self, key: str, value: Union[bytes, bytearray, memoryview]) -> None:
        """Store ``value`` under ``key`` (replacing any value) and wake its waiters.

        Raises:
            TypeError: key not str or value not bytes-like.
            ValueError: key empty or over 4096 bytes, or value over 64 MiB.
            RendezvousError: the connection to the server is lost.

        Example::

            store.set("ep/0", b"10.0.0.1:40000")
        """
        kb = _key_bytes(key)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"store values are bytes, got {type(value).__name__} "
                            f"(encode str values first)")
        value = memoryview(value).cast("B") if isinstance(value, memoryview) else value
        if len(value) > MAX_VALUE_BYTES:
            raise ValueError(f"store value for {key!r} is {len(value)} bytes; the limit is "
                             f"{MAX_VALUE_BYTES}")
        self._ok(self._request(OP_SET, kb, value, 0, f"set({key!r})"), f"set({key!r})")

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        """Return the value of ``key``, waiting until some client sets it.

        Args:
            key: the key.
            timeout: seconds to wait (default: the Store's timeout); 0 checks once.
        Returns:
            The value (bytes).
        Raises:
            RendezvousError: the key did not appear in time (the message names
                the key and the wait; ``exc.waited`` is set), or the connection
                is lost (``exc.waited`` is None).

        Example::

            addr = store.get("ep/0", timeout=30).decode()
        """
        kb = _key_bytes(key)
        wait = self._wait_arg(timeout)
        start = time.monotonic()
        status, payload = self._request(OP_GET, kb, b"", self._ms(wait), f"get({key!r})", wait)
        if status == ST_TIMEOUT:
            waited = time.monotonic() - start
            raise RendezvousError(
                f"store get({key!r}) timed out: waited {waited:.1f}s (timeout {wait:g}s) at "
                f"{self._where} and no rank set the key", waited=waited)
        return self._ok((status, payload), f"get({key!r})")

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (0 if unset); return the new value.

        Raises:
            TypeError: amount not an int.  ValueError: amount outside int64, or
            ``key`` holds a value that is not a counter.
            RendezvousError: the connection to the server is lost.

        Example::

            if store.add("arrived", 1) == world_size:
                store.set("all_arrived", b"1")
        """
        kb = _key_bytes(key)
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(f"add amount must be an int, got {type(amount).__name__}")
        if not -(1 << 63) <= amount < (1 << 63):
            raise ValueError(f"add amount {amount} does not fit in 64 bits")
        payload = self._ok(self._request(OP_ADD, kb, _I64.pack(amount), 0, f"add({key!r})"),
                           f"add({key!r})")
        return int(payload.decode("ascii"))

    def check(self, key: str) -> bool:
        """True when ``key`` is set (never waits)."""
        kb = _key_bytes(key)
        return self._ok(self._request(OP_CHECK, kb, b"", 0, f"check({key!r})"),
                        f"check({key!r})") == b"\x01"

    def delete(self, key: str) -> bool:
        """Remove ``key``; True when it existed."""
        kb = _key_bytes(key)
        return self._ok(self._request(OP_DELETE, kb, b"", 0, f"delete({key!r})"),
                        f"delete({key!r})") == b"\x01"

    def wait(self, keys: List[str], timeout: Optional[float] = None) -> None:
        """Block until every key in ``keys`` is set.

        Raises:
            RendezvousError: some keys were still missing at the deadline (the
                message names them; ``exc.waited`` is set), or the connection
                is lost.

        Example::

            store.wait([f"ready/{r}" for r in range(world_size)], timeout=60)
        """
        if isinstance(keys, (str, bytes)):
            raise TypeError("wait takes a list of keys, not a single key")
        kbs = [_key_bytes(k) for k in keys]
        if not kbs:
            return
        blob = _encode_keys(kbs)
        if len(blob) > MAX_VALUE_BYTES:
            raise ValueError(f"wait: {len(kbs)} keys exceed the request size limit")
        wait = self._wait_arg(timeout)
        start = time.monotonic()
        desc = f"wait({len(kbs)} keys)"
        status, payload = self._request(OP_WAIT, b"", blob, self._ms(wait), desc, wait)
        if status == ST_TIMEOUT:
            waited = time.monotonic() - start
            missing = [k.decode("utf-8", "replace") for k in (_decode_keys(payload) or [])]
            shown = ", ".join(repr(k) for k in missing[:10])
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise RendezvousError(
                f"store wait timed out: waited {waited:.1f}s (timeout {wait:g}s) at "
                f"{self._where}; still missing {shown}{more}", waited=waited)
        self._ok((status, payload), desc)

    @staticmethod
    def _ms(seconds: float) -> int:
        return min(int(seconds * 1000.0 + 0.999), _MAX_TIMEOUT_MS)

    def _ok(self, reply: Tuple[int, bytes], desc: str) -> bytes:
        status, payload = reply
        if status == ST_OK:
            return payload
        if status == ST_ERROR:
            raise ValueError(f"store {desc}: {payload.decode('utf-8', 'replace')}")
        raise RendezvousError(f"store {desc}: unexpected TIMEOUT reply from {self._where}")

    # ---- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        """Close the connection (idempotent).  A call blocked in another thread fails."""
        if self._closed:
            return
        self._closed = True
        sock = getattr(self, "_sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "connected")
        return f"Store({self._where}, {state})"


class _BadReply(Exception):
    pass
