"""``ringlet.pipeline``: old import path of ``ringlet.parallel.pipeline``, kept working.

The submodules (``ringlet.pipeline.runtime``, ``.schedules``, ...) are the
very modules of ``ringlet.parallel.pipeline``, registered under the old names
too, so ``import ringlet.pipeline.runtime`` and ``from ringlet.pipeline import
runtime`` give the same module object as the new path.
"""

import sys as _sys

from ..parallel.pipeline import (Action, ActionKind, PipelineDataGroups, PipelineError,
                                 PipelineSchedule, PipelineStage, Plan, Schedule1F1B,
                                 ScheduleError, ScheduleGPipe, ScheduleInterleaved1F1B,
                                 ScheduleTable, SimResult, StepStats, all_reduce_gradients,
                                 bubble_fraction, pipeline_data_groups, plan_1f1b, plan_gpipe,
                                 plan_interleaved_1f1b, simulate, split_model)
from ..parallel.pipeline import layout, runtime, schedules, split, stage

for _m in (layout, runtime, schedules, split, stage):
    _sys.modules[f"{__name__}.{_m.__name__.rsplit('.', 1)[1]}"] = _m

__all__ = [
    "PipelineStage", "split_model",
    "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
    "PipelineError", "StepStats",
    "Action", "ActionKind", "Plan", "ScheduleError", "ScheduleTable", "SimResult",
    "plan_gpipe", "plan_1f1b", "plan_interleaved_1f1b", "simulate", "bubble_fraction",
    "PipelineDataGroups", "pipeline_data_groups", "all_reduce_gradients",
]
