"""The one gradient reduction every parallel layer uses after backward.

``finalize_model_grads`` (3-D/4-D meshes) and the pipeline's
``all_reduce_gradients`` both collect the trainable parameters of some model
chunks and reduce their gradients over a group.  Both go through here: one
flat buffer per dtype, one collective each, written back in place.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .._dtypes import ReduceOp

__all__: List[str] = []


def chunk_list(chunks: Any) -> List[Any]:
    """A chunk or a list/tuple of chunks, as a list."""
    return list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]


def params_of(item: Any, what: str, arg: str = "model_chunks") -> List[Any]:
    """The parameters of a Module, PipelineStage or wrapper, or ``[item]`` for a Parameter."""
    if hasattr(item, "data") and hasattr(item, "grad") and not callable(
            getattr(item, "parameters", None)):
        return [item]
    params = getattr(item, "parameters", None)
    if not callable(params):
        raise TypeError(f"{what}: {arg} must be Modules, PipelineStages, "
                        f"data-parallel wrappers or Parameters, got {type(item).__name__}")
    return list(params())


def trainable(params: Sequence[Any], seen: set) -> List[Any]:
    """``params`` not in ``seen`` that require grad, in order (adds them to ``seen``)."""
    out = []
    for p in params:
        if id(p) in seen or not getattr(p, "requires_grad", True):
            continue
        seen.add(id(p))
        out.append(p)
    return out


def zero_missing_grads(params: Sequence[Any]) -> None:
    """Give each parameter without a gradient a zero one.

    A parameter not used this step still takes part in the reduction, so
    every rank of a group reduces the same layout.
    """
    for p in params:
        if p.grad is None:
            p.grad = np.zeros_like(p.data, order="C")


def flat_reduce(params: Sequence[Any], group: Any, op: ReduceOp, scale: float,
                timeout: Optional[float]) -> None:
    """All-reduce the gradients of ``params`` over ``group`` in one buffer per dtype.

    ``group`` None or of size 1 skips the collective (``scale`` still applies).
    Collective over ``group``: every member passes the same dtypes and sizes.
    """
    by_dtype: Dict[np.dtype, List[Any]] = {}
    for p in params:
        by_dtype.setdefault(np.dtype(p.grad.dtype), []).append(p)
    for dt in sorted(by_dtype, key=str):  # the same order on every rank
        ps = by_dtype[dt]
        flat = np.concatenate([p.grad.reshape(-1) for p in ps])
        if group is not None and group.size > 1:
            group.all_reduce(flat, op, timeout=timeout)
        if scale != 1.0:
            flat *= dt.type(scale)
        off = 0
        for p in ps:
            n = p.grad.size
            p.grad[...] = flat[off:off + n].reshape(p.grad.shape)  # in place: may be a view
            off += n
