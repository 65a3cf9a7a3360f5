"""``load``: fill a template state dict in place, resharding to its layout.

Each rank reads only what its template needs.  For every tensor key it
intersects the region its template holds (the whole tensor, a box, or a flat
range) with every saved piece (``_region``); for each saved piece it
overlaps, it reads the contiguous byte span from the first to the last
needed byte, widened to the piece's checksum chunks, verifies those chunks'
SHA-256, and copies the overlap straight into the template's array.  Spans
are read in windows of at most ``WINDOW_BYTES``, so memory stays bounded
for huge pieces.

Two agreement collectives (``_comm.agree``) bracket the local work: one after
reading the manifest, checking the template against it (key sets, dtypes,
shapes) and opening the shard files, and one after reading, so an error on
any rank raises on every rank.

Loading while another job saves to the same path: each rank opens the
directory, its manifest and every shard file it needs before reading data,
so it reads one committed checkpoint even if a save replaces it meanwhile.
A commit that lands before the files are open, or between two ranks' opens,
makes the load open the new one (up to ``_OPEN_ATTEMPTS`` times), never a
"corrupted" error or a mix of two saves.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import commit as _commit
from . import format as _fmt
from ._comm import Comm, agree, describe
from ._region import Region, intersect, numel, overlaps, view
from ._state import decode_value, flatten, rebuild
from .errors import CheckpointError
from .save import _check_path
from .shard import ShardedTensor

__all__ = ["load", "LoadResult", "verify"]

WINDOW_BYTES = 64 << 20
# Opens of one load that a save committing to the same path may spoil before it gives up.
_OPEN_ATTEMPTS = 3


class LoadResult:
    """What ``load`` returns.

    Attributes:
        state_dict: the template's structure with its arrays (the same
            objects, now filled) and every plain value replaced by the
            checkpoint's.
        missing_keys: this rank's template keys the checkpoint lacks (left as
            they were); always empty when ``strict``.
        unexpected_keys: checkpoint keys no rank's template asked for; always
            empty when ``strict``.
        bytes_read: bytes this rank read from shard files.
        directory: the directory actually read (``path``, or the previous
            checkpoint that a crashed commit had moved aside).
    """

    def __init__(self, state_dict: dict, missing_keys: List[str], unexpected_keys: List[str],
                 bytes_read: int, directory: str) -> None:
        self.state_dict = state_dict
        self.missing_keys = missing_keys
        self.unexpected_keys = unexpected_keys
        self.bytes_read = bytes_read
        self.directory = directory

    def __repr__(self) -> str:
        return (f"LoadResult(keys={len(self.state_dict)}, missing={self.missing_keys}, "
                f"unexpected={self.unexpected_keys}, bytes_read={self.bytes_read})")


def _dest(key: str, leaf: Any) -> Tuple[Region, np.ndarray, Tuple[int, ...]]:
    """(region held, storage, global shape) of a template tensor; ValueError if unusable."""
    if isinstance(leaf, ShardedTensor):
        arr, spec = leaf.local, leaf.spec
        shape = spec.global_shape
        region = spec.region()
        if spec.is_flat and not arr.flags.c_contiguous:
            raise ValueError(f"template {key!r}: a flat shard's local array must be "
                             f"C-contiguous to be filled in place")
    else:
        arr = leaf
        shape = tuple(arr.shape)
        region = Region.whole_box((0,) * arr.ndim, shape)
    if not arr.flags.writeable:
        raise ValueError(f"template {key!r} is read-only; load fills arrays in place")
    return region, arr, shape


def _piece_region(p: dict, shape: Tuple[int, ...]) -> Region:
    if "flat" in p:
        return Region((0,) * len(shape), shape, *p["flat"])
    return Region.whole_box(p["box"]["offsets"], p["box"]["lengths"])


def _fmt_keys(keys: List[str], limit: int = 20) -> str:
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(repr(k) for k in keys[:limit]) + more


class _Reader:
    """One checkpoint directory's shard files, opened relative to a descriptor of it.

    A save to the same path renames the directory away and then deletes it.
    ``_open`` opens the directory, its manifest and every shard file this
    rank needs before reading any data, so the data read after that comes
    from that one checkpoint. (Open files can still be read after they are
    deleted on a local filesystem. On NFS, another client's delete makes the
    reads fail.)
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.dfd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                           | getattr(os, "O_CLOEXEC", 0))
        self.files: Dict[str, Any] = {}
        self.fds: Dict[str, int] = {}
        self.bytes_read = 0

    def moved(self) -> bool:
        """Whether ``directory`` no longer names the directory this reader opened
        (a save replaced the checkpoint, or moved it aside to commit)."""
        try:
            now = os.stat(self.directory)
        except OSError:
            return True
        opened = os.fstat(self.dfd)
        return (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino)

    def open_for(self, key: str, entry: dict, dest: Region) -> None:
        """Open every shard file holding a piece of ``key`` that ``dest`` overlaps."""
        shape = tuple(entry["shape"])
        for p in entry["pieces"]:
            if overlaps(dest, _piece_region(p, shape)):
                self.fd(p["file"], key)

    def fd(self, fname: str, key: str) -> int:
        fd = self.fds.get(fname)
        if fd is not None:
            return fd
        path = os.path.join(self.directory, fname)
        meta = self.files.get(fname)
        if meta is None:
            raise CheckpointError(f"checkpoint manifest names shard file {fname!r} for tensor "
                                  f"{key!r} but does not list it", file=path, key=key)
        try:
            fd = os.open(fname, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0), dir_fd=self.dfd)
        except FileNotFoundError:
            raise CheckpointError(f"shard file {path!r} is missing (needed for tensor {key!r})",
                                  file=path, key=key) from None
        size = os.fstat(fd).st_size
        if size != meta["size"]:
            os.close(fd)
            how = "truncated" if size < meta["size"] else "longer than recorded"
            raise CheckpointError(f"shard file {path!r} is {how}: {size} bytes, the manifest "
                                  f"records {meta['size']} (needed for tensor {key!r})",
                                  file=path, key=key)
        self.fds[fname] = fd
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1

    def fill(self, key: str, entry: dict, dest: Region, storage: np.ndarray,
             chunk_bytes: int) -> None:
        """Copy every saved element of ``key`` that ``dest`` holds into ``storage``."""
        shape = tuple(entry["shape"])
        src_dtype = storage.dtype.newbyteorder("<") if storage.dtype.byteorder == ">" \
            else storage.dtype
        isz = storage.dtype.itemsize
        window = max(chunk_bytes, WINDOW_BYTES // chunk_bytes * chunk_bytes)
        copied = 0
        for p in entry["pieces"]:
            src = _piece_region(p, shape)
            boxes = overlaps(dest, src)
            if not boxes:
                continue
            fname = p["file"]
            path = os.path.join(self.directory, fname)
            nbytes, chunks, offset = int(p["nbytes"]), p["chunks"], int(p["offset"])
            if nbytes != src.size * isz or len(chunks) != -(-nbytes // chunk_bytes):
                raise CheckpointError(f"checkpoint manifest is inconsistent for tensor {key!r} "
                                      f"in {path!r} (piece size or chunk count)", file=path,
                                      key=key)
            fd = self.fd(fname, key)
            # Storage elements [first, last) of the piece hold everything needed;
            # widen to whole checksum chunks so each can be verified.
            spans = [src.span_of(b) for b in boxes]
            first = min(s for s, _ in spans) * isz
            last = max(e for _, e in spans) * isz
            b0 = first // chunk_bytes * chunk_bytes
            b1 = min(-(-last // chunk_bytes) * chunk_bytes, nbytes)
            for w0 in range(b0, b1, window):
                w1 = min(w0 + window, b1)
                buf = np.empty(w1 - w0, dtype=np.uint8)
                got = _fmt.pread_into(fd, buf, offset + w0)
                self.bytes_read += got
                if got != buf.size:
                    raise CheckpointError(
                        f"shard file {path!r} is truncated: tensor {key!r} needs bytes "
                        f"{offset + w0}..{offset + w1} but the file ends at {offset + w0 + got}",
                        file=path, key=key)
                for c in range(w0 // chunk_bytes, -(-w1 // chunk_bytes)):
                    lo, hi = c * chunk_bytes - w0, min((c + 1) * chunk_bytes, nbytes) - w0
                    if not _fmt.chunk_hash_ok(buf[lo:hi], chunks[c]):
                        raise CheckpointError(
                            f"checksum mismatch in shard file {path!r} for tensor {key!r}: "
                            f"bytes {offset + w0 + lo}..{offset + w0 + hi} of the file are "
                            f"corrupted", file=path, key=key)
                wreg = src.sub(w0 // isz, w1 // isz)
                wstore = buf.view(src_dtype)
                wboxes = wreg.boxes()
                for b in boxes:
                    for wb in wboxes:
                        z = intersect(b, wb)
                        if z is not None:
                            view(dest, storage, z)[...] = view(wreg, wstore, z)
                            copied += numel(z[1])
        if copied != dest.size:  # saved pieces never overlap, so this means a hole
            raise CheckpointError(f"checkpoint manifest does not cover tensor {key!r}: the "
                                  f"saved pieces hold {copied} of the {dest.size} elements this "
                                  f"rank needs", key=key)


def _check_template(flat: dict, manifest: dict, reader: _Reader
                    ) -> Tuple[List[str], List[str], dict]:
    """Check the template against the manifest; open the shard files it needs.

    Returns:
        (missing keys, checkpoint keys not in the template, decoded values).
    """
    tensors, values = manifest["tensors"], manifest["values"]
    missing, values_out = [], {}
    for key, leaf in flat.items():
        is_tensor = isinstance(leaf, (np.ndarray, ShardedTensor))
        if key in tensors:
            if not is_tensor:
                raise ValueError(f"{key!r} is a tensor in the checkpoint but a plain value "
                                 f"({type(leaf).__name__}) in the template")
            entry = tensors[key]
            region, arr, shape = _dest(key, leaf)
            name = _fmt.dtype_name(arr.dtype, key)
            if name != entry["dtype"] or shape != tuple(entry["shape"]):
                raise ValueError(f"{key!r} is {entry['dtype']}{list(entry['shape'])} in the "
                                 f"checkpoint but {name}{list(shape)} in the template")
            if region.size and numel(entry["shape"]):
                reader.open_for(key, entry, region)
        elif key in values:
            if is_tensor:
                raise ValueError(f"{key!r} is a plain value in the checkpoint but a tensor in "
                                 f"the template")
            values_out[key] = decode_value(values[key])
        else:
            missing.append(key)
    not_requested = sorted((set(tensors) | set(values)) - set(flat))
    return missing, not_requested, values_out


def _open(p: str, flat: dict) -> Tuple[_Reader, dict, str, List[str], List[str], dict]:
    """Open the checkpoint at ``p`` and every shard file ``flat`` needs from it.

    A save committing to ``p`` meanwhile can move the directory away or delete
    its files before all are open. That is tried again, up to
    ``_OPEN_ATTEMPTS`` times, and never reported as damage.

    Returns:
        (reader, manifest, manifest digest, missing keys, keys not in the
        template, decoded values).
    """
    changed = False  # an attempt found a checkpoint that then went away
    for attempt in range(_OPEN_ATTEMPTS):
        directory: Optional[str] = None
        reader: Optional[_Reader] = None
        try:
            directory = _commit.resolve_for_load(p)
            reader = _Reader(directory)
            manifest, digest = _fmt.read_manifest_digest(directory, dir_fd=reader.dfd)
            reader.files = manifest["files"]
            return (reader, manifest, digest) + _check_template(flat, manifest, reader)
        except (OSError, CheckpointError) as exc:
            # Without a directory: no checkpoint, or resolve lost a race with a
            # commit's renames; trying again tells which.
            moved = reader.moved() if reader is not None else isinstance(exc, FileNotFoundError)
            changed = changed or (directory is not None and moved)
            if reader is not None:
                reader.close()
            if not moved or (not changed and attempt + 1 == _OPEN_ATTEMPTS):
                raise
            if attempt + 1 == _OPEN_ATTEMPTS:
                raise CheckpointError(
                    f"the checkpoint at {p!r} changed while this rank opened it: saves "
                    f"committed there during all {_OPEN_ATTEMPTS} attempts; load again "
                    f"once the save is done (last: {describe(exc)})", file=p) from exc
        except BaseException:
            if reader is not None:
                reader.close()
            raise
    raise AssertionError("unreachable")


def _same_place(a: str, b: str) -> bool:
    """``a`` and ``b`` are one checkpoint path (or its copy moved aside by a commit)."""
    return a == b or _commit.old_path(a) == b or _commit.old_path(b) == a


def _open_agreed(comm: Comm, what: str, template: Any, path: Any, strict: bool
                 ) -> Tuple[_Reader, dict, dict, dict, List[Any]]:
    """Open the checkpoint on every rank (``_open``); agree that all opened the same one.

    Returns:
        (reader, manifest, flat template, decoded values, every rank's
        [missing keys, keys not in its template, directory, manifest digest, strict]).
    """
    for attempt in range(_OPEN_ATTEMPTS):
        error: Optional[BaseException] = None
        payload = None
        reader: Optional[_Reader] = None
        try:
            flat = flatten(template, "state_dict_template")
            reader, manifest, digest, missing, not_requested, values = _open(
                _check_path(path), flat)
            payload = [missing, not_requested, reader.directory, digest, bool(strict)]
        except Exception as exc:  # noqa: BLE001 - voted so no rank waits on this one
            error = exc
        try:
            got = agree(comm, what, error, payload)
        except BaseException:
            if reader is not None:
                reader.close()
            raise
        # Every rank must fill its arrays from one checkpoint (not one rank from the
        # last step and another from a save committed meanwhile).
        b = next((r for r, g in enumerate(got) if g[3] != got[0][3]), None)
        if b is None:
            return reader, manifest, flat, values, got
        reader.close()
        # One path, two manifests: a save committed between the ranks' opens.  No
        # array is touched yet, so every rank opens it again (all see the same got).
        same = _same_place(got[0][2], got[b][2])
        if same and attempt + 1 < _OPEN_ATTEMPTS:
            continue
        why = (f"a save committed a new checkpoint there each of the {_OPEN_ATTEMPTS} times "
               f"the ranks opened it, or the ranks do not share one filesystem; load again "
               f"once the save is done" if same else "every rank must load the same one")
        raise CheckpointError(f"{what}: ranks read different checkpoints: rank 0 read "
                              f"{got[0][2]!r} (manifest {got[0][3][:12]}) but rank {b} read "
                              f"{got[b][2]!r} (manifest {got[b][3][:12]}); {why}",
                              rank=comm.rank, op="load")
    raise AssertionError("unreachable")


def load(state_dict_template: Dict[str, Any], path: Any, *, group: Any = None,
         strict: bool = True, timeout: Optional[float] = None) -> LoadResult:
    """Load a checkpoint into ``state_dict_template``, in place; collective.

    The template says what this rank wants and in which layout: a numpy array
    receives the whole tensor, a ``ShardedTensor`` the piece its spec
    describes, whatever world size and layout the checkpoint was saved with
    (4 ranks -> 2, FSDP flat shards -> full arrays, and back).  Arrays are
    filled in place (so optimizers and views holding them stay valid); plain
    values cannot be, so they come back in ``LoadResult.state_dict``.

    Args:
        state_dict_template: nested dict shaped like the saved one; its arrays
            must be writable and match the saved dtype and global shape.
        path: the checkpoint directory.  If a crash interrupted a commit after
            the previous checkpoint was moved aside, that one is loaded.
        group: ringlet group (default: the world; a world of one when ringlet
            is not initialised).  Any size: it need not match the save.
        strict: when True, a template key missing from the checkpoint or a
            checkpoint key no rank asked for raises; when False they are
            reported in the result and skipped.
        timeout: seconds each agreement collective may wait (default: the
            group's timeout).
    Returns:
        A ``LoadResult``.
    Raises:
        TypeError/ValueError: bad template on this rank (unsupported leaf,
            dtype or shape differing from the checkpoint, read-only array).
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: a shard file is missing, truncated or fails its
            checksum (``file`` and ``key`` name it); keys mismatch under
            ``strict`` (``missing_keys``/``unexpected_keys``); a save to
            ``path`` replaced the checkpoint each time this load opened it; or
            another rank failed (``failed_ranks``).  Arrays may then be partly
            overwritten.  A save committing to ``path`` during the load is
            not an error: the load reads one whole committed checkpoint.

    Example::

        res = ringlet.checkpoint.load({"model": model.state_dict(), "step": 0}, "ckpt/latest")
        step = res.state_dict["step"]
    """
    comm = Comm(group, timeout)
    what = f"checkpoint load from {path!r}"
    reader, manifest, flat, values, got = _open_agreed(comm, what, state_dict_template, path,
                                                       strict)
    try:
        b = next((r for r, g in enumerate(got) if g[4] != got[0][4]), None)
        if b is not None:
            raise ValueError(f"{what}: ranks passed different strict: {got[0][4]} on rank 0 "
                             f"but {got[b][4]} on rank {b}; every rank must pass the same")
        unexpected = sorted(set.intersection(*(set(g[1]) for g in got)))
        missing_by_rank = {r: g[0] for r, g in enumerate(got) if g[0]}
        if strict and (missing_by_rank or unexpected):
            parts = [f"rank {r} is missing {_fmt_keys(m)}"
                     for r, m in sorted(missing_by_rank.items())]
            if unexpected:
                parts.append(f"unexpected keys (in the checkpoint, in no rank's template): "
                             f"{_fmt_keys(unexpected)}")
            raise CheckpointError(f"{what}: the checkpoint does not match the state dict (pass "
                                  f"strict=False to load the common keys): " + "; ".join(parts),
                                  missing_keys=missing_by_rank, unexpected_keys=unexpected,
                                  rank=comm.rank, op="load")

        error: Optional[BaseException] = None
        try:
            chunk = manifest["chunk_bytes"]
            for key, leaf in flat.items():
                entry = manifest["tensors"].get(key)
                if entry is None or not isinstance(leaf, (np.ndarray, ShardedTensor)):
                    continue
                region, storage, _shape = _dest(key, leaf)
                if region.size and numel(entry["shape"]):
                    reader.fill(key, entry, region, storage, chunk)
        except Exception as exc:  # noqa: BLE001 - voted below
            error = exc
            if isinstance(exc, OSError) and reader.moved():
                # NFS: another client's save deleted the files this rank holds open.
                error = CheckpointError(f"the checkpoint at {reader.directory!r} was replaced "
                                        f"by a save while this rank read it ({describe(exc)}); "
                                        f"load again once the save is done",
                                        file=reader.directory)
                error.__cause__ = exc
    finally:
        reader.close()
    agree(comm, what, error, reader.bytes_read)
    state = rebuild(state_dict_template, values)
    return LoadResult(state, missing_by_rank.get(comm.rank, []), unexpected, reader.bytes_read,
                      reader.directory)


def _verify_file(fpath: str, meta: dict, pieces: List[Tuple[str, dict]], chunk: int) -> None:
    import hashlib
    import json
    import struct

    size = os.path.getsize(fpath)
    first = pieces[0][0] if pieces else None
    if size != meta["size"]:
        how = "truncated" if size < meta["size"] else "longer than recorded"
        raise CheckpointError(f"shard file {fpath!r} is {how}: {size} bytes, the manifest "
                              f"records {meta['size']}", file=fpath, key=first)
    with open(fpath, "rb", buffering=0) as f:
        head = f.read(8)
        (hlen,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
        body = f.read(hlen) if 8 + hlen <= size else b""
        tree = hashlib.sha256(head + body)
        try:
            header = json.loads(body)
        except (ValueError, RecursionError):
            header = None
        if not isinstance(header, dict):
            raise CheckpointError(f"shard file {fpath!r} has a corrupted safetensors header",
                                  file=fpath, key=first)
        pos = 8 + hlen
        buf = np.empty(min(chunk, _fmt.WRITE_BLOCK), dtype=np.uint8)
        for key, p in sorted(pieces, key=lambda kp: kp[1]["offset"]):
            h = header.get(key)
            if not (isinstance(h, dict) and p["offset"] == pos
                    and h.get("data_offsets") == [pos - 8 - hlen, pos - 8 - hlen + p["nbytes"]]
                    and h.get("dtype") == _fmt._ST_CODES.get(p["dtype"])):
                raise CheckpointError(f"shard file {fpath!r}: its header entry for tensor "
                                      f"{key!r} disagrees with the manifest", file=fpath, key=key)
            for c, want in enumerate(p["chunks"]):
                lo, hi = c * chunk, min((c + 1) * chunk, p["nbytes"])
                ch = hashlib.sha256()
                for b0 in range(lo, hi, buf.size):  # a huge chunk is hashed in blocks
                    part = buf[:min(buf.size, hi - b0)]
                    if _fmt.pread_into(f.fileno(), part, pos + b0) != part.size:
                        raise CheckpointError(f"shard file {fpath!r} ended inside tensor {key!r}",
                                              file=fpath, key=key)
                    ch.update(memoryview(part))
                if ch.hexdigest() != want:
                    raise CheckpointError(
                        f"checksum mismatch in shard file {fpath!r} for tensor {key!r}: bytes "
                        f"{pos + lo}..{pos + hi} of the file are corrupted", file=fpath, key=key)
                tree.update(ch.digest())
            pos += p["nbytes"]
    if pos != size:
        raise CheckpointError(f"shard file {fpath!r} has {size - pos} bytes that no manifest "
                              f"entry accounts for", file=fpath)
    if tree.hexdigest() != meta.get("sha256_tree"):
        raise CheckpointError(f"shard file {fpath!r} fails its file checksum (its header was "
                              f"altered)", file=fpath)


def verify(path: Any) -> Dict[str, Any]:
    """Check a whole checkpoint against its manifest; local (no collectives).

    Reads the manifest (its own checksum, ``manifest_sha256``) and every
    shard file completely and checks: its size; every chunk
    checksum of every piece (a mismatch names the tensor and byte range);
    that its safetensors header places every piece where the manifest says;
    and the file checksum (``sha256_tree``), which also covers the header.

    Args:
        path: the checkpoint directory.
    Returns:
        The parsed manifest.
    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: the manifest fails its checksum (``file`` names it); a
            file is missing, has the wrong size, or fails a
            checksum, or its header disagrees with the manifest (``file`` and,
            where one is concerned, ``key`` name it).

    Example::

        ringlet.checkpoint.verify("ckpt/latest")
    """
    directory = _commit.resolve_for_load(_check_path(path))
    manifest = _fmt.read_manifest(directory)
    by_file: Dict[str, List[Tuple[str, dict]]] = {f: [] for f in manifest["files"]}
    for key, entry in sorted(manifest["tensors"].items()):
        for p in entry["pieces"]:
            if p["file"] not in by_file:
                raise CheckpointError(f"checkpoint manifest places tensor {key!r} in "
                                      f"{p['file']!r}, which it does not list", key=key)
            by_file[p["file"]].append((key, dict(p, dtype=entry["dtype"])))
    for fname, meta in sorted(manifest["files"].items()):
        fpath = os.path.join(directory, fname)
        pieces = by_file[fname]
        if not os.path.isfile(fpath):
            first = pieces[0][0] if pieces else None
            raise CheckpointError(f"shard file {fpath!r} is missing (it holds tensor {first!r}"
                                  f"{f' and {len(pieces) - 1} more' if len(pieces) > 1 else ''})",
                                  file=fpath, key=first)
        _verify_file(fpath, meta, pieces, manifest["chunk_bytes"])
    return manifest
