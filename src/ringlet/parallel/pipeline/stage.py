"""``PipelineStage``: one slice of a model on one rank, and where its neighbours live.

Stages are numbered 0 .. num_stages-1 and placed on the pipeline group by
looping placement: stage s lives on group rank ``s % group.size``.  With one
stage per rank that is simply stage = rank; with v stages per rank
(interleaved schedules) rank r holds stages r, r+p, r+2p, ...
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence, Tuple

import numpy as np

import ringlet

from .schedules import MAX_STAGES

__all__ = ["PipelineStage"]


def _group_info(group) -> Tuple[int, int]:
    if group is not None and not isinstance(group, ringlet.ProcessGroup):
        raise TypeError(f"group must be a ringlet.ProcessGroup or None, got "
                        f"{type(group).__name__}")
    rank = ringlet.get_rank(group)
    size = ringlet.get_world_size(group)
    if rank < 0:
        raise ValueError(f"this process is not a member of the pipeline group (world ranks "
                         f"{getattr(group, 'ranks', '?')})")
    return rank, size


def _shape_spec(shape) -> Optional[Tuple[Optional[int], ...]]:
    if shape is None:
        return None
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"input_shape must be a sequence of ints or None, got "
                        f"{type(shape).__name__}") from None
    for d in dims:
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, np.integer))
                              or d < 0):
            raise ValueError(f"input_shape entries must be non-negative ints or None (any "
                             f"size), got {shape!r}")
    return tuple(None if d is None else int(d) for d in dims)


class PipelineStage:
    """A model slice that runs as stage ``stage_index`` of ``num_stages`` on this rank.

    Args:
        module: a ``ringlet.nn.Module`` (anything with ``forward(x)``,
            ``backward(grad_output) -> grad_input`` and ``parameters()``).  Its
            backward must consume saved contexts oldest first; schedules run
            each stage's backwards in the order of its forwards.
        stage_index: this stage's position in the pipeline, 0-based.
        num_stages: stages in the whole pipeline.
        group: the pipeline group (default: the world).  Stage s must be
            created on group rank ``s % group.size``.
        input_shape: optional shape of one microbatch's input to this stage,
            ``None`` for a dimension of any size, e.g. ``(None, 64)``.
        input_dtype: optional dtype of that input.  When given, every input
            (received or, on stage 0, passed to ``step``) is checked against
            them and a mismatch raises ``ValueError`` naming both.
    Raises:
        TypeError / ValueError: bad arguments, or the stage is created on the
            wrong rank (looping placement) or outside the group.

    Example::

        stage = PipelineStage(split_model(model, 4)[rank], rank, 4)
    """

    def __init__(self, module: Any, stage_index: int, num_stages: int, *, group=None,
                 input_shape: Optional[Sequence[Optional[int]]] = None,
                 input_dtype: Any = None) -> None:
        for attr in ("forward", "backward"):
            if not callable(getattr(module, attr, None)):
                raise TypeError(f"module must have a callable .{attr}() (a ringlet.nn.Module), "
                                f"got {type(module).__name__}")
        for v, what in ((stage_index, "stage_index"), (num_stages, "num_stages")):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{what} must be an int, got {type(v).__name__}")
        stage_index, num_stages = int(stage_index), int(num_stages)
        if not 1 <= num_stages <= MAX_STAGES:
            raise ValueError(f"num_stages must be in [1, {MAX_STAGES}], got {num_stages}")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
        rank, size = _group_info(group)
        if num_stages % size:
            raise ValueError(f"num_stages ({num_stages}) must be a multiple of the pipeline "
                             f"group size ({size}): stage s lives on group rank s % {size}")
        if stage_index % size != rank:
            raise ValueError(f"stage {stage_index} belongs on pipeline rank "
                             f"{stage_index % size} (looping placement, group size {size}), "
                             f"but this is rank {rank}")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.group_rank = rank
        self.group_size = size
        self.input_shape = _shape_spec(input_shape)
        self.input_dtype = None if input_dtype is None else np.dtype(input_dtype)

    # ---- placement ---------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def prev_rank(self) -> Optional[int]:
        """Group rank holding stage ``stage_index - 1`` (None on the first stage)."""
        return None if self.is_first else (self.stage_index - 1) % self.group_size

    @property
    def next_rank(self) -> Optional[int]:
        """Group rank holding stage ``stage_index + 1`` (None on the last stage)."""
        return None if self.is_last else (self.stage_index + 1) % self.group_size

    # ---- model -------------------------------------------------------------
    def parameters(self) -> Iterator[Any]:
        """The module's parameters (``module.parameters()``)."""
        params = getattr(self.module, "parameters", None)
        return iter(params()) if callable(params) else iter(())

    def check_input(self, x: np.ndarray, source: str) -> None:
        """Raise ``ValueError`` if ``x`` does not match the declared input shape/dtype."""
        problems = []
        if self.input_dtype is not None and x.dtype != self.input_dtype:
            problems.append(f"dtype {x.dtype} (expected {self.input_dtype})")
        if self.input_shape is not None:
            ok = len(self.input_shape) == x.ndim and all(
                e is None or e == d for e, d in zip(self.input_shape, x.shape))
            if not ok:
                want = "(" + ", ".join("*" if e is None else str(e) for e in self.input_shape) + ")"
                problems.append(f"shape {tuple(x.shape)} (expected {want})")
        if problems:
            raise ValueError(f"stage {self.stage_index}: input from {source} has "
                             + " and ".join(problems))

    def __repr__(self) -> str:
        return (f"<PipelineStage {self.stage_index}/{self.num_stages} on pipeline rank "
                f"{self.group_rank} of {self.group_size}: {type(self.module).__name__}>")
