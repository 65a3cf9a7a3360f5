"""The store client: one authenticated connection, one request at a time."""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
import time
from typing import List, Optional, Tuple, Union

from .. import _auth
from .._timeout import seconds
from .._wire import stream
from ..errors import AuthenticationError, RendezvousError
from .protocol import (I64 as _I64, MAX_TIMEOUT_MS as _MAX_TIMEOUT_MS, MAX_VALUE_BYTES,
                       OP_ADD, OP_CHECK, OP_DELETE, OP_GET, OP_INFO, OP_SET, OP_WAIT, OP_WILL,
                       PURPOSE as _PURPOSE, REQ as _REQ,
                       RESP as _RESP, ST_ERROR, ST_OK, ST_TIMEOUT,
                       decode_keys as _decode_keys, encode_keys as _encode_keys,
                       fmt_addr as _fmt_addr, key_bytes as _key_bytes)

__all__ = ["Store"]

# How long a client waits for a store's handshake answer before it counts the
# listener as silent (the server's own default handshake_timeout).
_SILENT_S = 5.0


class _ResolverSilent(Exception):
    """The name resolver gave no answer by the caller's deadline."""


def _resolve(host: str, port: int, deadline: float) -> List[str]:
    """The numeric addresses of ``host`` (getaddrinfo's order), found by ``deadline``.

    getaddrinfo has no timeout of its own (a hung resolver blocks it for as
    long as it likes), so a name is resolved in a daemon thread that the caller
    waits on only until its deadline; an IP literal needs no resolver, no thread.

    Raises:
        socket.gaierror: the resolver answered with an error (retryable).
        _ResolverSilent: no answer by ``deadline`` (the thread is left to finish alone).
    """
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    out: dict = {}
    done = threading.Event()

    def lookup() -> None:
        try:
            out["infos"] = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            out["err"] = exc
        finally:
            done.set()

    threading.Thread(target=lookup, name=f"ringlet-store-resolve:{host}", daemon=True).start()
    # As for connecting: one last short try when the deadline is (nearly) spent.
    if not done.wait(max(deadline - time.monotonic(), 0.01)):
        raise _ResolverSilent()
    if "err" in out:
        raise out["err"]
    addrs: List[str] = []
    for family, _, _, _, sockaddr in out["infos"]:
        addr = sockaddr[0]
        if family == socket.AF_INET6 and len(sockaddr) > 3 and sockaddr[3] and "%" not in addr:
            addr = f"{addr}%{sockaddr[3]}"  # a link-local address needs its scope to connect
        if addr not in addrs:
            addrs.append(addr)
    if not addrs:
        raise socket.gaierror(socket.EAI_NONAME, f"no address for {host!r}")
    return addrs


def _describe_oserror(exc: BaseException) -> str:
    # Names the error without its strerror text: some say "timed out", which
    # callers could mistake for a get() deadline (those carry ``waited``).
    code = getattr(exc, "errno", None)
    name = errno.errorcode.get(code, "") if code is not None else ""
    return f"{type(exc).__name__}{' [' + name + ']' if name else ''}"


def _value_bytes(key: str, value) -> Union[bytes, bytearray, memoryview]:
    """``value`` checked as a store value (bytes-like, at most 64 MiB)."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"store values are bytes, got {type(value).__name__} "
                        f"(encode str values first)")
    value = memoryview(value).cast("B") if isinstance(value, memoryview) else value
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"store value for {key!r} is {len(value)} bytes; the limit is "
                         f"{MAX_VALUE_BYTES}")
    return value


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
        addrs: Optional[List[str]] = None  # resolved once, then reused by every retry
        while True:
            attempts += 1
            try:
                if addrs is None:
                    addrs = _resolve(self.host, self.port, deadline)
                # Each silent try waits twice as long as the last: a store that
                # accepts late (rank 0 starved, a full accept queue) answers later
                # than its own 5 s handshake window.
                return self._open(addrs, deadline, min(deadline, time.monotonic()
                                                       + _SILENT_S * (1 << silent)))
            except _ResolverSilent:
                waited = time.monotonic() - start
                raise RendezvousError(
                    f"could not resolve the rendezvous store's host {self.host!r} (port "
                    f"{self.port}) within the {self._timeout:g}s timeout: the name resolver "
                    f"(DNS) did not answer; check MASTER_ADDR and the resolver "
                    f"(/etc/resolv.conf), or give an IP address", waited=waited) from None
            except _auth.HandshakeAborted as exc:
                last = f"handshake interrupted: {exc}"  # server restarting or overloaded
                silent = 0
            except AuthenticationError as exc:
                if "timed out" not in str(exc):
                    raise AuthenticationError(f"rendezvous store at {self._where}: {exc}") from None
                last = str(exc)
                silent += 1
                if silent >= 2 or time.monotonic() >= deadline:
                    # A store answers a hello from its loop at once, and drops a
                    # silent handshake itself 5 s after accepting it: after 5 and
                    # then 10 s of silence this is another program.
                    raise RendezvousError(
                        f"{self._where} accepted the connection but never answered the ringlet "
                        f"handshake ({last}, {silent} time(s)): it is not a ringlet store "
                        f"(another program holds this port?); check MASTER_ADDR/MASTER_PORT",
                        waited=time.monotonic() - start) from None
            except socket.gaierror as exc:  # the name does not resolve (yet): retried
                last = f"cannot resolve {self.host!r}: {exc.strerror or exc}"
                silent = 0
            except OSError as exc:
                last = _describe_oserror(exc)
                silent = 0
            left = deadline - time.monotonic()
            if left <= 0:
                waited = time.monotonic() - start
                raise RendezvousError(
                    f"could not reach the rendezvous store at {self._where} after {waited:.1f}s "
                    f"and {attempts} attempts (last error: {last}); is rank 0 (or the launcher) "
                    f"running, and are the address and port right?", waited=waited)
            time.sleep(min(delay, left))  # backoff between connection attempts
            delay = min(delay * 2, 0.2)

    def _open(self, addrs: List[str], deadline: float, hs_deadline: float) -> socket.socket:
        """Connect to the first of ``addrs`` that accepts and authenticate there.

        Raises: the last address's OSError when none accepts; a handshake's
        error at once (that listener answered, so the others are not tried).
        """
        err: Optional[OSError] = None
        for addr in addrs:
            left = max(deadline - time.monotonic(), 0.01)  # one last short try at the deadline
            try:
                return _auth.open_connection(addr, self.port, self._secret, _PURPOSE,
                                             connect_timeout=min(left, 5.0), deadline=hs_deadline)
            except OSError as exc:
                err = exc
        raise err if err is not None else OSError(errno.EADDRNOTAVAIL, "no address to try")

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
        stream.send_all(sock, data, deadline)

    @staticmethod
    def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
        return stream.recv_exact(sock, n, deadline)

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
        kb, value = _key_bytes(key), _value_bytes(key, value)
        self._ok(self._request(OP_SET, kb, value, 0, f"set({key!r})"), f"set({key!r})")

    def will(self, key: str, value: Union[bytes, bytearray, memoryview]) -> None:
        """Leave ``value`` for ``key``: the server sets it when this connection
        closes, however it ends (``close()``, the process killed, the network
        lost), unless ``key`` is set by then.  One per connection: a later
        ``will`` replaces it.

        Raises: as ``set``.

        Example::

            store.will(f"exited/{rank}", b"lost")  # waiters on it learn of a crash
        """
        kb, value = _key_bytes(key), _value_bytes(key, value)
        self._ok(self._request(OP_WILL, kb, value, 0, f"will({key!r})"), f"will({key!r})")

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
