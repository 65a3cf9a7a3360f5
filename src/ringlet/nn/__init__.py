"""ringlet.nn: a small numpy module system to train with.

Layers compute forward with numpy and back-propagate explicitly:
``model.backward(grad_output)`` returns the gradient with respect to the input
and accumulates parameter gradients into ``param.grad`` (in place).  Gradient-
ready hooks on parameters fire as soon as a gradient is final, which is what
``ringlet.parallel.DistributedDataParallel`` overlaps its communication with.
See docs/nn.md.

Example::

    import numpy as np
    from ringlet import nn, optim

    model = nn.Sequential(nn.Linear(64, 128, rng=0), nn.ReLU(), nn.Linear(128, 10, rng=1))
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss, g = nn.cross_entropy(model(x), y)
    opt.zero_grad()
    model.backward(g)
    opt.step()
"""

from . import functional
from .layers import (BatchNorm1d, Dropout, Embedding, GELU, Identity, LayerNorm, Linear, ReLU,
                     Sequential, Tanh)
from .losses import cross_entropy, mse_loss
from .module import (HookHandle, IncompatibleKeys, Module, Parameter, enable_grad,
                     is_grad_enabled, no_grad)
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

# The tensor-parallel layers live in ringlet.parallel (which builds on this
# package); they are re-exported here on first access, so importing either
# package first works.
_TENSOR_PARALLEL = ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
                    "vocab_parallel_cross_entropy", "SequenceParallelScatter",
                    "SequenceParallelGather", "scatter_to_sequence_parallel",
                    "gather_from_sequence_parallel", "mark_sequence_parallel")

__all__ = [
    "Module", "Parameter", "no_grad", "enable_grad", "is_grad_enabled", "HookHandle",
    "IncompatibleKeys", "Linear", "ReLU", "GELU", "Tanh", "Dropout", "LayerNorm", "Embedding",
    "BatchNorm1d", "Sequential", "Identity", "mse_loss", "cross_entropy", "functional",
    "SyncBatchNorm", "convert_sync_batchnorm", "ColumnParallelLinear", "RowParallelLinear",
    "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "SequenceParallelScatter",
    "SequenceParallelGather", "scatter_to_sequence_parallel", "gather_from_sequence_parallel",
    "mark_sequence_parallel",
]


def __getattr__(name: str):
    if name in _TENSOR_PARALLEL:
        from ..parallel import tensor_parallel

        return getattr(tensor_parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_TENSOR_PARALLEL))
