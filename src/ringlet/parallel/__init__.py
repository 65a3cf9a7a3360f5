"""ringlet.parallel: every kind of training parallelism, on ringlet's public collectives.

- ``DeviceMesh`` (``mesh``): ranks on an N-D grid, one process group per grid
  line; every other layer takes its groups from a mesh (docs/parallelism.md).
- ``DTensor`` (``dtensor``): one logical array spread over a mesh.
- ``tensor_parallel``: Megatron-style tensor and sequence parallel layers.
- ``DistributedDataParallel`` (alias ``DDP``): replicate a ``ringlet.nn`` model
  and average its gradients, overlapping the all-reduces with backward
  (docs/ddp.md).  ``comm_hooks``: how a gradient bucket is reduced.
- ``FullyShardedDataParallel`` (alias ``FSDP``): shard parameters, gradients
  and optimizer state (docs/fsdp.md).
- ``pipeline``: a model cut into stages, fed microbatches (docs/pipeline.md).
- ``finalize_model_grads``: the gradient reductions a 3-D/4-D layout needs
  after backward.

The mesh and DTensor load with ``ringlet`` itself (the package root exports
them); the training layers load on first use, so importing ``ringlet`` does
not pull in ``ringlet.nn`` and no module imports the package root while it
is still being built.
"""

import importlib
from typing import Any

from .dtensor import DTensor, Partial, Placement, Replicate, Shard, distribute
from .mesh import DeviceMesh

# public name -> submodule that defines it (imported on first access)
_LAZY = {
    "DistributedDataParallel": "ddp", "DDP": "ddp", "GradBucket": "ddp",
    "finalize_model_grads": "finalize",
    "FullyShardedDataParallel": "fsdp", "FSDP": "fsdp", "MixedPrecision": "fsdp",
    "ShardingStrategy": "fsdp",
}
_SUBMODULES = ("comm_hooks", "ddp", "fsdp", "finalize", "pipeline", "tensor_parallel")

__all__ = ["DeviceMesh", "DTensor", "Shard", "Replicate", "Partial", "Placement", "distribute",
           "DistributedDataParallel", "DDP", "GradBucket", "comm_hooks", "finalize_model_grads",
           "FullyShardedDataParallel", "FSDP", "MixedPrecision", "ShardingStrategy"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
