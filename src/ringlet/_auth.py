"""Mutual HMAC-SHA256 challenge-response handshake for ringlet's TCP channels.

This is the service profile of the one handshake specified in
docs/security.md (the C core implements its data profile); tests/test_wire.py
checks both against a reference written from that page.

Both sides hold the same key (the job secret or a key derived from it).  Each
side proves it knows the key by MACing a fresh nonce chosen by the *other*
side, so a recorded handshake cannot be replayed and neither side ever sends
anything from which the key can be recovered.

Frames (all fixed size, so a reader never allocates from a peer-chosen length)::

    client -> server  hello   magic "RLH1" (4) | version u16 | claim_len u16 |
                              claim, zero padded (64) | nonce_c (32)      = 104 bytes
    server -> client  reply   nonce_s (32) | mac_s (32)                   =  64 bytes
    client -> server  proof   mac_c (32)                                  =  32 bytes
    server -> client  status  u32: 0 ok, 1 bad MAC, 2 claim rejected      =   4 bytes

    mac_s = HMAC-SHA256(key, "ringlet/server/" | T(purpose) | T(claim) | nonce_c | nonce_s)
    mac_c = HMAC-SHA256(key, "ringlet/client/" | T(purpose) | T(claim) | nonce_c | nonce_s)

``T(x)`` is ``x`` preceded by its length as a u16, so ``purpose`` and ``claim``
cannot be re-split (purpose "ab" + claim "c" differs from "a" + "bc").  The
role labels differ, so a server's answer can never be reflected back to it as
a client proof.  ``purpose`` separates services sharing a key (b"store",
b"ringlet-rpc", ...).  The ``claim`` is what the client says it is (e.g. its
rank); it is bound into both MACs, so a man in the middle cannot alter it, and
the server may reject it (``check_claim``) only once the client has proven
the key.

Integers are big-endian.  Every read and write honours one deadline; a
handshake that cannot finish by then fails with ``AuthenticationError``.

The parsing and MAC helpers (``parse_hello``, ``server_reply``,
``verify_client_proof``) carry no I/O, so a non-blocking server (the store's
selector loop) runs the same protocol as the blocking functions here.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import struct
import time
from typing import Callable, Optional, Tuple, Union

from ._wire import stream
from .errors import AuthenticationError

__all__ = ["client_handshake", "server_handshake", "open_connection", "HandshakeAborted",
           "LogBudget"]

MAGIC = b"RLH1"
VERSION = 1
CLAIM_MAX = 64
NONCE_LEN = 32
MAC_LEN = 32
_HELLO = struct.Struct("!4sHH64s32s")
HELLO_LEN = _HELLO.size  # 104
REPLY_LEN = NONCE_LEN + MAC_LEN  # 64
PROOF_LEN = MAC_LEN  # 32
_STATUS = struct.Struct("!I")
STATUS_LEN = _STATUS.size  # 4
STATUS_OK, STATUS_BAD_MAC, STATUS_CLAIM_REJECTED = 0, 1, 2

BytesLike = Union[bytes, bytearray, memoryview]


class HandshakeAborted(AuthenticationError):
    """The connection broke (EOF or reset) mid-handshake, before any verdict on the key.

    Still an ``AuthenticationError``; the store client uses the distinction to
    retry a connection the server dropped, while a wrong key fails at once.
    """


# ---- the protocol without I/O ------------------------------------------------------
def _key(key: BytesLike) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise TypeError(f"handshake key must be bytes, got {type(key).__name__}")
    key = bytes(key)
    if not key:
        raise ValueError("handshake key must not be empty")
    return key


def _purpose(purpose: Union[BytesLike, str]) -> bytes:
    # str is accepted (utf-8) because callers naturally write purposes as literals.
    if isinstance(purpose, str):
        purpose = purpose.encode("utf-8")
    if not isinstance(purpose, (bytes, bytearray, memoryview)):
        raise TypeError(f"handshake purpose must be bytes or str, got {type(purpose).__name__}")
    purpose = bytes(purpose)
    if len(purpose) > 0xFFFF:
        raise ValueError(f"handshake purpose is too long ({len(purpose)} bytes)")
    return purpose


def _claim(claim: BytesLike) -> bytes:
    if not isinstance(claim, (bytes, bytearray, memoryview)):
        raise TypeError(f"handshake claim must be bytes, got {type(claim).__name__}")
    claim = bytes(claim)
    if len(claim) > CLAIM_MAX:
        raise ValueError(f"handshake claim must be at most {CLAIM_MAX} bytes, got {len(claim)}")
    return claim


def _mac(key: bytes, role: bytes, purpose: bytes, claim: bytes, nonce_c: bytes,
         nonce_s: bytes) -> bytes:
    msg = b"".join((b"ringlet/", role, b"/", struct.pack("!H", len(purpose)), purpose,
                    struct.pack("!H", len(claim)), claim, nonce_c, nonce_s))
    return hmac.new(key, msg, hashlib.sha256).digest()


def encode_hello(claim: bytes, nonce_c: bytes) -> bytes:
    """The client's first frame (``HELLO_LEN`` bytes)."""
    return _HELLO.pack(MAGIC, VERSION, len(claim), claim.ljust(CLAIM_MAX, b"\0"), nonce_c)


def parse_hello(data: BytesLike) -> Tuple[bytes, bytes]:
    """Parse a client hello; return ``(claim, nonce_c)``.

    Raises:
        AuthenticationError: wrong length, magic, version or claim length, or
            non-zero padding (anything that is not a ringlet client).
    """
    if len(data) != HELLO_LEN:
        raise AuthenticationError(f"handshake hello has {len(data)} bytes, expected {HELLO_LEN}")
    magic, version, claim_len, padded, nonce_c = _HELLO.unpack(bytes(data))
    if magic != MAGIC:
        raise AuthenticationError(f"not a ringlet handshake (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise AuthenticationError(f"handshake version {version} is not supported "
                                  f"(this side speaks version {VERSION})")
    if claim_len > CLAIM_MAX:
        raise AuthenticationError(f"handshake claim length {claim_len} exceeds {CLAIM_MAX}")
    if any(padded[claim_len:]):
        raise AuthenticationError("handshake claim padding is not zero")
    return padded[:claim_len], nonce_c


def server_reply(key: bytes, purpose: bytes, claim: bytes, nonce_c: bytes) -> Tuple[bytes, bytes]:
    """Choose the server nonce; return ``(nonce_s, reply_frame)``."""
    nonce_s = secrets.token_bytes(NONCE_LEN)
    return nonce_s, nonce_s + _mac(key, b"server", purpose, claim, nonce_c, nonce_s)


def verify_client_proof(key: bytes, purpose: bytes, claim: bytes, nonce_c: bytes,
                        nonce_s: bytes, proof: BytesLike) -> bool:
    """True when ``proof`` is the client MAC for this exchange (constant-time compare)."""
    return hmac.compare_digest(bytes(proof), _mac(key, b"client", purpose, claim, nonce_c, nonce_s))


def run_check_claim(check_claim: Optional[Callable[[bytes], object]],
                    claim: bytes) -> Optional[str]:
    """Apply ``check_claim``; return why the claim is rejected, or None to accept.

    ``check_claim`` rejects by raising (any ``Exception``) or by returning
    ``False``; any other return value accepts.
    """
    if check_claim is None:
        return None
    try:
        verdict = check_claim(claim)
    except Exception as exc:  # noqa: BLE001 - any refusal becomes a rejected claim
        return f"{type(exc).__name__}: {exc}"
    if verdict is False:
        return "refused by check_claim"
    return None


def status_frame(status: int) -> bytes:
    return _STATUS.pack(status)


class LogBudget:
    """At most ``burst`` warnings per ``period`` seconds to ``logger``; the rest are counted.

    For servers that refuse unauthenticated connections: a flood of them then
    costs a few log lines, not one per socket.  The number suppressed is
    added to the next warning let through.
    """

    def __init__(self, logger: logging.Logger, burst: int = 10, period: float = 10.0) -> None:
        self.logger = logger
        self.burst = burst
        self.period = period
        self.window_end = 0.0
        self.used = 0
        self.suppressed = 0

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now >= self.window_end:
            self.window_end = now + self.period
            self.used = 0
        if self.used >= self.burst:
            self.suppressed += 1
            return
        self.used += 1
        if self.suppressed:
            msg += " (%d similar warnings suppressed)"
            args += (self.suppressed,)
            self.suppressed = 0
        self.logger.warning(msg, *args)


# ---- blocking I/O ---------------------------------------------------------------------
def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    try:
        return stream.recv_exact(sock, n, deadline)
    except socket.timeout:
        raise AuthenticationError(f"handshake timed out waiting for {what}") from None
    except stream.ShortRead as exc:
        raise HandshakeAborted(f"peer closed the connection while we waited for {what} "
                               f"({exc.got} of {n} bytes received)") from None
    except OSError as exc:
        raise HandshakeAborted(f"connection failed while waiting for {what}: {exc}") from exc


def _send_all(sock: socket.socket, data: bytes, deadline: float, what: str) -> None:
    try:
        stream.send_all(sock, data, deadline)
    except socket.timeout:
        raise AuthenticationError(f"handshake timed out sending {what}") from None
    except OSError as exc:
        raise HandshakeAborted(f"connection failed while sending {what}: {exc}") from exc


def _check_deadline(deadline: float) -> float:
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        raise TypeError(f"deadline must be a time.monotonic() value, got {deadline!r}")
    return float(deadline)


def client_handshake(sock: socket.socket, key: BytesLike, purpose: Union[BytesLike, str], *,
                     deadline: float, claim: BytesLike = b"") -> bytes:
    """Authenticate a connected socket as the client; return the accepted claim.

    Proves knowledge of ``key`` to the server and checks the server's proof
    first, so a client never sends its proof to a server that does not hold
    the key.  The socket's timeout is restored afterwards.

    Args:
        sock: a connected stream socket.
        key: the shared key (non-empty bytes).
        purpose: names the service (e.g. ``b"store"``); both sides must agree.
        deadline: ``time.monotonic()`` value by which the handshake must finish.
        claim: up to 64 bytes telling the server who we are (e.g. a rank).
    Returns:
        ``claim`` (as accepted by the server).
    Raises:
        AuthenticationError: the server's proof is wrong (different key or
            purpose), the server rejected our proof or claim, the reply was
            malformed, or the deadline passed.  ``HandshakeAborted`` (a
            subclass) when the connection broke first.
        TypeError, ValueError: bad arguments (nothing is sent).

    Example::

        sock = socket.create_connection((host, port))
        client_handshake(sock, key, b"store", deadline=time.monotonic() + 10)
    """
    key_b, purpose_b, claim_b = _key(key), _purpose(purpose), _claim(claim)
    deadline = _check_deadline(deadline)
    saved = sock.gettimeout()
    try:
        nonce_c = secrets.token_bytes(NONCE_LEN)
        _send_all(sock, encode_hello(claim_b, nonce_c), deadline, "the hello")
        reply = _recv_exact(sock, REPLY_LEN, deadline, "the server's proof")
        nonce_s, mac_s = reply[:NONCE_LEN], reply[NONCE_LEN:]
        if not hmac.compare_digest(mac_s, _mac(key_b, b"server", purpose_b, claim_b, nonce_c,
                                               nonce_s)):
            raise AuthenticationError(
                f"the server's proof did not verify for purpose {purpose_b!r}: it holds a "
                f"different secret (check RINGLET_SECRET on every rank) or is not this service")
        _send_all(sock, _mac(key_b, b"client", purpose_b, claim_b, nonce_c, nonce_s), deadline,
                  "our proof")
        (status,) = _STATUS.unpack(_recv_exact(sock, STATUS_LEN, deadline, "the server's verdict"))
        if status == STATUS_BAD_MAC:
            raise AuthenticationError("the server rejected our proof (its key differs from ours)")
        if status == STATUS_CLAIM_REJECTED:
            raise AuthenticationError(f"the server rejected our claim {claim_b!r} "
                                      f"(e.g. another connection already claimed it)")
        if status != STATUS_OK:
            raise AuthenticationError(f"the server sent an unknown handshake status {status}")
        return claim_b
    finally:
        _restore_timeout(sock, saved)


def server_handshake(sock: socket.socket, key: BytesLike, purpose: Union[BytesLike, str], *,
                     deadline: float,
                     check_claim: Optional[Callable[[bytes], object]] = None) -> bytes:
    """Authenticate a connected socket as the server; return the client's claim.

    Args:
        sock: an accepted stream socket.
        key: the shared key (non-empty bytes).
        purpose: names the service; must match the client's.
        deadline: ``time.monotonic()`` value by which the handshake must finish.
        check_claim: called with the client's claim once the client has proven
            the key; raise (or return False) to reject it, e.g. a rank that is
            already connected.
    Returns:
        The client's claim (bytes, up to 64).
    Raises:
        AuthenticationError: garbage instead of a hello, a wrong proof, a
            rejected claim, or the deadline passed (the client is told which,
            where the protocol allows).  Never another exception type for
            anything the peer sends.

    Example::

        conn, _ = listener.accept()
        rank = int(server_handshake(conn, key, b"rpc", deadline=time.monotonic() + 10))
    """
    key_b, purpose_b = _key(key), _purpose(purpose)
    deadline = _check_deadline(deadline)
    saved = sock.gettimeout()
    try:
        claim, nonce_c = parse_hello(_recv_exact(sock, HELLO_LEN, deadline, "the client's hello"))
        nonce_s, reply = server_reply(key_b, purpose_b, claim, nonce_c)
        _send_all(sock, reply, deadline, "the server proof")
        proof = _recv_exact(sock, PROOF_LEN, deadline, "the client's proof")
        if not verify_client_proof(key_b, purpose_b, claim, nonce_c, nonce_s, proof):
            _send_status_best_effort(sock, STATUS_BAD_MAC, deadline)
            raise AuthenticationError("the client's proof did not verify (it holds a "
                                      "different secret)")
        why = run_check_claim(check_claim, claim)
        if why is not None:
            _send_status_best_effort(sock, STATUS_CLAIM_REJECTED, deadline)
            raise AuthenticationError(f"client claim {claim!r} rejected: {why}")
        _send_all(sock, status_frame(STATUS_OK), deadline, "the verdict")
        return claim
    finally:
        _restore_timeout(sock, saved)


def open_connection(host: str, port: int, key: BytesLike, purpose: Union[BytesLike, str], *,
                    connect_timeout: float, deadline: float,
                    claim: BytesLike = b"") -> socket.socket:
    """Connect to ``host:port`` and authenticate as the client: the store's and RPC's one way in.

    One attempt; retry policy stays with the caller (the store retries while a
    server starts, RPC when a crowded server cut the handshake short).

    Returns:
        The authenticated socket (TCP_NODELAY set; its timeout is the connect one).
    Raises:
        OSError: the TCP connection failed (``socket.timeout`` after
            ``connect_timeout``); nothing was sent.
        AuthenticationError: as ``client_handshake`` (``HandshakeAborted`` when
            the server dropped the connection before a verdict).
    """
    sock = stream.connect(host, port, timeout=connect_timeout)
    try:
        client_handshake(sock, key, purpose, deadline=deadline, claim=claim)
    except BaseException:
        sock.close()
        raise
    return sock


def _send_status_best_effort(sock: socket.socket, status: int, deadline: float) -> None:
    # The verdict is a courtesy so the client reports why; failing to deliver it
    # must not mask the authentication error itself.
    try:
        _send_all(sock, status_frame(status), min(deadline, time.monotonic() + 1.0), "the verdict")
    except AuthenticationError:
        pass


def _restore_timeout(sock: socket.socket, saved: Optional[float]) -> None:
    try:
        sock.settimeout(saved)
    except OSError:
        pass  # socket already closed
