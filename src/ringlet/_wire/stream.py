"""Blocking stream I/O with one deadline: the bottom of the Python socket stack.

The store client and the handshake (``ringlet._auth``) move their bytes
through these; each caller maps the plain exceptions raised here to its own
error (``RendezvousError``, ``AuthenticationError``, ...).  RPC's frame I/O
(``ringlet.rpc.transport``) adds a stop flag and idle waits on top of the
same socket settings.
"""

from __future__ import annotations

import errno
import socket
import struct
import time

__all__ = ["ShortRead", "connect", "send_all", "recv_exact", "recv_exact_into"]

# Payloads at least this large are received in place into the bytes object
# returned; below it, through a bytearray whose copy costs nothing.
_IN_PLACE_MIN = 1 << 16


class ShortRead(ConnectionResetError):
    """The peer closed the stream before ``n`` bytes arrived; ``got`` says how many did."""

    def __init__(self, got: int, n: int) -> None:
        super().__init__(errno.ECONNRESET,
                         f"the peer closed the connection ({got} of {n} bytes received)")
        self.got = got
        self.n = n


def connect(host: str, port: int, *, timeout: float) -> socket.socket:
    """A connected TCP socket (TCP_NODELAY: requests are small and latency-bound).

    Raises:
        OSError: the connection failed (``socket.timeout`` when ``timeout`` passed).
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_all(sock: socket.socket, data, deadline: float) -> None:
    """Send every byte of ``data`` by ``deadline`` (a ``time.monotonic()`` value).

    Raises:
        socket.timeout: the deadline passed.  OSError: the connection failed.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout()
    sock.settimeout(left)
    sock.sendall(data)


def recv_exact_into(sock: socket.socket, buf, deadline: float, *, start: int = 0) -> None:
    """Fill the writable buffer ``buf`` from byte ``start`` on, by ``deadline``.

    Raises:
        socket.timeout: the deadline passed.  ShortRead: EOF first (``got``
        counts from the start of ``buf``).  OSError: the connection failed.
    """
    view = memoryview(buf).cast("B")
    n = view.nbytes
    got = start
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout()
        sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ShortRead(got, n)
        got += k


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Read exactly ``n`` bytes by ``deadline``, as one ``bytes`` object.

    A large payload is received straight into that object, so it is never
    held twice (no buffer that is then copied).

    Raises:
        socket.timeout: the deadline passed.  ShortRead: EOF first.
        OSError: the connection failed.
    """
    if n < _IN_PLACE_MIN:
        buf = bytearray(n)
        recv_exact_into(sock, buf, deadline)
        return bytes(buf)
    data = _recv_waitall(sock, n, deadline)
    if len(data) == n:
        return data
    if not data:
        raise ShortRead(0, n)
    # Cut short (EOF, the deadline, or a signal whose handler returned): the
    # rest goes through a buffer, with the usual checks.
    buf = bytearray(n)
    got = len(data)
    buf[:got] = data
    del data
    recv_exact_into(sock, buf, deadline, start=got)
    return bytes(buf)


def _recv_waitall(sock: socket.socket, n: int, deadline: float) -> bytes:
    """One ``recv(n, MSG_WAITALL)``: up to ``n`` bytes in a single bytes object.

    MSG_WAITALL waits for all ``n`` only on a blocking socket, so for this call
    the socket blocks and SO_RCVTIMEO carries the deadline; a signal or EOF
    returns what came so far.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout()
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(left))
    try:
        return sock.recv(n, socket.MSG_WAITALL)
    except BlockingIOError:  # SO_RCVTIMEO passed before the first byte
        raise socket.timeout() from None
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(0.0))


def _timeval(seconds: float) -> bytes:
    """A ``struct timeval``; 0 means no timeout, so a positive wait is at least 1 us."""
    seconds = min(seconds, float(1 << 30))  # fits a 32-bit time_t; the kernel caps it anyway
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    if seconds > 0 and sec == 0 and usec == 0:
        usec = 1
    return struct.pack("@ll", sec, usec)
