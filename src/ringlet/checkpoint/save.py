"""``save``: every rank writes its pieces, rank 0 commits the manifest atomically.

The protocol (``SaveJob``), with the collectives each phase ends in:

1. *plan*: rank 0 prepares the temporary directory (see ``commit``); every rank
   describes its entries (key, kind, dtype, shape, shard geometry, values);
   ``agree`` all-gathers the descriptions.  Every rank then computes the same
   plan from the same data: which rank writes which piece of which tensor.
   Inconsistent state dicts (different shapes, partial overlaps, holes,
   disagreeing values) fail here, identically on every rank.
2. *write*: each rank writes its planned pieces to ``rank<r>.safetensors`` in
   the temporary directory, hashing as it writes, and fsyncs the file.  No
   collective: this is the part ``AsyncCheckpointer`` runs in the background.
3. *commit*: ``agree`` all-gathers each rank's file summary (size, SHA-256,
   piece offsets, chunk hashes) or error.  Rank 0 writes the manifest last,
   fsyncs, renames into place (``commit.commit``) and broadcasts the outcome.
   A failure anywhere removes the temporary directory and raises on every
   rank, naming the rank that failed.

Who writes what:

* a sharded tensor: each distinct piece is written once, by the lowest rank
  holding it (identical pieces on several ranks, as in hybrid sharding, are
  deduplicated; partially overlapping pieces are an error);
* a full (replicated) array: written once in all.  Arrays of at least
  ``split_bytes`` are cut into near-equal flat ranges, one per rank that holds
  them, so every rank writes a share; smaller arrays go whole to the rank with
  the fewest bytes assigned so far (largest first).  A DDP checkpoint is
  therefore written in parallel by all ranks.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import commit as _commit
from ._comm import Comm, agree, describe
from ._region import Region, check_cover, numel, view
from ._state import canonical, flatten
from .errors import CheckpointError
from .format import (DEFAULT_CHUNK_BYTES, FORMAT, VERSION, dtype_name, shard_file_name,
                     write_manifest, write_shard_file)
from .shard import ShardedTensor

__all__ = ["save"]

DEFAULT_SPLIT_BYTES = 16 << 20


def _check_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if not p or os.path.basename(os.path.normpath(p)) in ("", ".", ".."):
        raise ValueError(f"path {path!r} does not name a checkpoint directory")
    return os.path.abspath(p)


def _check_sizes(chunk_bytes: Any, split_bytes: Any) -> None:
    for name, v in (("chunk_bytes", chunk_bytes), ("split_bytes", split_bytes)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if chunk_bytes < 64 or chunk_bytes % 64:
        # a multiple of every itemsize, so chunks never split an element
        raise ValueError(f"chunk_bytes must be a positive multiple of 64, got {chunk_bytes}")
    if split_bytes < 1:
        raise ValueError(f"split_bytes must be positive, got {split_bytes}")


def _describe(flat: Dict[str, Any]) -> str:
    """This rank's entries as JSON: what the plan needs, no tensor data."""
    tensors: Dict[str, list] = {}
    values: Dict[str, str] = {}
    for key, leaf in flat.items():
        if key == "__metadata__" and isinstance(leaf, (np.ndarray, ShardedTensor)):
            raise ValueError("the key '__metadata__' is reserved by safetensors for tensors")
        if isinstance(leaf, np.ndarray):
            tensors[key] = [dtype_name(leaf.dtype, key), list(leaf.shape), None]
        elif isinstance(leaf, ShardedTensor):
            tensors[key] = [dtype_name(leaf.dtype, key), list(leaf.global_shape),
                            leaf.spec.to_json()]
        else:
            values[key] = canonical(leaf)
    return json.dumps({"tensors": tensors, "values": values}, separators=(",", ":"))


def _region_of(shape: List[int], spec: Optional[dict]) -> Region:
    if spec is None:
        return Region.whole_box((0,) * len(shape), shape)
    if "flat" in spec:
        return Region((0,) * len(shape), shape, *spec["flat"])
    return Region.whole_box(spec["offsets"], spec["lengths"])


def region_json(region: Region, shape: Tuple[int, ...]) -> dict:
    if region.is_whole_box:
        return {"box": {"offsets": list(region.off), "lengths": list(region.ext)}}
    if region.ext == tuple(shape) and not any(region.off):
        return {"flat": [region.start, region.stop]}
    raise AssertionError(f"a planned piece is neither a box nor a flat range: {region}")


class Plan:
    """What every rank writes; identical on every rank."""

    def __init__(self, tensors: Dict[str, dict], values: Dict[str, Any],
                 writes: Dict[int, List[Tuple[str, Region]]]) -> None:
        self.tensors = tensors  # key -> {"dtype", "shape", "pieces": [(rank, Region)]}
        self.values = values    # key -> encoded value
        self.writes = writes    # rank -> [(key, Region)], sorted by key


def make_plan(descs: List[str], split_bytes: int) -> Plan:
    """Merge every rank's description into a plan.  ValueError on inconsistencies."""
    per_key: Dict[str, List[Tuple[int, str, tuple, Optional[dict]]]] = {}
    val_by_key: Dict[str, Dict[int, str]] = {}
    for r, raw in enumerate(descs):
        d = json.loads(raw)
        for key, (dt, shape, spec) in d["tensors"].items():
            per_key.setdefault(key, []).append((r, dt, tuple(shape), spec))
        for key, v in d["values"].items():
            val_by_key.setdefault(key, {})[r] = v
    clash = sorted(set(per_key) & set(val_by_key))
    if clash:
        k = clash[0]
        raise ValueError(f"{k!r} is a tensor on rank(s) {[h[0] for h in per_key[k]]} but a "
                         f"plain value on rank(s) {sorted(val_by_key[k])}")
    values: Dict[str, Any] = {}
    for key in sorted(val_by_key):
        by_rank = val_by_key[key]
        distinct = sorted(set(by_rank.values()))
        if len(distinct) > 1:
            a = min(by_rank)
            b = min(r for r, v in by_rank.items() if v != by_rank[a])
            raise ValueError(f"value {key!r} differs between rank {a} ({by_rank[a][:80]}) and "
                             f"rank {b} ({by_rank[b][:80]}); values are stored once, so give "
                             f"per-rank values per-rank keys (e.g. f'rng.rank{{rank}}')")
        values[key] = json.loads(distinct[0])

    tensors: Dict[str, dict] = {}
    writes: Dict[int, List[Tuple[str, Region]]] = {r: [] for r in range(len(descs))}
    replicated: List[Tuple[str, List[int], int]] = []
    for key in sorted(per_key):
        holders = per_key[key]
        r0, dt0, shape0, _ = holders[0]
        for r, dt, shape, _ in holders[1:]:
            if dt != dt0 or shape != shape0:
                raise ValueError(f"{key!r} is {dt0}{list(shape0)} on rank {r0} but "
                                 f"{dt}{list(shape)} on rank {r}")
        full = [h[0] for h in holders if h[3] is None]
        if full and len(full) != len(holders):
            other = next(h[0] for h in holders if h[3] is not None)
            raise ValueError(f"{key!r} is a full array on rank {full[0]} but a ShardedTensor on "
                             f"rank {other}; use one or the other for a key")
        tensors[key] = {"dtype": dt0, "shape": shape0, "pieces": []}
        if full:
            itemsize = _itemsize(dt0)
            replicated.append((key, full, numel(shape0) * itemsize))
            continue
        uniq: Dict[tuple, Tuple[int, Region]] = {}
        for r, _dt, shape, spec in holders:
            reg = _region_of(list(shape), spec)
            if reg.size:
                uniq.setdefault(reg.key(), (r, reg))  # holders are in rank order: lowest wins
        items = list(uniq.values())
        check_cover(key, shape0, items)
        tensors[key]["pieces"] = sorted(items, key=lambda it: it[0])

    # Replicated arrays: split the big ones across their holders, place the
    # small ones whole on the least-loaded holder (largest first).
    load = {r: 0 for r in range(len(descs))}
    for key, holders, nbytes in sorted(replicated, key=lambda t: (-t[2], t[0])):
        shape = tensors[key]["shape"]
        n = numel(shape)
        if n == 0:
            continue
        if nbytes >= split_bytes and len(holders) > 1:
            k = min(len(holders), n)
            zero = (0,) * len(shape)
            for i in range(k):
                s, e = n * i // k, n * (i + 1) // k
                tensors[key]["pieces"].append((holders[i], Region(zero, shape, s, e)))
                load[holders[i]] += (e - s) * nbytes // n
        else:
            r = min(holders, key=lambda h: (load[h], h))
            tensors[key]["pieces"].append((r, Region.whole_box((0,) * len(shape), shape)))
            load[r] += nbytes
    for key in sorted(tensors):
        for r, reg in tensors[key]["pieces"]:
            writes[r].append((key, reg))
    return Plan(tensors, values, writes)


def _itemsize(name: str) -> int:
    if name == "bfloat16":
        return 2
    if name.startswith("float8"):
        return 1
    return np.dtype(name).itemsize


def _piece_array(leaf: Any, reg: Region) -> Tuple[np.ndarray, Tuple[int, ...]]:
    """The array holding a planned piece, and the shape to store it with.

    Box pieces keep their box's shape in the safetensors header, flat ones are 1-D.
    """
    if isinstance(leaf, ShardedTensor):
        return leaf.local, (reg.ext if reg.is_whole_box else (reg.size,))
    if reg.is_whole_box:
        return leaf, tuple(leaf.shape)
    if leaf.flags.c_contiguous:
        return leaf.reshape(-1)[reg.start:reg.stop], (reg.size,)
    # A strided array (a transposed weight): copy this rank's range only, box
    # by box, not the whole array.
    out = np.empty(reg.size, dtype=leaf.dtype)
    whole = Region.whole_box((0,) * leaf.ndim, tuple(leaf.shape))
    for box in reg.boxes():
        view(reg, out, box)[...] = view(whole, leaf, box)
    return out, (reg.size,)


class SaveJob:
    """One save, split into phases so ``AsyncCheckpointer`` can run them apart.

    ``flat`` must stay unchanged from ``plan`` until ``write`` returns (the
    async path hands it a private snapshot).
    """

    def __init__(self, comm: Comm, path: str, chunk_bytes: int, split_bytes: int) -> None:
        self.comm = comm
        self.path = path
        self.chunk_bytes = chunk_bytes
        self.split_bytes = split_bytes
        self.what = f"checkpoint save to {path!r}"
        self.tmp: Optional[str] = None
        self.plan_: Optional[Plan] = None
        self.flat: Dict[str, Any] = {}

    def plan(self, flat: Optional[Dict[str, Any]], error: Optional[BaseException]) -> None:
        """Phase 1 (collective).  ``error``: a failure the caller already hit locally."""
        desc = None
        tmp = None
        if error is None:
            try:
                desc = _describe(flat)  # type: ignore[arg-type]
                if self.comm.rank == 0:
                    tmp = self.tmp = _commit.prepare(self.path)
            except Exception as exc:  # noqa: BLE001 - voted, then re-raised
                error = exc
        try:
            got = agree(self.comm, self.what, error,
                        [desc, tmp, self.path, self.chunk_bytes, self.split_bytes])
            self.tmp = got[0][1]
            paths = sorted({g[2] for g in got})
            if len(paths) > 1:
                raise ValueError(f"ranks passed different checkpoint paths: {paths}; every "
                                 f"rank must name the same directory")
            # Rank 0's chunk size goes into the manifest and every rank's split
            # decides who writes what: a rank that differs would commit a
            # checkpoint that cannot be loaded.
            for i, name in ((3, "chunk_bytes"), (4, "split_bytes")):
                a = got[0][i]
                b = next((r for r, g in enumerate(got) if g[i] != a), None)
                if b is not None:
                    raise ValueError(f"ranks passed different {name}: {a} on rank 0 but "
                                     f"{got[b][i]} on rank {b}; every rank must pass the same")
            self.plan_ = make_plan([g[0] for g in got], self.split_bytes)
        except BaseException:
            if self.comm.rank == 0:
                _commit.abort(self.tmp)
            raise
        self.flat = flat  # type: ignore[assignment]

    def write(self) -> Tuple[Optional[BaseException], Any]:
        """Phase 2 (local file I/O only).  Returns (error, summary)."""
        try:
            mine = self.plan_.writes[self.comm.rank]  # type: ignore[union-attr]
            if not mine:
                return None, None
            if not os.path.isdir(self.tmp):  # type: ignore[arg-type]
                raise FileNotFoundError(
                    f"rank {self.comm.rank} cannot see the temporary directory {self.tmp!r} "
                    f"that rank 0 created: checkpoint ranks need a shared filesystem")
            pieces = []
            for key, reg in mine:
                arr, shape = _piece_array(self.flat[key], reg)
                pieces.append((key, arr, shape))
            fname = shard_file_name(self.comm.rank)
            info = write_shard_file(os.path.join(self.tmp, fname), pieces,  # type: ignore
                                    self.chunk_bytes, self.comm.rank)
            _commit._failpoint("written")
            return None, [fname, info]
        except Exception as exc:  # noqa: BLE001 - voted in commit
            return exc, None

    def commit(self, error: Optional[BaseException], summary: Any) -> None:
        """Phase 3 (collective): vote, then rank 0 writes the manifest and renames."""
        try:
            got = agree(self.comm, self.what, error, summary)
        except BaseException:
            if self.comm.rank == 0:
                _commit.abort(self.tmp)
            raise
        failure: Optional[BaseException] = None
        outcome = None
        if self.comm.rank == 0:
            try:
                write_manifest(self.tmp, self._manifest(got))  # type: ignore[arg-type]
                _commit.commit(self.tmp, self.path)  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - broadcast, then raised everywhere
                _commit.abort(self.tmp)
                failure, outcome = exc, describe(exc)
        outcome = self.comm.broadcast_object(outcome, 0)
        if failure is not None:
            raise failure
        if outcome is not None:
            raise CheckpointError(f"{self.what}: rank 0 could not commit: {outcome}",
                                  failed_ranks={0: outcome}, rank=self.comm.rank, op="save")

    def _manifest(self, summaries: List[Any]) -> Dict[str, Any]:
        plan = self.plan_
        files: Dict[str, Any] = {}
        placed: Dict[Tuple[int, str], Tuple[str, dict]] = {}
        for r, s in enumerate(summaries):
            if s is None:
                continue
            fname, info = s
            files[fname] = {"rank": r, "size": info["size"], "sha256_tree": info["sha256_tree"]}
            for key, p in info["pieces"].items():
                placed[(r, key)] = (fname, p)
        tensors: Dict[str, Any] = {}
        for key, t in plan.tensors.items():  # type: ignore[union-attr]
            pieces = []
            for r, reg in t["pieces"]:
                fname, p = placed[(r, key)]
                pieces.append(dict(region_json(reg, t["shape"]), rank=r, file=fname,
                                   offset=p["offset"], nbytes=p["nbytes"], chunks=p["chunks"]))
            tensors[key] = {"dtype": t["dtype"], "shape": list(t["shape"]), "pieces": pieces}
        return {"format": FORMAT, "version": VERSION, "world_size": self.comm.size,
                "chunk_bytes": self.chunk_bytes, "files": files, "tensors": tensors,
                "values": plan.values}  # type: ignore[union-attr]


def save(state_dict: Dict[str, Any], path: Any, *, group: Any = None,
         timeout: Optional[float] = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
         split_bytes: int = DEFAULT_SPLIT_BYTES) -> None:
    """Save a (possibly sharded) state dict as a checkpoint directory; collective.

    Every rank of ``group`` calls this with its own state dict.  The
    checkpoint appears at ``path`` atomically once every rank has written its
    part; a previous checkpoint at ``path`` is replaced (atomically) only then.

    Args:
        state_dict: nested dict of numpy arrays (full tensors, identical on every
            rank that has them), ``ShardedTensor``s (this rank's piece), and
            plain values (None/bool/int/float/str/lists), which must be equal on
            every rank that has them.  Keys are flattened with dots.
        path: the checkpoint directory (on a filesystem all ranks share).
        group: ringlet group (default: the world; a world of one when ringlet
            is not initialised).
        timeout: seconds each agreement collective may wait for the slowest
            rank's I/O (default: the group's timeout).
        chunk_bytes: granularity of the per-piece checksums (a multiple of 64):
            a load that needs part of a piece reads and verifies whole chunks.
        split_bytes: full arrays at least this big are split across ranks.
    Raises:
        TypeError/ValueError: bad state dict on this rank, or ranks disagree
            (shapes, dtypes, overlapping or missing shards, differing values).
        FileExistsError: ``path`` is something other than a checkpoint or an
            empty directory.
        CheckpointError: another rank failed (``failed_ranks`` names it) or the
            commit failed; nothing was committed and the previous checkpoint
            is intact.
        RingletError: a collective failed (a rank died or timed out).

    Example::

        ringlet.checkpoint.save({"model": model.state_dict(),
                                 "optim": opt.state_dict(), "step": step}, "ckpt/latest")
    """
    comm = Comm(group, timeout)
    job = SaveJob(comm, "", chunk_bytes, split_bytes)
    flat = None
    error: Optional[BaseException] = None
    try:
        job.path = _check_path(path)
        job.what = f"checkpoint save to {job.path!r}"
        _check_sizes(chunk_bytes, split_bytes)
        flat = flatten(state_dict)
    except Exception as exc:  # noqa: BLE001 - voted so no rank waits on this one
        error = exc
    job.plan(flat, error)
    err, summary = job.write()
    job.commit(err, summary)
