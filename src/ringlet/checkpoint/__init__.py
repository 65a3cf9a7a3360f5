"""Distributed checkpoints: sharded save, resharding load, atomic commit, async save.

``save(state_dict, path)`` is collective: each rank writes the pieces it owns
to its own safetensors file and rank 0 commits a JSON manifest last, by
renaming a fully written temporary directory into place.  ``load(template,
path)`` fills a template in place in whatever layout it has (another world
size, full <-> sharded), reading only the bytes each rank needs and verifying
their checksums.  ``AsyncCheckpointer`` snapshots in memory and saves in the
background.  Format and guarantees: ``docs/checkpoint.md``.

Example::

    from ringlet.checkpoint import save, load

    save({"model": params, "optim": opt_state, "step": 10}, "ckpt/latest")
    res = load({"model": params, "optim": opt_state, "step": 0}, "ckpt/latest")
    step = res.state_dict["step"]
"""

from __future__ import annotations

from .async_ import AsyncCheckpointer
from .errors import CheckpointError
from .load import LoadResult, load, verify
from .save import save
from .shard import ShardedTensor, ShardSpec

__all__ = ["save", "load", "verify", "LoadResult", "AsyncCheckpointer", "ShardSpec",
           "ShardedTensor", "CheckpointError"]
