"""Fuzz the rendezvous store server's parsers (``ringlet.store``, ``ringlet._auth``).

A real ``StoreServer`` listens on loopback.  Each input opens a connection
and sends its bytes either as they are (the pre-authentication HELLO / proof
parser: ``flags & 1 == 0``) or after a genuine client handshake (the request
parser and the requests themselves), then closes its write side and reads
until the server closes.

Contract: the server drops a malformed client (and counts it in
``rejected``) and keeps serving everyone else.  A failure is an "internal
error" (any exception but the parser's own rejection, logged by the server),
a server thread that died, or a connection the server keeps open after the
client has gone.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import instrumented, main  # noqa: E402

with instrumented():
    from ringlet import _auth
    from ringlet import store as store_mod

SECRET = b"fuzz-store-secret-0123456789"
REPLY_WAIT = 10.0  # seconds; the server answers a closed client at once


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


_errors = _Errors()
logging.getLogger("ringlet.store").addHandler(_errors)
logging.getLogger("ringlet.store").propagate = False  # the fuzzer's log stays readable
_server = None


def _get_server():
    global _server
    if _server is None:
        _server = store_mod.StoreServer("127.0.0.1", 0, secret=SECRET)
    return _server


def test_one_input(data: bytes) -> None:
    server = _get_server()
    if not data:
        return
    authed, body = data[0] & 1, data[1:]
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=REPLY_WAIT)
    try:
        if authed:
            _auth.client_handshake(sock, SECRET, b"store", deadline=time.monotonic() + REPLY_WAIT)
        try:
            sock.sendall(body)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may drop us mid-send: that is its right
        try:
            while sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        except socket.timeout:
            raise AssertionError(f"the store server kept a closed client waiting "
                                 f"{REPLY_WAIT} s") from None
    finally:
        sock.close()
    if _errors.records:
        msg = "\n".join(_errors.records)
        _errors.records.clear()
        raise AssertionError(f"store server internal error:\n{msg}")
    if not server._thread.is_alive():
        raise AssertionError("the store server's thread died")


def cleanup() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


if __name__ == "__main__":
    main(test_one_input)
