"""The store's wire format after the handshake: requests, responses, limits.

Integers are big-endian::

    request   op u8 | key_len u32 | val_len u64 | timeout_ms u64 | key | value
    response  status u8 | len u64 | payload

    op  1 SET     key, value                   -> OK
        2 GET     key, timeout_ms              -> OK value | TIMEOUT
        3 ADD     key, value = i64 amount      -> OK new value (ASCII decimal) | ERROR
        4 CHECK   key                          -> OK b"\\x01" (present) or b"\\x00"
        5 DELETE  key                          -> OK b"\\x01" (deleted) or b"\\x00"
        6 WAIT    value = keys, a list of bytes in the object codec; timeout_ms
                                               -> OK | TIMEOUT (payload: missing keys, same encoding)
        7 INFO    (no key)                     -> OK job_id
        8 WILL    key, value                   -> OK; when this connection closes, for
                                               any reason, the server sets key to value
                                               unless it is set by then (one per
                                               connection: a later WILL replaces it)
    status  0 OK, 1 TIMEOUT, 2 ERROR (payload: UTF-8 message)

Keys are 1..4096 bytes of UTF-8, values at most 64 MiB.  Counters (``add``)
are stored as ASCII decimal, so ``get`` on one returns e.g. ``b"3"``.  The
connection is authenticated first with the service profile of the handshake
(docs/security.md), purpose ``b"store"``.
"""

from __future__ import annotations

import struct
from typing import Iterable, List, Optional

from .._wire import codec

MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 20
PURPOSE = b"store"
REQ = struct.Struct("!BIQQ")  # op, key_len, val_len, timeout_ms
RESP = struct.Struct("!BQ")  # status, len
I64 = struct.Struct("!q")
OP_SET, OP_GET, OP_ADD, OP_CHECK, OP_DELETE, OP_WAIT, OP_INFO, OP_WILL = range(1, 9)
OP_NAMES = {OP_SET: "set", OP_GET: "get", OP_ADD: "add", OP_CHECK: "check",
            OP_DELETE: "delete", OP_WAIT: "wait", OP_INFO: "info", OP_WILL: "will"}
ST_OK, ST_TIMEOUT, ST_ERROR = 0, 1, 2
# A parked request may wait at most this long server-side (~31 years of ms
# would overflow nothing, but a sane cap keeps the heap arithmetic in floats).
MAX_TIMEOUT_MS = 10 ** 10
MAX_REQUEST = REQ.size + MAX_KEY_BYTES + MAX_VALUE_BYTES
RECV_CHUNK = 1 << 20

# A key list is one codec frame holding a list of bytes; these bounds keep a
# malformed one from costing more than the request that carried it.
_KEYS_LIMITS = codec.Limits(max_frame_bytes=MAX_VALUE_BYTES, max_depth=1,
                            max_elements=MAX_VALUE_BYTES // 8, max_bytes_len=MAX_KEY_BYTES,
                            oob_threshold=MAX_VALUE_BYTES + 1)


def fmt_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def key_bytes(key: str) -> bytes:
    """The UTF-8 bytes of a store key; TypeError/ValueError when it is not a valid key."""
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}")
    kb = key.encode("utf-8")
    if not kb:
        raise ValueError("store key must not be empty")
    if len(kb) > MAX_KEY_BYTES:
        raise ValueError(f"store key is {len(kb)} bytes; the limit is {MAX_KEY_BYTES}")
    return kb


def encode_keys(keys: Iterable[bytes]) -> bytes:
    return codec.dumps([bytes(k) for k in keys], limits=_KEYS_LIMITS)


def decode_keys(blob: bytes) -> Optional[List[bytes]]:
    """Inverse of ``encode_keys``; None when malformed (not a list of 1..4096-byte keys)."""
    try:
        keys = codec.loads(blob, limits=_KEYS_LIMITS)
    except Exception:  # noqa: BLE001 - any malformed list is refused the same way
        return None
    if not isinstance(keys, list) or not all(
            isinstance(k, bytes) and 0 < len(k) <= MAX_KEY_BYTES for k in keys):
        return None
    return keys
