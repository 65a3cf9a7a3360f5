"""The object codec: bounded, documented, pickle-free by default.

RPC frames, ``broadcast_object``/``all_gather_object`` and the store's
structured values all use it (``ringlet.rpc.serialization`` re-exports it).

A *frame* is one message on an RPC connection::

    header (32 bytes) | meta (meta_len bytes) | out-of-band data (payload_len - meta_len bytes)

The header is ``struct "<4sBBHQQQ"``: magic ``b"RLRP"``, format version (1),
message kind, flags (must be 0), request id, ``meta_len``, ``payload_len``.
``meta`` is a tag-length-value tree describing the value; large numpy arrays
and large ``bytes`` are not copied into it but travel after it, in the order
they appear in the tree ("out-of-band"), so the sender can hand the array's
own buffer to ``sendmsg`` and the receiver can read straight into a fresh
``np.empty``.  The full specification, with every tag, is in ``docs/rpc.md``.

Every length and count a peer sends is checked against :class:`Limits` and
against the bytes the frame actually declares *before* anything is allocated,
so a malformed or hostile frame costs at most ``max_frame_bytes`` of memory
and raises :class:`ringlet.errors.ProtocolError`.

Pickle is never used unless the caller passes ``allow_pickle=True``; a
receiver that did not opt in refuses a pickled value without unpickling it.

Example::

    >>> import numpy as np
    >>> from ringlet._wire.codec import dumps, loads
    >>> out = loads(dumps({"w": np.arange(3.0), "step": 7}))
    >>> out["step"], out["w"].tolist()
    (7, [0.0, 1.0, 2.0])
"""

from __future__ import annotations

import math
import pickle
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ringlet._dtypes import CODEC_DTYPES
from ringlet.errors import ProtocolError

__all__ = [
    "Limits",
    "Encoded",
    "Header",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "ALLOWED_DTYPES",
    "encode",
    "encode_frame",
    "parse_header",
    "decode_payload",
    "dumps",
    "loads",
]

MAGIC = b"RLRP"
VERSION = 1
_HEADER = struct.Struct("<4sBBHQQQ")
HEADER_SIZE = _HEADER.size  # 32

# Value tags (one byte each); see docs/rpc.md for the layout that follows each.
T_NONE = 0x00
T_FALSE = 0x01
T_TRUE = 0x02
T_INT64 = 0x03
T_BIGINT = 0x04
T_FLOAT = 0x05
T_STR = 0x06
T_BYTES = 0x07
T_BYTES_OOB = 0x08
T_LIST = 0x09
T_TUPLE = 0x0A
T_DICT = 0x0B
T_ARRAY = 0x0C
T_ARRAY_OOB = 0x0D
T_NPSCALAR = 0x0E
T_EXT = 0x0F
T_PICKLE = 0x10
T_COMPLEX = 0x11

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_TAG_U32 = struct.Struct("<BI")
_TAG_U64 = struct.Struct("<BQ")
_TAG_I64 = struct.Struct("<Bq")
_TAG_F64 = struct.Struct("<Bd")

# Numeric and bool dtypes only (the registry's codec column), always
# little-endian on the wire ("|" for one-byte types).  Object, string, void and
# datetime dtypes are refused: they either hold pointers or need pickle.
ALLOWED_DTYPES = CODEC_DTYPES
_DTYPES = {s: np.dtype(s) for s in ALLOWED_DTYPES}

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_MAX_DIM = (1 << 63) - 1


@dataclass(frozen=True)
class Limits:
    """Bounds a frame must respect; checked on encode and, before allocating, on decode.

    Args:
        max_frame_bytes: largest payload (meta + out-of-band data) of one frame.
        max_depth: deepest nesting of containers (a list in a list is depth 2).
        max_elements: most container items (list/tuple items, dict entries,
            extension values) in one frame, summed over the whole value.
        max_bytes_len: longest single str (UTF-8 bytes), bytes, big int or
            pickle blob.
        max_ndim: most dimensions of one array.
        oob_threshold: arrays and bytes of at least this many bytes are sent
            out-of-band (zero-copy); smaller ones are copied into the meta.
            Affects only the sender.

    Raises:
        ValueError: a limit is not a positive integer.
    """

    max_frame_bytes: int = 1 << 30
    max_depth: int = 64
    max_elements: int = 1 << 22
    max_bytes_len: int = 1 << 30
    max_ndim: int = 32
    oob_threshold: int = 1 << 16

    def __post_init__(self) -> None:
        for field in ("max_frame_bytes", "max_depth", "max_elements", "max_bytes_len", "max_ndim"):
            v = getattr(self, field)
            if type(v) is not int or v <= 0:
                raise ValueError(f"Limits.{field} must be a positive int, got {v!r}")
        if type(self.oob_threshold) is not int or self.oob_threshold < 0:
            raise ValueError(f"Limits.oob_threshold must be an int >= 0, got {self.oob_threshold!r}")
        if self.max_ndim > 255:
            raise ValueError(f"Limits.max_ndim must be <= 255 (one byte on the wire), got {self.max_ndim}")


DEFAULT_LIMITS = Limits()

# Hook types.  An extension encoder maps an otherwise unsupported object to
# (code, plain value) or returns None; the decoder maps it back.
ExtEncode = Callable[[Any], Optional[Tuple[int, Any]]]
ExtDecode = Callable[[int, Any], Any]


@dataclass
class Encoded:
    """An encoded value: ``meta`` plus out-of-band buffers, ready for ``sendmsg``.

    ``buffers`` are memoryviews of the caller's own arrays/bytes (not copies),
    so they must not be modified until the frame has been sent.
    """

    meta: bytearray
    buffers: List[memoryview]
    oob_bytes: int

    @property
    def payload_len(self) -> int:
        return len(self.meta) + self.oob_bytes


class _EncodeError(Exception):
    """Internal: carries the path to the offending element while unwinding."""

    def __init__(self, exc_type: type, message: str) -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.message = message
        self.path: List[str] = []


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _wire_array(arr: np.ndarray) -> np.ndarray:
    """The array as it goes on the wire: C-contiguous, little-endian, whitelisted dtype."""
    if type(arr) is not np.ndarray:
        arr = np.asarray(arr)  # subclasses (memmap, matrix) travel as plain arrays
    dt = arr.dtype
    if dt.str not in ALLOWED_DTYPES:
        swapped = dt.newbyteorder("<")
        if dt.byteorder == ">" and swapped.str in ALLOWED_DTYPES:
            arr = arr.astype(swapped)
        else:
            raise _EncodeError(
                TypeError,
                f"numpy dtype {dt} is not supported (allowed: bool, int8-64, uint8-64, "
                "float16/32/64, complex64/128)",
            )
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


class _Encoder:
    __slots__ = ("out", "buffers", "oob", "limits", "allow_pickle", "ext", "elements")

    def __init__(self, limits: Limits, allow_pickle: bool, ext: Optional[ExtEncode]) -> None:
        self.out = bytearray()
        self.buffers: List[memoryview] = []
        self.oob = 0
        self.limits = limits
        self.allow_pickle = allow_pickle
        self.ext = ext
        self.elements = 0

    def _check_size(self) -> None:
        total = len(self.out) + self.oob
        if total > self.limits.max_frame_bytes:
            raise _EncodeError(
                ValueError,
                f"value too large to send: more than {_human(total)} exceeds "
                f"max_frame_bytes={self.limits.max_frame_bytes} ({_human(self.limits.max_frame_bytes)})",
            )

    def _count(self, n: int) -> None:
        self.elements += n
        if self.elements > self.limits.max_elements:
            raise _EncodeError(
                ValueError,
                f"value has more than max_elements={self.limits.max_elements} container items",
            )

    def _blob(self, what: str, n: int) -> None:
        if n > self.limits.max_bytes_len:
            raise _EncodeError(
                ValueError, f"{what} of {n} bytes exceeds max_bytes_len={self.limits.max_bytes_len}"
            )

    def add(self, obj: Any, depth: int) -> None:
        out = self.out
        t = type(obj)
        if obj is None:
            out.append(T_NONE)
        elif t is bool:
            out.append(T_TRUE if obj else T_FALSE)
        elif t is int:
            if _INT64_MIN <= obj <= _INT64_MAX:
                out += _TAG_I64.pack(T_INT64, obj)
            else:
                n = (obj.bit_length() + 8) // 8  # +1 bit for the sign
                self._blob("int", n)
                out += _TAG_U32.pack(T_BIGINT, n)
                out += obj.to_bytes(n, "little", signed=True)
                self._check_size()
        elif t is float:
            out += _TAG_F64.pack(T_FLOAT, obj)
        elif t is str:
            data = obj.encode("utf-8", "surrogatepass")
            self._blob("str", len(data))
            out += _TAG_U64.pack(T_STR, len(data))
            out += data
            self._check_size()
        elif t is bytes or t is bytearray or t is memoryview:
            self._add_bytes(obj)
        elif t is list or t is tuple:
            if depth >= self.limits.max_depth:
                raise _EncodeError(
                    ValueError,
                    f"value nested deeper than max_depth={self.limits.max_depth} (or it contains a cycle)",
                )
            self._count(len(obj))
            out += _TAG_U32.pack(T_LIST if t is list else T_TUPLE, len(obj))
            for i, item in enumerate(obj):
                try:
                    self.add(item, depth + 1)
                except _EncodeError as e:
                    e.path.append(f"[{i}]")
                    raise
        elif t is dict:
            if depth >= self.limits.max_depth:
                raise _EncodeError(
                    ValueError,
                    f"value nested deeper than max_depth={self.limits.max_depth} (or it contains a cycle)",
                )
            self._count(len(obj))
            out += _TAG_U32.pack(T_DICT, len(obj))
            for k, v in obj.items():
                try:
                    self.add(k, depth + 1)
                except _EncodeError as e:
                    e.path.append(f"<key {k!r}>")
                    raise
                try:
                    self.add(v, depth + 1)
                except _EncodeError as e:
                    e.path.append(f"[{k!r}]")
                    raise
        elif isinstance(obj, np.ndarray):
            self._add_array(obj)
        elif isinstance(obj, np.generic) and obj.dtype.str in ALLOWED_DTYPES:
            ds = obj.dtype.str.encode("ascii")
            out.append(T_NPSCALAR)
            out.append(len(ds))
            out += ds
            out += np.asarray(obj).tobytes()
        elif t is complex:
            out.append(T_COMPLEX)
            out += _C128.pack(obj.real, obj.imag)
        else:
            self._add_other(obj, depth)

    def _add_bytes(self, obj: Any) -> None:
        mv = memoryview(obj)
        if not mv.c_contiguous or mv.format != "B" or mv.ndim != 1:
            mv = memoryview(mv.tobytes())
        n = mv.nbytes
        self._blob("bytes", n)
        if n >= self.limits.oob_threshold and n > 0:
            self.out += _TAG_U64.pack(T_BYTES_OOB, n)
            self.buffers.append(mv)
            self.oob += n
        else:
            self.out += _TAG_U64.pack(T_BYTES, n)
            self.out += mv
        self._check_size()

    def _add_array(self, obj: np.ndarray) -> None:
        arr = _wire_array(obj)
        if arr.ndim > self.limits.max_ndim:
            raise _EncodeError(ValueError, f"array has {arr.ndim} dimensions, more than max_ndim={self.limits.max_ndim}")
        ds = arr.dtype.str.encode("ascii")
        nbytes = arr.nbytes
        oob = nbytes >= self.limits.oob_threshold and nbytes > 0
        out = self.out
        out.append(T_ARRAY_OOB if oob else T_ARRAY)
        out.append(len(ds))
        out += ds
        out.append(arr.ndim)
        for d in arr.shape:
            out += _U64.pack(d)
        if oob:
            # A flat uint8 view of the array's own memory: no copy is made.
            self.buffers.append(memoryview(arr.reshape(-1).view(np.uint8)))
            self.oob += nbytes
        else:
            out += arr.tobytes()
        self._check_size()

    def _add_other(self, obj: Any, depth: int) -> None:
        if self.ext is not None:
            res = self.ext(obj)
            if res is not None:
                code, value = res
                if depth >= self.limits.max_depth:
                    raise _EncodeError(ValueError, f"value nested deeper than max_depth={self.limits.max_depth}")
                self._count(1)
                self.out += _U8.pack(T_EXT) + _U16.pack(code)
                self.add(value, depth + 1)
                return
        if self.allow_pickle:
            try:
                data = pickle.dumps(obj, protocol=5)
            except Exception as e:  # any pickling failure is the user's type's problem
                raise _EncodeError(TypeError, f"cannot pickle object of type {type(obj).__qualname__}: {e}") from None
            self._blob("pickled object", len(data))
            self.out += _TAG_U64.pack(T_PICKLE, len(data))
            self.out += data
            self._check_size()
            return
        raise _EncodeError(
            TypeError,
            f"cannot send object of type {type(obj).__module__}.{type(obj).__qualname__}: supported are "
            "None, bool, int, float, complex, str, bytes, list, tuple, dict, numpy arrays and scalars "
            "of numeric/bool dtype (and RRefs); pass allow_pickle=True to init_rpc on every rank "
            "to send other objects with pickle",
        )


def encode(
    value: Any,
    *,
    limits: Limits = DEFAULT_LIMITS,
    allow_pickle: bool = False,
    ext_encode: Optional[ExtEncode] = None,
    what: str = "value",
    top_names: Optional[Dict[int, str]] = None,
) -> Encoded:
    """Encode ``value`` into meta bytes plus zero-copy out-of-band buffers.

    Args:
        value: the object to encode (see the module docstring for types).
        limits: bounds to enforce; the receiver's limits should be used so an
            oversized value fails here, before anything is sent.
        allow_pickle: fall back to pickle for unsupported types.
        ext_encode: hook for extension types (used for RRefs).
        what: name of the value in error messages (e.g. ``"args"``).
        top_names: names for the items of a top-level list in error paths
            (``{1: "args"}`` reports ``args[0]`` instead of ``value[1][0]``).

    Returns:
        An :class:`Encoded`.

    Raises:
        TypeError: an element has an unsupported type (the message gives its path).
        ValueError: a limit is exceeded (depth, elements, string length, frame size).
    """
    enc = _Encoder(limits, allow_pickle, ext_encode)
    try:
        enc.add(value, 0)
        # Small items (floats, ints, None) check no size as they go: the
        # whole frame is checked once here, before anything is sent.
        enc._check_size()
    except _EncodeError as e:
        parts = list(reversed(e.path))
        if len(parts) > 12:  # deep paths (cycles) would flood the message
            parts = parts[:6] + [f"...({len(parts) - 9} more)..."] + parts[-3:]
        if top_names and parts and parts[0].startswith("[") and parts[0][1:-1].isdigit() \
                and int(parts[0][1:-1]) in top_names:
            path = top_names[int(parts[0][1:-1])] + "".join(parts[1:])
        else:
            path = what + "".join(parts)
        raise e.exc_type(f"{path}: {e.message}") from None
    except RecursionError:
        raise ValueError(f"{what}: nested too deeply to encode") from None
    return Encoded(enc.out, enc.buffers, enc.oob)


def encode_frame(kind: int, req_id: int, encoded: Encoded) -> List[Any]:
    """The buffers of one frame (header+meta first, then out-of-band data), for ``sendmsg``."""
    head = bytearray(_HEADER.pack(MAGIC, VERSION, kind, 0, req_id, len(encoded.meta), encoded.payload_len))
    head += encoded.meta
    return [head, *encoded.buffers]


@dataclass(frozen=True)
class Header:
    kind: int
    flags: int
    req_id: int
    meta_len: int
    payload_len: int


def parse_header(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Parse and validate a 32-byte frame header.

    Raises:
        ProtocolError: bad magic/version/flags, or the declared sizes exceed
            ``limits.max_frame_bytes`` or are inconsistent.
    """
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"frame header must be {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, kind, flags, req_id, meta_len, payload_len = _HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r} (expected {MAGIC!r}): not an RPC frame")
    if version != VERSION:
        raise ProtocolError(f"unsupported RPC frame version {version} (this build speaks {VERSION})")
    if flags != 0:
        raise ProtocolError(f"unknown frame flags 0x{flags:04x}")
    if payload_len > limits.max_frame_bytes:
        raise ProtocolError(
            f"frame payload of {payload_len} bytes ({_human(payload_len)}) exceeds "
            f"max_frame_bytes={limits.max_frame_bytes}"
        )
    if meta_len > payload_len:
        raise ProtocolError(f"frame meta_len {meta_len} is larger than payload_len {payload_len}")
    return Header(kind, flags, req_id, meta_len, payload_len)


ReadInto = Callable[[memoryview], None]
ReadBytes = Callable[[int], bytes]


class _Decoder:
    __slots__ = ("meta", "pos", "limits", "allow_pickle", "ext", "read_oob", "read_bytes",
                 "oob_left", "elements")

    def __init__(
        self,
        meta: memoryview,
        oob_len: int,
        read_oob: Optional[ReadInto],
        limits: Limits,
        allow_pickle: bool,
        ext: Optional[ExtDecode],
        read_bytes: Optional[ReadBytes] = None,
    ) -> None:
        self.meta = meta
        self.pos = 0
        self.limits = limits
        self.allow_pickle = allow_pickle
        self.ext = ext
        self.read_oob = read_oob
        self.read_bytes = read_bytes
        self.oob_left = oob_len
        self.elements = 0

    def _take(self, n: int) -> memoryview:
        p = self.pos
        if n > len(self.meta) - p:
            raise ProtocolError(f"truncated frame: needs {n} more meta bytes at offset {p}, has {len(self.meta) - p}")
        self.pos = p + n
        return self.meta[p : p + n]

    def _unpack(self, st: struct.Struct) -> Any:
        p = self.pos
        if st.size > len(self.meta) - p:
            raise ProtocolError(f"truncated frame at meta offset {p}")
        self.pos = p + st.size
        return st.unpack_from(self.meta, p)[0]

    def _blob_len(self, what: str) -> int:
        n = self._unpack(_U64)
        if n > self.limits.max_bytes_len:
            raise ProtocolError(f"{what} of {n} bytes exceeds max_bytes_len={self.limits.max_bytes_len}")
        return n

    def _count(self, n: int) -> None:
        # Each item takes at least one meta byte, so a count larger than the
        # remaining meta is a lie; checked before any list is grown.
        if n > len(self.meta) - self.pos:
            raise ProtocolError(f"container claims {n} items but only {len(self.meta) - self.pos} meta bytes remain")
        self.elements += n
        if self.elements > self.limits.max_elements:
            raise ProtocolError(f"frame has more than max_elements={self.limits.max_elements} container items")

    def _oob_into(self, mv: memoryview) -> None:
        n = mv.nbytes
        if n > self.oob_left:
            raise ProtocolError(
                f"out-of-band item of {n} bytes exceeds the {self.oob_left} bytes left in the frame"
            )
        self.oob_left -= n
        if n:
            assert self.read_oob is not None
            self.read_oob(mv)

    def _dtype(self) -> np.dtype:
        n = self._unpack(_U8)
        raw = bytes(self._take(n))
        try:
            s = raw.decode("ascii")
        except UnicodeDecodeError:
            s = None
        if s not in _DTYPES:
            raise ProtocolError(f"array dtype {raw!r} is not in the allowed list {sorted(ALLOWED_DTYPES)}")
        return _DTYPES[s]

    def value(self, depth: int) -> Any:
        tag = self._unpack(_U8)
        if tag == T_INT64:
            return self._unpack(_I64)
        if tag == T_STR:
            n = self._blob_len("str")
            try:
                return str(self._take(n), "utf-8", "surrogatepass")
            except UnicodeDecodeError as e:
                raise ProtocolError(f"str is not valid UTF-8: {e}") from None
        if tag == T_NONE:
            return None
        if tag == T_TRUE:
            return True
        if tag == T_FALSE:
            return False
        if tag == T_FLOAT:
            return self._unpack(_F64)
        if tag == T_LIST or tag == T_TUPLE:
            if depth >= self.limits.max_depth:
                raise ProtocolError(f"frame nested deeper than max_depth={self.limits.max_depth}")
            n = self._unpack(_U32)
            self._count(n)
            items = [self.value(depth + 1) for _ in range(n)]
            return items if tag == T_LIST else tuple(items)
        if tag == T_DICT:
            if depth >= self.limits.max_depth:
                raise ProtocolError(f"frame nested deeper than max_depth={self.limits.max_depth}")
            n = self._unpack(_U32)
            self._count(n)
            d = {}
            for _ in range(n):
                k = self.value(depth + 1)
                v = self.value(depth + 1)
                try:
                    d[k] = v
                except TypeError:
                    raise ProtocolError(f"dict key of type {type(k).__name__} is not hashable") from None
            return d
        if tag == T_BYTES:
            n = self._blob_len("bytes")
            return bytes(self._take(n))
        if tag == T_BYTES_OOB:
            n = self._blob_len("bytes")
            if n > self.oob_left:
                raise ProtocolError(f"bytes of {n} bytes exceed the {self.oob_left} out-of-band bytes left")
            if self.read_bytes is not None:
                # Straight into the bytes object returned: not a buffer, then a copy of it.
                self.oob_left -= n
                return self.read_bytes(n)
            buf = bytearray(n)
            self._oob_into(memoryview(buf))
            return bytes(buf)
        if tag == T_ARRAY or tag == T_ARRAY_OOB:
            return self._array(tag == T_ARRAY_OOB)
        if tag == T_NPSCALAR:
            dt = self._dtype()
            return np.frombuffer(self._take(dt.itemsize), dtype=dt)[0].copy()
        if tag == T_BIGINT:
            n = self._unpack(_U32)
            if n > self.limits.max_bytes_len:
                raise ProtocolError(f"int of {n} bytes exceeds max_bytes_len={self.limits.max_bytes_len}")
            return int.from_bytes(self._take(n), "little", signed=True)
        if tag == T_COMPLEX:
            p = self.pos
            self._take(_C128.size)
            re, im = _C128.unpack_from(self.meta, p)
            return complex(re, im)
        if tag == T_EXT:
            if depth >= self.limits.max_depth:
                raise ProtocolError(f"frame nested deeper than max_depth={self.limits.max_depth}")
            code = self._unpack(_U16)
            self._count(1)
            inner = self.value(depth + 1)
            if self.ext is None:
                raise ProtocolError(f"frame holds an extension value (code {code}) but none is expected here")
            return self.ext(code, inner)
        if tag == T_PICKLE:
            n = self._blob_len("pickled object")
            if not self.allow_pickle:
                raise ProtocolError(
                    "refused a pickled value: this worker did not opt in "
                    "(init_rpc(..., allow_pickle=True) on every rank enables pickle)"
                )
            data = bytes(self._take(n))
            try:
                return pickle.loads(data)
            except Exception as e:
                raise ProtocolError(f"could not unpickle value: {type(e).__name__}: {e}") from None
        raise ProtocolError(f"unknown value tag 0x{tag:02x} at meta offset {self.pos - 1}")

    def _array(self, oob: bool) -> np.ndarray:
        dt = self._dtype()
        ndim = self._unpack(_U8)
        if ndim > self.limits.max_ndim:
            raise ProtocolError(f"array has {ndim} dimensions, more than max_ndim={self.limits.max_ndim}")
        shape = tuple(self._unpack(_U64) for _ in range(ndim))
        if any(d > _MAX_DIM for d in shape):
            raise ProtocolError(f"array dimension too large in shape {shape}")
        nbytes = math.prod(shape) * dt.itemsize
        # Size is checked against what the frame really carries before np.empty.
        budget = self.oob_left if oob else len(self.meta) - self.pos
        if nbytes > budget:
            raise ProtocolError(
                f"array of shape {shape} dtype {dt} needs {nbytes} bytes but only {budget} remain in the frame"
            )
        if oob and nbytes == 0:
            raise ProtocolError("empty array sent out-of-band")
        try:
            arr = np.empty(shape, dtype=dt)
        except (ValueError, MemoryError) as e:
            raise ProtocolError(f"cannot allocate array of shape {shape}: {e}") from None
        if nbytes == 0:
            return arr
        flat = memoryview(arr.reshape(-1).view(np.uint8))
        if oob:
            self._oob_into(flat)
        else:
            flat[:] = self._take(nbytes)
        return arr


def decode_payload(
    header: Header,
    read_into: ReadInto,
    *,
    limits: Limits = DEFAULT_LIMITS,
    allow_pickle: bool = False,
    ext_decode: Optional[ExtDecode] = None,
    read_bytes: Optional[ReadBytes] = None,
) -> Any:
    """Read and decode the payload that follows ``header``.

    Args:
        header: from :func:`parse_header` (already checked against ``limits``).
        read_into: fills a memoryview completely from the stream, or raises.
            Called once for the meta, then once per out-of-band item, in order,
            straight into the destination array (no intermediate copy).
        limits: the receiver's limits.
        allow_pickle: accept pickled values.
        ext_decode: hook turning extension values back into objects.
        read_bytes: optional; returns the next ``n`` bytes of the stream as one
            ``bytes`` object (e.g. ``_wire.stream.recv_exact``).  Out-of-band
            ``bytes`` values are then read with it, received in place, instead
            of through ``read_into`` and a copy.

    Returns:
        The decoded value.

    Raises:
        ProtocolError: the payload is malformed or breaks a limit; the stream
            is then out of sync and the connection must be dropped.
    """
    meta = bytearray(header.meta_len)
    if header.meta_len:
        read_into(memoryview(meta))
    return _decode(memoryview(meta), header, read_into, read_bytes, limits, allow_pickle,
                   ext_decode)


def _decode(meta: memoryview, header: Header, read_into: ReadInto, read_bytes: Optional[ReadBytes],
            limits: Limits, allow_pickle: bool, ext_decode: Optional[ExtDecode]) -> Any:
    dec = _Decoder(meta, header.payload_len - header.meta_len, read_into, limits, allow_pickle,
                   ext_decode, read_bytes)
    try:
        value = dec.value(0)
    except RecursionError:
        raise ProtocolError("frame nested too deeply to decode") from None
    if dec.pos != len(meta):
        raise ProtocolError(f"{len(meta) - dec.pos} trailing meta bytes after the value")
    if dec.oob_left:
        raise ProtocolError(f"{dec.oob_left} out-of-band bytes declared but not used by the value")
    return value


def dumps(value: Any, *, kind: int = 0, req_id: int = 0, limits: Limits = DEFAULT_LIMITS, allow_pickle: bool = False) -> bytes:
    """Encode ``value`` as one complete frame in a single bytes object (one copy of the data).

    Raises:
        TypeError, ValueError: as :func:`encode`.
    """
    # join takes the out-of-band memoryviews as they are: each byte is copied once.
    return b"".join(encode_frame(kind, req_id, encode(value, limits=limits, allow_pickle=allow_pickle)))


def loads(data: Any, *, limits: Limits = DEFAULT_LIMITS, allow_pickle: bool = False) -> Any:
    """Decode one complete frame produced by :func:`dumps` (or received whole).

    Raises:
        ProtocolError: malformed frame, limit exceeded, or trailing bytes.
    """
    mv = memoryview(data).cast("B")
    header = parse_header(bytes(mv[:HEADER_SIZE]), limits)
    if len(mv) != HEADER_SIZE + header.payload_len:
        raise ProtocolError(f"frame declares {HEADER_SIZE + header.payload_len} bytes but {len(mv)} were given")
    pos = HEADER_SIZE + header.meta_len

    def read_into(dst: memoryview) -> None:
        nonlocal pos
        n = dst.nbytes
        dst.cast("B")[:] = mv[pos : pos + n]
        pos += n

    def read_bytes(n: int) -> bytes:
        nonlocal pos
        pos += n
        return bytes(mv[pos - n : pos])

    # The meta is decoded where it lies, and each value copied out of the frame once.
    meta = mv[HEADER_SIZE : HEADER_SIZE + header.meta_len]
    return _decode(meta, header, read_into, read_bytes, limits, allow_pickle, None)
