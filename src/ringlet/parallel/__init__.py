"""ringlet.parallel: training-parallelism wrappers built on ringlet's public collectives.

- ``DistributedDataParallel`` (alias ``DDP``): replicate a ``ringlet.nn`` model
  and average its gradients, overlapping the all-reduces with backward
  (docs/ddp.md).
- ``comm_hooks``: how a gradient bucket is reduced (``fp16_compress``,
  ``bf16_compress``, or your own).
"""

from . import comm_hooks
from .ddp import DDP, DistributedDataParallel, GradBucket
from .finalize import finalize_model_grads
from .fsdp import FSDP, FullyShardedDataParallel, MixedPrecision, ShardingStrategy

__all__ = ["DistributedDataParallel", "DDP", "GradBucket", "comm_hooks", "finalize_model_grads",
           "FullyShardedDataParallel", "FSDP", "MixedPrecision", "ShardingStrategy"]
