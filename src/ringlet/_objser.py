"""Bounded binary encoding of small Python objects for object collectives.

Used by ``broadcast_object`` / ``all_gather_object``.  Never pickle: bytes from
the network can only ever become None, bool, int, float, str, bytes, list,
tuple, dict or a numpy array of a plain numeric/bool dtype.  Every length is
checked against what remains of the payload before anything is allocated.

Layout: one tag byte, then
  N none | T/F bool | i int (8-byte length + two's-complement little-endian bytes)
  f float64 | s str / b bytes (8-byte length + data)
  l list / t tuple (8-byte count + items) | d dict (8-byte count + key, value pairs)
  a array (dtype str, ndim, dims, raw C-order data)
"""

from __future__ import annotations

import struct

import numpy as np

_Q = struct.Struct("<q")
_D = struct.Struct("<d")
MAX_DEPTH = 64
_ARRAY_KINDS = "biuf"


def dumps(obj) -> bytes:
    out: list = []
    _enc(obj, out, 0)
    return b"".join(out)


def _enc(o, out, depth):
    if depth > MAX_DEPTH:
        raise ValueError("object nesting is too deep to send")
    if o is None:
        out.append(b"N")
    elif o is True or o is False:
        out.append(b"T" if o else b"F")
    elif isinstance(o, (int, np.integer)):
        o = int(o)
        raw = o.to_bytes((o.bit_length() + 8) // 8 or 1, "little", signed=True)
        out += [b"i", _Q.pack(len(raw)), raw]
    elif isinstance(o, (float, np.floating)):
        out += [b"f", _D.pack(float(o))]
    elif isinstance(o, str):
        raw = o.encode("utf-8")
        out += [b"s", _Q.pack(len(raw)), raw]
    elif isinstance(o, (bytes, bytearray, memoryview)):
        raw = bytes(o)
        out += [b"b", _Q.pack(len(raw)), raw]
    elif isinstance(o, (list, tuple)):
        out += [b"l" if isinstance(o, list) else b"t", _Q.pack(len(o))]
        for x in o:
            _enc(x, out, depth + 1)
    elif isinstance(o, dict):
        out += [b"d", _Q.pack(len(o))]
        for k, v in o.items():
            _enc(k, out, depth + 1)
            _enc(v, out, depth + 1)
    elif isinstance(o, np.ndarray):
        if o.dtype.kind not in _ARRAY_KINDS:
            raise TypeError(f"cannot send numpy arrays of dtype {o.dtype}")
        dt = o.dtype.str.encode()
        a = np.ascontiguousarray(o)
        out += [b"a", _Q.pack(len(dt)), dt, _Q.pack(a.ndim)]
        out += [_Q.pack(d) for d in a.shape]
        out.append(a.tobytes())
    else:
        raise TypeError(f"cannot send objects of type {type(o).__name__} (allowed: None, bool, "
                        f"int, float, str, bytes, list, tuple, dict, numpy arrays)")


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.d = memoryview(data)
        self.p = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.p + n > len(self.d):
            raise ValueError("malformed object payload (length exceeds the data)")
        v = self.d[self.p:self.p + n]
        self.p += n
        return v

    def q(self) -> int:
        return _Q.unpack(self.take(8))[0]


def loads(data: bytes):
    r = _Reader(data)
    obj = _dec(r, 0)
    if r.p != len(r.d):
        raise ValueError("malformed object payload (trailing bytes)")
    return obj


def _dec(r: _Reader, depth: int):
    if depth > MAX_DEPTH:
        raise ValueError("malformed object payload (nesting too deep)")
    t = bytes(r.take(1))
    if t == b"N":
        return None
    if t in (b"T", b"F"):
        return t == b"T"
    if t == b"i":
        return int.from_bytes(r.take(r.q()), "little", signed=True)
    if t == b"f":
        return _D.unpack(r.take(8))[0]
    if t == b"s":
        return bytes(r.take(r.q())).decode("utf-8")
    if t == b"b":
        return bytes(r.take(r.q()))
    if t in (b"l", b"t"):
        n = r.q()
        if n < 0 or n > len(r.d) - r.p:  # every item takes at least one byte
            raise ValueError("malformed object payload (bad item count)")
        items = [_dec(r, depth + 1) for _ in range(n)]
        return items if t == b"l" else tuple(items)
    if t == b"d":
        n = r.q()
        if n < 0 or 2 * n > len(r.d) - r.p:
            raise ValueError("malformed object payload (bad item count)")
        return {_freeze(_dec(r, depth + 1)): _dec(r, depth + 1) for _ in range(n)}
    if t == b"a":
        dt = np.dtype(bytes(r.take(r.q())).decode("ascii"))
        if dt.kind not in _ARRAY_KINDS:
            raise ValueError(f"malformed object payload (dtype {dt} not allowed)")
        ndim = r.q()
        if not 0 <= ndim <= 32:
            raise ValueError("malformed object payload (bad ndim)")
        shape = tuple(r.q() for _ in range(ndim))
        if any(d < 0 for d in shape):
            raise ValueError("malformed object payload (negative dimension)")
        n = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(bytes(r.take(n)), dtype=dt).reshape(shape).copy()
    raise ValueError(f"malformed object payload (unknown tag {t!r})")


def _freeze(k):
    if isinstance(k, list):
        raise ValueError("malformed object payload (list used as a dict key)")
    return k
