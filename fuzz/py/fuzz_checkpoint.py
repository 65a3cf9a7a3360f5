"""Fuzz the checkpoint reader (``ringlet.checkpoint``: manifest and shard headers).

A small valid checkpoint is written once; each input damages it and runs
``verify`` and ``load`` on it.  Contract: a damaged checkpoint raises
``CheckpointError`` (naming the file, and the tensor where it can), never
KeyError, TypeError, IndexError, UnicodeDecodeError, struct.error,
MemoryError or anything else, and a load that succeeds returns the values
that were saved.

Input: mode u8 | mode's bytes
  mode 0: the bytes are the manifest
  mode 1: the manifest's values mutated (structure-aware, see _harness)
  mode 2: the bytes overwrite the start of the shard file (its header)
  mode 3: the shard file's JSON header mutated (structure-aware)
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Reader, instrumented, main, mutate_json  # noqa: E402

with instrumented():
    from ringlet import checkpoint as ckpt
    from ringlet.checkpoint import CheckpointError

import numpy as np  # noqa: E402

_STATE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5), "step": 3,
          "name": "fuzz"}
_dir = None
_manifest = _shard = b""
SHARD = "rank00000.safetensors"


def _template():
    return {"w": np.zeros((3, 4), np.float32), "b": np.zeros(5), "step": 0, "name": ""}


def _setup() -> str:
    global _dir, _manifest, _shard
    if _dir is None:
        _dir = tempfile.mkdtemp(prefix="ringlet-fuzz-ckpt-")
        ckpt.save(_STATE, os.path.join(_dir, "orig"))
        with open(os.path.join(_dir, "orig", "manifest.json"), "rb") as f:
            _manifest = f.read()
        with open(os.path.join(_dir, "orig", SHARD), "rb") as f:
            _shard = f.read()
        os.mkdir(os.path.join(_dir, "c"))
    return os.path.join(_dir, "c")


def _damage(data: bytes):
    """(manifest bytes, shard bytes) for this input."""
    r = Reader(data)
    mode = r.byte() % 4
    manifest, shard = _manifest, _shard
    if mode == 0:
        manifest = r.rest()
    elif mode == 1:
        manifest = json.dumps(mutate_json(json.loads(_manifest), r)).encode()
    elif mode == 2:
        head = r.rest()
        shard = head + shard[len(head):]
    else:
        (n,) = struct.unpack_from("<Q", shard)
        header = mutate_json(json.loads(shard[8:8 + n]), r)
        hj = json.dumps(header).encode()
        hj += b" " * (-len(hj) % 8)
        shard = struct.pack("<Q", len(hj)) + hj + shard[8 + n:]
    return manifest, shard


def test_one_input(data: bytes) -> None:
    path = _setup()
    manifest, shard = _damage(data)
    for name, blob in (("manifest.json", manifest), (SHARD, shard)):
        with open(os.path.join(path, name), "wb") as f:
            f.write(blob)
    try:
        ckpt.verify(path)
    except CheckpointError:
        pass
    try:
        res = ckpt.load(_template(), path)
    except CheckpointError:
        return
    except ValueError as exc:
        # A manifest that records another dtype or shape is, to the reader, a
        # template that does not match the checkpoint: load's documented
        # ValueError.
        if "in the checkpoint but" not in str(exc):
            raise
        return
    # What loaded must be what was saved, or a checksum should have failed.
    sd = res.state_dict
    for k, v in _STATE.items():
        got = sd.get(k)
        same = (np.array_equal(got, v) and got.dtype == v.dtype and got.shape == v.shape
                if isinstance(v, np.ndarray) else got == v)
        if not same and (manifest, shard) == (_manifest, _shard):
            raise AssertionError(f"undamaged checkpoint loaded {k}={got!r}, saved {v!r}")
        if not same and isinstance(v, np.ndarray):
            raise AssertionError(f"damaged checkpoint loaded {k}={got!r} without an error "
                                 f"(saved {v!r})")


def cleanup() -> None:
    if _dir is not None:
        shutil.rmtree(_dir, ignore_errors=True)


if __name__ == "__main__":
    main(test_one_input)
