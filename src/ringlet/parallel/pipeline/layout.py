"""Pipeline × data parallelism: the 2-D group layout and the gradient all-reduce.

With ``pp`` pipeline stages and ``dp`` data-parallel replicas the world's
``pp·dp`` ranks form a grid.  World rank ``d·pp + s`` runs stage s of
replica d, so each pipeline is a block of consecutive ranks (neighbouring
stages exchange activations most often) and the ranks that hold the same
stage in different replicas form a data-parallel group::

    pp=2, dp=2:   pipeline groups [0, 1], [2, 3]     data groups [0, 2], [1, 3]

After a pipelined step every replica holds the gradients of its own data;
``all_reduce_gradients`` averages each stage's gradients over its data group
before the optimizer step.  The groups are those of a ``DeviceMesh`` of shape
``(dp, pp)`` and the reduction is the one ``finalize_model_grads`` uses.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from ..._dtypes import ReduceOp
from ... import get_rank, get_world_size
from .._grads import chunk_list, flat_reduce, params_of, trainable, zero_missing_grads
from ..mesh import DeviceMesh, _group_or_world

__all__ = ["PipelineDataGroups", "pipeline_data_groups", "all_reduce_gradients"]


class PipelineDataGroups(NamedTuple):
    """This rank's place in a pipeline × data layout.

    Attributes:
        pp_group: the pipeline group (this replica's stages, in stage order).
        dp_group: the data-parallel group (this stage in every replica).
        stage: this rank's pipeline rank: its rank in ``pp_group``, which is its stage
            with one stage per rank (``PipelineStage`` places stage s on group
            rank ``s % p``).  With a custom mesh whose pp lines are not in
            increasing world-rank order this differs from the mesh coordinate:
            stages follow the group ranks.
        replica: this rank's coordinate along the data-parallel dimension (the
            same on every stage of one pipeline; its data-parallel rank with the
            default layout).
    """

    pp_group: Any
    dp_group: Any
    stage: int
    replica: int


def pipeline_data_groups(pp_size: Optional[int] = None, dp_size: Optional[int] = None, *,
                         mesh=None, pp_dim: str = "pp", dp_dim: str = "dp",
                         timeout: Optional[float] = None) -> PipelineDataGroups:
    """Create the pipeline and data-parallel groups of a ``pp_size × dp_size`` layout.

    Every rank of the world calls it (it creates every group, in the same
    order: it builds a ``DeviceMesh((dp_size, pp_size), (dp_dim, pp_dim))``).
    World rank ``d·pp_size + s`` is stage s of replica d.

    Args:
        pp_size: ranks per pipeline.
        dp_size: number of replicas; ``pp_size * dp_size`` must equal the world size.
        mesh: instead of sizes, a ``ringlet.DeviceMesh`` with dimensions named
            ``pp_dim`` and ``dp_dim`` (its groups already exist; nothing is created).
        timeout: passed to ``new_group``.
    Returns:
        ``PipelineDataGroups(pp_group, dp_group, stage, replica)`` for this rank.
    Raises:
        ValueError: the sizes do not multiply to the world size.

    Example::

        pp_group, dp_group, stage, replica = pipeline_data_groups(2, 2)   # on 4 ranks
    """
    if mesh is not None:
        if pp_size is not None or dp_size is not None:
            raise ValueError("give either mesh= or pp_size/dp_size, not both")
        names = tuple(mesh.dim_names)
        for d in (pp_dim, dp_dim):
            if d not in names:
                raise ValueError(f"mesh has no dimension {d!r} (it has {names})")
        coord = mesh.coordinate
        if coord is None:
            raise ValueError("this rank is not part of the mesh")
        pp_group = mesh.get_group(pp_dim)
        # PipelineStage places stage s on pipeline *group* rank s % p, and a
        # group orders its members by world rank: with a custom layout whose
        # pp line is not increasing, that differs from the mesh coordinate.
        stage = int(get_rank(pp_group))
        return PipelineDataGroups(pp_group, mesh.get_group(dp_dim), stage,
                                  int(coord[names.index(dp_dim)]))
    for v, what in ((pp_size, "pp_size"), (dp_size, "dp_size")):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{what} must be a positive int, got {v!r}")
    world = get_world_size()
    if pp_size * dp_size != world:
        raise ValueError(f"pp_size {pp_size} x dp_size {dp_size} = {pp_size * dp_size} ranks, "
                         f"but the world has {world}")
    # Row-major (dp, pp): world rank d*pp_size + s sits at coordinate (d, s).
    mesh = DeviceMesh((int(dp_size), int(pp_size)), (dp_dim, pp_dim), timeout=timeout)
    return pipeline_data_groups(mesh=mesh, pp_dim=pp_dim, dp_dim=dp_dim)


def all_reduce_gradients(stages: Any, group: Any, *, average: bool = True,
                         timeout: Optional[float] = None) -> None:
    """All-reduce the gradients of ``stages`` over the data-parallel ``group``, in place.

    Gradients are packed into one flat buffer per dtype, reduced with one
    all-reduce each, and written back into each ``param.grad`` in place.  A
    parameter with no gradient yet counts as zeros (and gets a zero
    gradient), so every replica reduces the same layout.  Call it on every
    rank of ``group``, after ``schedule.step`` and before ``optimizer.step``.

    Args:
        stages: a ``PipelineStage``, a ``Module``, or a list of either (or of
            ``Parameter`` s); the same structure on every rank of ``group``.
        group: the data-parallel ``ProcessGroup`` (e.g. from ``pipeline_data_groups``).
        average: divide by the group size (the default, matching a mean loss
            over the global batch); False sums.
        timeout: seconds for each all-reduce (default: the group's).
    Raises:
        TypeError: unsupported items.

    Example::

        schedule.step(x, y)
        all_reduce_gradients(stage, dp_group)
        optimizer.step()
    """
    seen: set = set()
    params = []
    for item in chunk_list(stages):
        params.extend(trainable(params_of(item, "all_reduce_gradients", "stages"), seen))
    group = _group_or_world(group)
    if group.size == 1 or not params:
        return
    zero_missing_grads(params)
    flat_reduce(params, group, ReduceOp.AVG if average else ReduceOp.SUM, 1.0, timeout)
