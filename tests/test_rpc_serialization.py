"""The RPC wire format: round trips, limits, malformed frames, zero-copy transfer."""

from __future__ import annotations

import math
import socket
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringlet.errors import CollectiveTimeout, PeerClosedError, ProtocolError
from ringlet.rpc import serialization as ser
from ringlet.rpc.serialization import Limits, dumps, loads
from ringlet.rpc.transport import recv_exact_into, send_buffers

# ---- helpers -------------------------------------------------------------------------

def same(a, b) -> bool:
    """Structural equality that also checks exact types, dtypes and NaNs."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
            a, b, equal_nan=a.dtype.kind in "fc")
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and (a == b or (a != a and b != b))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, complex):
        return same(a.real, b.real) and same(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        if len(a) != len(b):
            return False
        bk = list(b.items())
        return all(same(k1, k2) and same(v1, v2) for (k1, v1), (k2, v2) in zip(a.items(), bk))
    return a == b


DTYPES = sorted(ser.ALLOWED_DTYPES)


@st.composite
def arrays(draw):
    dt = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    n = int(np.prod(shape))
    raw = draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))
    return np.frombuffer(raw, dtype=dt).reshape(shape).copy()


@st.composite
def np_scalars(draw):
    dt = np.dtype(draw(st.sampled_from(DTYPES)))
    raw = draw(st.binary(min_size=dt.itemsize, max_size=dt.itemsize))
    return np.frombuffer(raw, dtype=dt)[0]


hashable = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=6,
)
scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**300, 2**300)
           | st.floats(allow_nan=True) | st.complex_numbers() | st.text() | st.binary()
           | arrays() | np_scalars())
values = st.recursive(
    scalars,
    lambda inner: (st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
                   | st.dictionaries(hashable, inner, max_size=4)),
    max_leaves=20,
)


# ---- round trips ---------------------------------------------------------------------

@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values, st.sampled_from([0, 1 << 16]))
def test_round_trip_every_type(value, oob_threshold):
    lim = Limits(oob_threshold=oob_threshold)
    out = loads(dumps(value, limits=lim))
    assert same(value, out), (value, out)


def test_round_trip_edge_values():
    v = [2**63 - 1, -2**63, 2**63, -2**63 - 1, 10**400, -(10**400), 0.0, -0.0, math.inf, -math.inf,
         "", b"", "\u2603\U0001f600", "\ud800", (), [], {}, {(): None}, {None: 1, True: 2, 2.5: 3, b"k": 4}]
    out = loads(dumps(v))
    assert same(v, out)
    assert math.copysign(1.0, out[7]) == -1.0  # -0.0 keeps its sign


def test_array_conversions():
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    noncontig = base[:, ::2]
    big_endian = np.arange(5, dtype=">i4")
    sub = np.arange(3.0).view(np.recarray) if hasattr(np, "recarray") else np.arange(3.0)
    out = loads(dumps([noncontig, big_endian, sub, np.float32(1.5), np.bool_(True), np.array(7, np.int16)]))
    assert out[0].flags.c_contiguous and np.array_equal(out[0], noncontig)
    assert out[1].dtype == np.dtype("<i4") and out[1].tolist() == [0, 1, 2, 3, 4]
    assert type(out[2]) is np.ndarray and out[2].tolist() == [0.0, 1.0, 2.0]
    assert type(out[3]) is np.float32 and out[3] == 1.5
    assert type(out[4]) is np.bool_ and bool(out[4])
    assert out[5].shape == () and out[5].dtype == np.int16 and int(out[5]) == 7
    # received arrays are fresh and writable
    out[0][0, 0] = 99.0
    assert base[0, 0] == 0.0


def test_bytes_like_arrive_as_bytes():
    out = loads(dumps([bytearray(b"ab"), memoryview(b"cd"), memoryview(np.arange(3, dtype=np.int16))]))
    assert out == [b"ab", b"cd", np.arange(3, dtype=np.int16).tobytes()]


# ---- what cannot be sent -------------------------------------------------------------

class _Opaque:
    pass


class _Payload:
    """Unpickling it would flip a flag: proves a refused pickle never runs."""

    ran = False

    def __reduce__(self):
        return (_Payload._trigger, ())

    @staticmethod
    def _trigger():
        _Payload.ran = True
        return "triggered"


def test_unsupported_type_names_path():
    with pytest.raises(TypeError, match=r"args\['a'\]\[1\].*_Opaque.*allow_pickle=True"):
        ser.encode({"a": [1, _Opaque()]}, what="args")
    with pytest.raises(TypeError, match="dtype object"):
        ser.encode(np.array([1, "x"], dtype=object))
    with pytest.raises(TypeError, match="datetime64"):
        ser.encode(np.array(["2020-01-01"], dtype="datetime64[D]"))
    with pytest.raises(TypeError, match="set"):
        ser.encode({1, 2})


def test_pickle_opt_in_and_refusal():
    value = {"s": {1, 2, 3}, "p": _Payload()}
    frame = dumps(value, allow_pickle=True)
    _Payload.ran = False
    with pytest.raises(ProtocolError, match="refused a pickled value.*allow_pickle=True"):
        loads(frame)
    assert not _Payload.ran
    out = loads(frame, allow_pickle=True)
    assert out["s"] == {1, 2, 3} and out["p"] == "triggered" and _Payload.ran


def test_encode_limits():
    cyc: list = []
    cyc.append(cyc)
    with pytest.raises(ValueError, match="max_depth=64.*cycle"):
        ser.encode(cyc)
    with pytest.raises(ValueError, match="max_elements=10"):
        ser.encode([[1] * 6, [2] * 6], limits=Limits(max_elements=10))
    with pytest.raises(ValueError, match="str of 11 bytes exceeds max_bytes_len=10"):
        ser.encode(["x" * 11], limits=Limits(max_bytes_len=10))
    with pytest.raises(ValueError, match="max_frame_bytes=1000"):
        ser.encode(np.zeros(1000, np.uint8), limits=Limits(max_frame_bytes=1000))
    # Many small items, none of which checks the size by itself, are refused too
    # (the peer would drop the connection, failing every call on it).
    with pytest.raises(ValueError, match="max_frame_bytes=1048576"):
        ser.encode([0.0] * 200_000, limits=Limits(max_frame_bytes=1 << 20))
    with pytest.raises(ValueError, match="max_ndim=2"):
        ser.encode(np.zeros((1, 1, 1)), limits=Limits(max_ndim=2))
    with pytest.raises(ValueError, match="max_depth"):
        Limits(max_depth=0)
    # exactly at the limit is fine
    enc = ser.encode(np.zeros(900, np.uint8), limits=Limits(max_frame_bytes=1000))
    assert enc.payload_len <= 1000


# ---- malformed frames ----------------------------------------------------------------

def frame(meta: bytes, oob: bytes = b"", *, kind=0, magic=b"RLRP", version=1, flags=0,
          meta_len=None, payload_len=None) -> bytes:
    ml = len(meta) if meta_len is None else meta_len
    pl = len(meta) + len(oob) if payload_len is None else payload_len
    return struct.pack("<4sBBHQQQ", magic, version, kind, flags, 0, ml, pl) + meta + oob


def test_header_checks():
    with pytest.raises(ProtocolError, match="bad frame magic"):
        loads(frame(b"\x00", magic=b"HTTP"))
    with pytest.raises(ProtocolError, match="version 9"):
        loads(frame(b"\x00", version=9))
    with pytest.raises(ProtocolError, match="flags"):
        loads(frame(b"\x00", flags=1))
    with pytest.raises(ProtocolError, match="exceeds max_frame_bytes"):
        ser.parse_header(frame(b"", payload_len=2**62)[:32])
    with pytest.raises(ProtocolError, match="meta_len"):
        ser.parse_header(frame(b"", meta_len=10, payload_len=5)[:32])
    with pytest.raises(ProtocolError, match="32 bytes"):
        loads(b"RLRP")


U32 = struct.Struct("<I").pack
U64 = struct.Struct("<Q").pack


@pytest.mark.parametrize("meta, oob, match", [
    (b"\x09" + U32(2**32 - 1), b"", "claims 4294967295 items"),           # list count bomb
    (b"\x0b" + U32(1000), b"\x00", "claims 1000 items"),                   # dict count bomb
    (b"\x06" + U64(2**40), b"", "exceeds max_bytes_len"),                  # huge str
    (b"\x06" + U64(5) + b"ab", b"", "truncated"),                          # short str
    (b"\x06" + U64(1) + b"\xff", b"", "UTF-8"),
    (b"\x0d\x03<f8\x02" + U64(2**31) + U64(2**31), b"", "needs .* bytes but only 0 remain"),
    (b"\x0c\x03<f8\x01" + U64(1000), b"\x00" * 8, "needs 8000 bytes but only 0 remain"),
    (b"\x0c\x03|O8\x01" + U64(1), b"", "not in the allowed list"),
    (b"\x0c\x03<f8\x01" + U64(2**64 - 1), b"", "dimension too large"),
    (b"\x0c\x03<f8\x40", b"", "max_ndim"),
    (b"\x7f", b"", "unknown value tag 0x7f"),
    (b"\x00\x00", b"", "trailing meta"),
    (b"\x00", b"xyz", "out-of-band bytes declared but not used"),
    (b"\x0b" + U32(1) + b"\x09" + U32(0) + b"\x00", b"", "not hashable"),
    (b"\x0f\x01\x00\x00", b"", "extension value"),
    (b"\x10" + U64(3) + b"abc", b"", "refused a pickled value"),
    (b"\x04" + U32(2**31), b"", "max_bytes_len"),
    (b"\x08" + U64(10), b"abc", "exceed the 3 out-of-band bytes"),
    (b"", b"", "truncated"),
])
def test_malformed_payloads(meta, oob, match):
    with pytest.raises(ProtocolError, match=match):
        loads(frame(meta, oob))


def test_depth_bomb_refused():
    meta = (b"\x09" + U32(1)) * 5000 + b"\x00"
    with pytest.raises(ProtocolError, match="max_depth=64"):
        loads(frame(meta))


def test_max_elements_on_decode():
    meta = b"\x09" + U32(20) + b"\x00" * 20
    assert loads(frame(meta)) == [None] * 20
    with pytest.raises(ProtocolError, match="max_elements=10"):
        loads(frame(meta), limits=Limits(max_elements=10))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_frames_fail_cleanly(data):
    value = data.draw(values)
    raw = bytearray(dumps(value, limits=Limits(oob_threshold=8)))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        loads(bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw))
    except ProtocolError:
        pass  # the only acceptable failure


# ---- zero-copy -----------------------------------------------------------------------

def test_encode_does_not_copy_large_arrays():
    arr = np.random.default_rng(0).random((64 << 20) // 8)  # 64 MiB of float64
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        enc = ser.encode({"x": arr, "meta": [1, 2, 3]})
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert enc.oob_bytes == arr.nbytes
    assert peak < 64 << 10, peak  # meta only, nothing near the array's size
    view = np.frombuffer(enc.buffers[0], dtype=np.uint8)
    assert np.shares_memory(view, arr)


def _recv_value(sock, limits=Limits(), timeout=30.0):
    head = bytearray(ser.HEADER_SIZE)
    deadline = time.monotonic() + timeout
    recv_exact_into(sock, memoryview(head), deadline=deadline)
    header = ser.parse_header(bytes(head), limits)
    return ser.decode_payload(header, lambda mv: recv_exact_into(sock, mv, deadline=deadline), limits=limits)


def test_socket_round_trip_is_zero_copy():
    size = 64 << 20
    arr = np.arange(size // 4, dtype=np.float32)
    a, b = socket.socketpair()
    try:
        a.settimeout(0.2)
        b.settimeout(0.2)
        enc = ser.encode([arr, "tag"])
        bufs = ser.encode_frame(2, 7, enc)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        t = threading.Thread(target=send_buffers, args=(a, bufs), kwargs={"deadline": time.monotonic() + 30})
        t.start()
        out = _recv_value(b)
        t.join(30)
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
    finally:
        a.close()
        b.close()
    assert out[1] == "tag" and out[0].dtype == np.float32
    assert np.array_equal(out[0], arr)
    # One receive buffer (the result itself) and no intermediate full-size copy
    # on either side: a concatenating sender or receiver would need >= 2x.
    assert size <= peak < 1.25 * size, peak / size


def test_many_buffers_and_partial_writes():
    # More out-of-band buffers than one sendmsg takes (IOV limit), bigger than the socket buffer.
    parts = [np.full(3000 + i, i, dtype=np.int32) for i in range(1500)]
    a, b = socket.socketpair()
    try:
        a.settimeout(0.2)
        b.settimeout(0.2)
        enc = ser.encode(parts, limits=Limits(oob_threshold=1))
        assert len(enc.buffers) == 1500
        t = threading.Thread(target=send_buffers, args=(a, ser.encode_frame(2, 1, enc)),
                             kwargs={"deadline": time.monotonic() + 30})
        t.start()
        out = _recv_value(b)
        t.join(30)
    finally:
        a.close()
        b.close()
    assert len(out) == 1500 and all(np.array_equal(x, y) for x, y in zip(out, parts))


def test_recv_errors():
    a, b = socket.socketpair()
    b.settimeout(0.05)
    a.sendall(b"RLRP")
    a.close()
    with pytest.raises(PeerClosedError, match="closed the connection"):
        recv_exact_into(b, memoryview(bytearray(32)), deadline=time.monotonic() + 5)
    b.close()
    a, b = socket.socketpair()
    b.settimeout(0.05)
    a.sendall(b"RLRP")  # a frame that stalls half-way
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="stalled.*4 of 32"):
        recv_exact_into(b, memoryview(bytearray(32)), deadline=time.monotonic() + 0.3, idle_ok=True)
    assert time.monotonic() - t0 < 3
    a.close()
    b.close()
