"""Fuzz the object codec (``ringlet._wire.codec``, used by RPC, the store and broadcast_object).

Contract: ``loads`` of any bytes returns a value or raises ``ProtocolError``
(a malformed frame, a limit exceeded, trailing bytes); never KeyError,
IndexError, UnicodeDecodeError, struct.error, RecursionError, MemoryError or
anything else.  Pickle stays off, as for frames from an untrusted peer.
A decoded value must encode back to a frame that decodes to an equal value.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import instrumented, main  # noqa: E402

with instrumented():
    from ringlet.errors import ProtocolError
    from ringlet._wire import codec as ser

import numpy as np  # noqa: E402

# Small limits keep each input cheap and reach the limit checks.
LIMITS = ser.Limits(max_depth=16, max_elements=4096, max_bytes_len=1 << 16,
                    max_frame_bytes=1 << 20)


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        # Item by item in order: a NaN key is not found by lookup.
        return isinstance(b, dict) and _same(list(a.items()), list(b.items()))
    # repr: NaN (also inside a complex or a numpy scalar) is not == itself.
    return type(a) is type(b) and (bool(a == b) or repr(a) == repr(b))


def test_one_input(data: bytes) -> None:
    try:
        value = ser.loads(data, limits=LIMITS)
    except ProtocolError:
        return
    again = ser.loads(ser.dumps(value, limits=LIMITS), limits=LIMITS)
    if not _same(value, again):
        raise AssertionError(f"decoded {value!r} re-encodes to {again!r}")


if __name__ == "__main__":
    main(test_one_input)
