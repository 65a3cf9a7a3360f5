"""On-disk format: safetensors shard files, the JSON manifest, checksums, fsync.

A checkpoint is a directory::

    manifest.json              written last; JSON (never pickle)
    rank00000.safetensors      the pieces rank 0 wrote
    rank00001.safetensors      ...  (a rank with nothing to write has no file)

Each shard file is a standard safetensors file (8-byte little-endian header
length, JSON header padded with spaces to a multiple of 8, then the raw
little-endian tensor bytes back to back), so ``safetensors.safe_open`` reads
it.  Its tensors are named by their dotted state-dict key; a flat piece is
stored 1-D, a box piece with its box's shape.  ringlet writes the format
itself (rather than ``safetensors.numpy.save_file``) to stream each piece
from the caller's array without building the whole file in memory, to hash
while writing, and to support bfloat16 without a framework.

Checksums, all SHA-256, computed in one pass while writing:

* per piece, the digest of each ``chunk_bytes`` chunk of its bytes (the last
  chunk may be shorter).  ``load`` reads only the chunks covering the bytes it
  needs and verifies exactly those.
* per file, ``sha256_tree`` = SHA-256 of the file's header bytes (the 8-byte
  length and the JSON) followed by the raw 32-byte digests of every chunk of
  every piece in file order.  Pieces lie back to back after the header, so
  this covers every byte of the file, and it costs no second pass over the
  data (a plain file SHA-256 would double the hashing work of a save).
  ``verify()`` recomputes it, and on a mismatch names the damaged tensor.
* for the manifest, ``manifest_sha256`` inside it = SHA-256 of the manifest's
  canonical JSON without that field.  A manifest must be exactly the
  canonical JSON of what it parses to, so every byte is covered: damage
  anywhere (a value, a key, the layout) is a ``CheckpointError`` naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import SAFETENSORS_CODES
from ._region import Region, check_cover, numel
from .errors import CheckpointError

FORMAT = "ringlet-checkpoint"
VERSION = 2  # 2: the manifest carries manifest_sha256; 1 (without) still loads, with a warning
MANIFEST = "manifest.json"
MANIFEST_SHA = "manifest_sha256"
DEFAULT_CHUNK_BYTES = 4 << 20
WRITE_BLOCK = 16 << 20  # write() and hash() granularity when chunks are larger

_ST_CODES = SAFETENSORS_CODES  # numpy dtype name -> safetensors dtype code


def dtype_name(dtype: np.dtype, key: str) -> str:
    """The dtype's name if checkpoints support it, else TypeError naming ``key``."""
    dt = np.dtype(dtype)
    if dt.name not in _ST_CODES:
        raise TypeError(f"{key!r} has dtype {dt} which checkpoints do not support; supported: "
                        f"{', '.join(sorted(_ST_CODES))}")
    return dt.name


def shard_file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _as_bytes(arr: np.ndarray) -> np.ndarray:
    """The array's bytes, little-endian, C order, as a flat uint8 view (copy if needed)."""
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8)


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


def write_shard_file(path: str, pieces: Sequence[Tuple[str, np.ndarray, Tuple[int, ...]]],
                     chunk_bytes: int, rank: int) -> Dict[str, Any]:
    """Write a safetensors file holding ``pieces`` and fsync it.

    Args:
        pieces: (name, array, stored shape); the array's size must match the shape.
        chunk_bytes: granularity of the per-piece checksums.
    Returns:
        {"size", "sha256", "pieces": {name: {"offset", "nbytes", "chunks"}}} where
        ``offset`` is the absolute byte offset of the piece in the file.
    """
    header: Dict[str, Any] = {"__metadata__": {"format": FORMAT, "rank": str(rank)}}
    pos = 0
    for name, arr, shape in pieces:
        nbytes = arr.size * arr.dtype.itemsize
        header[name] = {"dtype": _ST_CODES[arr.dtype.name], "shape": list(shape),
                        "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)  # safetensors aligns the data start to 8 bytes
    head = struct.pack("<Q", len(hjson)) + hjson
    tree = hashlib.sha256(head)
    info: Dict[str, Any] = {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, memoryview(head))
        offset = len(head)
        for name, arr, _shape in pieces:
            raw = _as_bytes(arr)
            chunks = []
            for c0 in range(0, raw.size, chunk_bytes):
                chunk = raw[c0:c0 + chunk_bytes]
                chunk_hash = hashlib.sha256()
                # Huge chunks go out in blocks: the kernel copies each write()
                # into the page cache, and smaller blocks keep that cache-warm.
                for b0 in range(0, chunk.size, WRITE_BLOCK):
                    block = memoryview(chunk[b0:b0 + WRITE_BLOCK])
                    chunk_hash.update(block)
                    _write_all(fd, block)
                digest = chunk_hash.digest()
                tree.update(digest)
                chunks.append(digest.hex())
            info[name] = {"offset": offset, "nbytes": int(raw.size), "chunks": chunks}
            offset += raw.size
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": offset, "sha256_tree": tree.hexdigest(), "pieces": info}


# ---- reading ----------------------------------------------------------------------
def pread_into(fd: int, buf: np.ndarray, offset: int) -> int:
    """Fill ``buf`` (uint8, contiguous) from ``fd`` at ``offset``; returns bytes read.

    Short reads are retried; end of file before ``buf`` is full returns the
    count so far (the caller turns that into a "truncated" error).
    """
    mv = memoryview(buf).cast("B")
    got = 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


# ---- manifest -----------------------------------------------------------------------
def _canonical(m: Dict[str, Any]) -> bytes:
    return json.dumps(m, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"


def manifest_bytes(manifest: Dict[str, Any]) -> bytes:
    """The manifest's file contents: canonical JSON sealed with ``manifest_sha256``."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_SHA}
    body[MANIFEST_SHA] = hashlib.sha256(_canonical(body)).hexdigest()
    return _canonical(body)


def write_manifest(directory: str, manifest: Dict[str, Any]) -> None:
    data = manifest_bytes(manifest)
    path = os.path.join(directory, MANIFEST)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(directory: str) -> Dict[str, Any]:
    """Parse and sanity-check ``directory/manifest.json``; CheckpointError when damaged."""
    return read_manifest_digest(directory)[0]


def read_manifest_digest(directory: str, dir_fd: Optional[int] = None
                         ) -> Tuple[Dict[str, Any], str]:
    """``read_manifest``, with the SHA-256 of the file's bytes: equal on two ranks
    exactly when they read the same checkpoint (a version 1 manifest included,
    whose values need not survive a canonical dump: NaN).

    ``dir_fd``: an open descriptor of ``directory``; the manifest is then read
    from that directory even if a save has since renamed it away.
    """
    path = os.path.join(directory, MANIFEST)
    try:
        fd = os.open(path if dir_fd is None else MANIFEST,
                     os.O_RDONLY | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
        with open(fd, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint at {directory!r}: {path!r} does not exist") \
            from None
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint manifest {path!r} is corrupted: {exc}",
                              file=path) from exc
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a ringlet checkpoint manifest", file=path)
    version = m.get("version")
    if version not in (1, VERSION) or type(version) is not int:
        raise CheckpointError(f"{path!r} has format version {version!r}; this ringlet "
                              f"reads versions 1 and {VERSION}", file=path)
    if version == 1 and MANIFEST_SHA not in m:
        warnings.warn(f"checkpoint manifest {path!r} has format version 1, which carries no "
                      f"checksum: damage to it cannot be detected; saving again upgrades it",
                      RuntimeWarning, stacklevel=3)
    else:
        _check_seal(m, raw, path)
    for field, kind in (("tensors", dict), ("values", dict), ("files", dict),
                        ("chunk_bytes", int), ("world_size", int)):
        if not isinstance(m.get(field), kind):
            raise CheckpointError(f"checkpoint manifest {path!r} is corrupted: field {field!r} "
                                  f"is missing or malformed", file=path)
    if m["chunk_bytes"] < 64 or m["chunk_bytes"] % 64:
        raise CheckpointError(f"checkpoint manifest {path!r} is corrupted: bad chunk_bytes "
                              f"{m['chunk_bytes']}", file=path)
    bad = _manifest_entries_error(m)
    if bad:
        raise CheckpointError(f"checkpoint manifest {path!r} is corrupted: {bad}", file=path)
    return m, hashlib.sha256(raw).hexdigest()


def _check_seal(m: Dict[str, Any], raw: bytes, path: str) -> None:
    """CheckpointError unless ``raw`` is exactly the sealed canonical form of ``m``."""
    digest = m.pop(MANIFEST_SHA, None)
    if not isinstance(digest, str):
        raise CheckpointError(f"checkpoint manifest {path!r} is corrupted: its checksum "
                              f"{MANIFEST_SHA!r} is missing or malformed", file=path)
    try:
        canonical = _canonical(m)
    except ValueError as exc:  # NaN/inf where the writer never puts them
        raise CheckpointError(f"checkpoint manifest {path!r} is corrupted: {exc}",
                              file=path) from exc
    if hashlib.sha256(canonical).hexdigest() != digest or \
            raw != _canonical(dict(m, **{MANIFEST_SHA: digest})):
        raise CheckpointError(f"checkpoint manifest {path!r} is corrupted: checksum mismatch "
                              f"(it was edited or damaged after the save)", file=path)


def _nat(v: Any) -> bool:
    return type(v) is int and v >= 0


def _name_in(v: Any, names: Dict[str, Any]) -> bool:
    return isinstance(v, str) and v in names


def _nats(v: Any) -> bool:
    return isinstance(v, list) and all(map(_nat, v))


def _region_ok(p: Dict[str, Any], t: Dict[str, Any]) -> bool:
    """A piece covers a box (offsets, lengths per dimension) or a flat range, not
    both, inside the tensor."""
    box, flat = p.get("box"), p.get("flat")
    if ("box" in p) == ("flat" in p):
        return False
    if isinstance(box, dict):
        return (_nats(box.get("offsets")) and _nats(box.get("lengths"))
                and len(box["offsets"]) == len(box["lengths"]) == len(t["shape"])
                and all(o + n <= d for o, n, d in zip(box["offsets"], box["lengths"],
                                                      t["shape"])))
    return (_nats(flat) and len(flat) == 2 and flat[0] <= flat[1]
            and flat[1] <= numel(t["shape"]))


def _cover_error(key: str, t: Dict[str, Any]) -> str:
    """Whether a tensor's pieces tile it exactly (a load checks only what it copies,
    and overlapping pieces could hide a hole from that count)."""
    shape = tuple(t["shape"])
    items = []
    for p in t["pieces"]:
        if "flat" in p:
            reg = Region((0,) * len(shape), shape, *p["flat"])
        else:
            reg = Region.whole_box(p["box"]["offsets"], p["box"]["lengths"])
        if reg.size:
            items.append((p.get("rank"), reg))
    try:
        check_cover(key, shape, items)
    except ValueError as exc:
        return f"its pieces do not tile tensor {key!r}: {exc}"
    return ""


def _manifest_entries_error(m: Dict[str, Any]) -> str:
    """What is malformed in the manifest's file and tensor entries ('' when nothing).

    The readers index these entries freely, so their shape is checked once
    here: a damaged manifest is a CheckpointError, never a KeyError or a
    TypeError, and a file name cannot point outside the checkpoint directory.
    """
    for name, meta in m["files"].items():
        if not (name and os.path.basename(name) == name and name not in (".", "..")):
            return f"file name {name!r} is not a plain file name"
        if not (isinstance(meta, dict) and _nat(meta.get("size")) and meta["size"] < 1 << 63
                and isinstance(meta.get("sha256_tree"), str)):
            return f"entry of file {name!r} is malformed"
    for key, t in m["tensors"].items():
        if not (isinstance(t, dict) and _name_in(t.get("dtype"), _ST_CODES) and _nats(t.get("shape"))
                and isinstance(t.get("pieces"), list)):
            return f"entry of tensor {key!r} is malformed"
        for p in t["pieces"]:
            if not (isinstance(p, dict) and _name_in(p.get("file"), m["files"])
                    and _nat(p.get("offset")) and _nat(p.get("nbytes"))
                    and isinstance(p.get("chunks"), list)
                    and all(isinstance(c, str) for c in p["chunks"]) and _region_ok(p, t)):
                return f"a piece of tensor {key!r} is malformed"
            # Within its file: an offset past any file is no read, and past 2^63 no C long.
            if p["offset"] + p["nbytes"] > m["files"][p["file"]]["size"]:
                return (f"a piece of tensor {key!r} lies beyond the end of file {p['file']!r} "
                        f"(offset {p['offset']} + {p['nbytes']} bytes > "
                        f"{m['files'][p['file']]['size']})")
        bad = _cover_error(key, t)
        if bad:
            return bad
    return ""


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def chunk_hash_ok(data: np.ndarray, expected: str) -> bool:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest() == expected
