"""``finalize_model_grads``: the gradient reductions left after backward in a 3-D/4-D layout.

After ``backward`` (or a pipeline schedule's ``step``) each rank holds
gradients of *its* data, *its* pipeline stage and *its* tensor-parallel
slice.  Before the optimizer step some of them must be combined across a
mesh dimension.  Which reduction a parameter needs is declared by plain
attributes on the ``Parameter`` (documented in docs/parallelism.md):

``param.shared_embedding = True``
    One of two copies of a weight tied between the first and the last
    pipeline stage (input embedding and output projection).  Each copy got
    the gradient of its own use; the two are summed over the group of the
    first and last "pp" coordinates (per dp/tp/... coordinate), so both
    copies take the same step.
``param.sequence_parallel = True``
    A replicated parameter used on sequence shards (LayerNorm weights, the
    row-parallel bias under sequence parallelism): summed over "tp".
``param.expert = True``
    A mixture-of-experts expert parameter, different on each "ep"
    coordinate: summed over "dp" only (its expert-data-parallel group) and
    divided by the full data-parallel size ``dp * ep``.
(no attribute)
    A dense parameter, replicated over "dp" (and "ep"): averaged over both.
``param.dp_reduced = True``
    Its gradient was already reduced over the data-parallel ranks by a
    wrapper; the data-parallel step skips it (the other steps still apply).
    Chunks that are data-parallel wrappers themselves (anything with a
    callable ``sync_gradients()``, such as ``DistributedDataParallel``) are
    asked to finish their reduction first, and all their parameters count
    as ``dp_reduced``; such a wrapper's group must then span every
    data-parallel rank ("dp" and "ep").

The mesh dimension names default to "pp", "dp", "tp" and "ep"; a name the
mesh does not have counts as a dimension of size 1.

Every rank of the mesh calls ``finalize_model_grads`` with its own chunks.
All reductions are flat: one buffer per dtype and per group, so one
collective each.  Parameters without a gradient contribute zeros (and get a
zero gradient), so every rank of a group reduces the same layout.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional

import numpy as np

from .._dtypes import ReduceOp
from ._grads import chunk_list, flat_reduce, params_of, trainable, zero_missing_grads

__all__ = ["finalize_model_grads"]


def _dim_group(mesh: Any, name: Optional[str]):
    """(group, size) along the named dim, or (None, 1) if the mesh has no such dim."""
    if name is None or name not in tuple(mesh.dim_names):
        return None, 1
    return mesh.get_group(name), int(mesh.size(name))


def finalize_model_grads(model_chunks: Any, *, mesh: Any, dp_dim: Optional[str] = "dp",
                         tp_dim: Optional[str] = "tp", pp_dim: Optional[str] = "pp",
                         ep_dim: Optional[str] = "ep", timeout: Optional[float] = None) -> None:
    """Finish gradient reduction across the mesh after backward, before ``optimizer.step()``.

    In order: (1) data-parallel wrappers among the chunks finish their
    reduction; (2) tied embedding copies are summed between the first and
    last pipeline stages; (3) sequence-parallel gradients are summed over
    the tensor-parallel group; (4) dense gradients are averaged over the
    data-parallel dimensions ("dp" and "ep") and expert gradients summed over
    "dp" and divided by ``dp * ep``.  The parameter attributes that select
    these are listed in the module docstring and docs/parallelism.md.

    Every rank of the mesh must call it, every step.  The group of the first
    and last pipeline stages is created on the first call when the pipeline
    has more than two stages (``mesh.get_subgroup``, collective over the
    mesh's parent group); call ``mesh.get_subgroup(pp, (0, pp_size - 1))``
    right after building the mesh to create it eagerly.  First- and
    last-stage ranks always exchange an 8-byte header with their tied
    gradients, so a model whose stages disagree about tied parameters fails
    fast with ``DesyncError`` or ``ValueError`` instead of hanging.

    Args:
        model_chunks: this rank's model chunk(s): ``Module``, ``PipelineStage``,
            data-parallel wrapper, ``Parameter``, or a list of them.
        mesh: a ``DeviceMesh`` (anything with ``dim_names``, ``size(dim)``,
            ``get_group(dim)`` and ``get_subgroup(dim, coords)``).
        dp_dim, tp_dim, pp_dim, ep_dim: the mesh's names for the data,
            tensor, pipeline and expert dimensions (None: no such dimension).
        timeout: seconds for each collective.
    Raises:
        TypeError: bad chunks.
        ValueError: the first and last stages hold different tied parameters.

    Example::

        mesh = DeviceMesh((2, 2, 2), ("pp", "dp", "tp"))
        ...
        opt.zero_grad()
        loss = schedule.step(x, y)
        finalize_model_grads(stage.module, mesh=mesh)
        opt.step()
    """
    for attr in ("dim_names", "size", "get_group"):
        if not hasattr(mesh, attr):
            raise TypeError(f"finalize_model_grads: mesh must be a DeviceMesh, got "
                            f"{type(mesh).__name__}")
    params: List[Any] = []
    seen: set = set()
    handled: set = set()
    for item in chunk_list(model_chunks):
        sync = getattr(item, "sync_gradients", None)
        ps = params_of(item, "finalize_model_grads")
        if callable(sync):
            sync()  # (1) the wrapper finishes its own data-parallel reduction
            handled.update(id(p) for p in ps)
        params.extend(trainable(ps, seen))
    zero_missing_grads(params)

    # (2) tied embeddings between the first and last pipeline stages.
    if pp_dim is not None and pp_dim in tuple(mesh.dim_names) and mesh.size(pp_dim) > 1:
        last = int(mesh.size(pp_dim)) - 1
        emb_group = mesh.get_subgroup(pp_dim, (0, last))  # every rank: collective creation
        if emb_group is not None:
            _reduce_tied([p for p in params if getattr(p, "shared_embedding", False)],
                         emb_group, timeout)

    # (3) sequence-parallel parameters: partial sums over the TP group.
    tp_group, tp_size = _dim_group(mesh, tp_dim)
    sp = [p for p in params if getattr(p, "sequence_parallel", False)]
    if tp_size > 1 and sp:
        flat_reduce(sp, tp_group, ReduceOp.SUM, 1.0, timeout)

    # (4) data parallelism: dense over dp and ep, experts over dp only.
    dp_group, dp_size = _dim_group(mesh, dp_dim)
    ep_group, ep_size = _dim_group(mesh, ep_dim)
    todo = [p for p in params
            if id(p) not in handled and not getattr(p, "dp_reduced", False)]
    dense = [p for p in todo if not getattr(p, "expert", False)]
    expert = [p for p in todo if getattr(p, "expert", False)]
    if dense and dp_size * ep_size > 1:
        if dp_size > 1:
            flat_reduce(dense, dp_group, ReduceOp.AVG, 1.0, timeout)
        if ep_size > 1:
            flat_reduce(dense, ep_group, ReduceOp.AVG, 1.0, timeout)
    if expert and dp_size * ep_size > 1:
        # Each expert already summed its tokens from every ep rank; the global
        # mean loss divides by all dp*ep replicas.
        if dp_size > 1:
            flat_reduce(expert, dp_group, ReduceOp.AVG, 1.0 / ep_size, timeout)
        else:
            flat_reduce(expert, None, ReduceOp.SUM, 1.0 / ep_size, timeout)


def _reduce_tied(shared: Iterable[Any], group: Any, timeout: Optional[float]) -> None:
    """Sum tied gradients over the first/last-stage group, checking both sides agree."""
    shared = list(shared)
    n = sum(int(p.grad.size) for p in shared)
    # float64 carries any dtype's sum exactly enough and lets one header
    # (the element count) travel in the same buffer.
    flat = np.empty(1 + n, np.float64)
    flat[0] = n
    off = 1
    for p in shared:
        flat[off:off + p.grad.size] = p.grad.reshape(-1)
        off += p.grad.size
    group.all_reduce(flat, timeout=timeout)
    if int(round(flat[0])) != n * group.size:
        raise ValueError(f"finalize_model_grads: the first and last pipeline stages hold "
                         f"different numbers of shared_embedding gradient elements (this rank "
                         f"{n}, total {int(round(flat[0]))} over {group.size} ranks)")
    off = 1
    for p in shared:
        k = p.grad.size
        p.grad[...] = flat[off:off + k].reshape(p.grad.shape)
        off += k
