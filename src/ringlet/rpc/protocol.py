"""The RPC protocol above the codec: frame kinds, handshake purpose, worker identity.

The frame layout and value encoding are ``ringlet._wire.codec``'s
(docs/rpc.md).  Every request that expects a reply gets exactly one RESULT or
ERROR with the same request id.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, Tuple

PROTOCOL_VERSION = 1
AUTH_PURPOSE = "ringlet-rpc"

# Frame kinds (the header's "kind" byte).  Requests that expect a reply are
# CALL, REMOTE, RREF_FETCH, RREF_CALL and RREF_INC; each gets exactly one
# RESULT or ERROR with the same request id.  RREF_DEC is fire-and-forget.
K_CALL = 1
K_RESULT = 2
K_ERROR = 3
K_REMOTE = 4
K_RREF_FETCH = 5
K_RREF_CALL = 6
K_RREF_INC = 7
K_RREF_DEC = 8
K_CLOSE = 9  # callee -> caller: "I am dropping this connection because ..." (best effort)

EXT_RREF = 1

# Where args and kwargs sit in each request's payload list (for error messages).
_ARG_SLOTS = {K_CALL: {1: "args", 2: "kwargs"}, K_REMOTE: {3: "args", 4: "kwargs"},
              K_RREF_CALL: {3: "args", 4: "kwargs"}}

HANDSHAKE_TIMEOUT = 10.0
_MAX_HANDSHAKES = 64
_MAX_ERROR_TEXT = 1 << 16


@dataclass(frozen=True)
class WorkerInfo:
    """A worker of the RPC job: its unique name, rank, and listening address."""

    name: str
    rank: int
    host: str
    port: int


class _BadRequest(Exception):
    """Internal: a well-framed request whose contents do not make sense."""


def _exc_info(exc: BaseException) -> Tuple[str, str, str]:
    t = type(exc)
    name = t.__qualname__ if t.__module__ in ("builtins", "__main__") else f"{t.__module__}.{t.__qualname__}"
    # A user's exception whose __str__ itself fails must still reach the
    # caller: every request gets its one reply.
    try:
        text = str(exc)
    except Exception as e:  # noqa: BLE001
        text = f"<str() of the {name} failed: {type(e).__name__}: {e}>"
    try:
        tb = "".join(traceback.format_exception(t, exc, exc.__traceback__))
    except Exception:  # noqa: BLE001 - the traceback formats str(exc) too
        tb = ""
    return name, text[:_MAX_ERROR_TEXT], tb[-_MAX_ERROR_TEXT:]


def _is_int(x: Any) -> bool:
    return type(x) is int
