"""``ringlet.dtensor``: old import path of ``ringlet.parallel.dtensor``, kept working."""

from .parallel.dtensor import (DTensor, Partial, Placement, Replicate, Shard, distribute,
                               shard_sizes)

__all__ = ["Placement", "Shard", "Replicate", "Partial", "DTensor", "distribute",
           "shard_sizes"]
