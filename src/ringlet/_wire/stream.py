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
import time

__all__ = ["ShortRead", "connect", "send_all", "recv_exact"]


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


def recv_exact(sock: socket.socket, n: int, deadline: float, *, chunk: int = 8 << 20) -> bytes:
    """Read exactly ``n`` bytes by ``deadline``, at most ``chunk`` per ``recv``.

    Raises:
        socket.timeout: the deadline passed.  ShortRead: EOF first.
        OSError: the connection failed.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout()
        sock.settimeout(left)
        k = sock.recv_into(view[got:], min(n - got, chunk))
        if k == 0:
            raise ShortRead(got, n)
        got += k
    return bytes(buf)
