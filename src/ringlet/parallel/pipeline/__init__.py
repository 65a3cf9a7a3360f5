"""Pipeline parallelism: a model cut into stages on consecutive ranks, fed microbatches.

* ``split_model`` cuts a ``ringlet.nn.Sequential`` into stages; ``PipelineStage``
  places one on a rank of the pipeline group.
* ``ScheduleGPipe``, ``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` run one
  training step with ``schedule.step(inputs, targets, loss_fn)``.  Each is a
  ``Plan`` (per-rank action lists, see ``schedules.py``) run by one generic
  runtime (``runtime.py``); ``schedule.table()`` prints the plan's grid.
* ``pipeline_data_groups`` and ``all_reduce_gradients`` combine the pipeline
  with data parallelism.

Example (4 ranks, ``ringlet run -n 4``)::

    import ringlet
    from ringlet import nn
    from ringlet.parallel.pipeline import PipelineStage, Schedule1F1B, split_model

    ringlet.init()
    rank, p = ringlet.get_rank(), ringlet.get_world_size()
    model = nn.Sequential(nn.Linear(16, 64, rng=0), nn.Tanh(), nn.Linear(64, 64, rng=1),
                          nn.Tanh(), nn.Linear(64, 1, rng=2))
    stage = PipelineStage(split_model(model, p)[rank], rank, p)
    sched = Schedule1F1B(stage, n_microbatches=8, loss_fn=nn.mse_loss)
    loss = sched.step(x if rank == 0 else None, y if rank == p - 1 else None)

See docs/pipeline.md.
"""

from .layout import PipelineDataGroups, all_reduce_gradients, pipeline_data_groups
from .runtime import (PipelineError, PipelineSchedule, Schedule1F1B, ScheduleGPipe,
                      ScheduleInterleaved1F1B, StepStats)
from .schedules import (Action, ActionKind, Plan, ScheduleError, ScheduleTable, SimResult,
                        bubble_fraction, plan_1f1b, plan_gpipe, plan_interleaved_1f1b, simulate)
from .split import split_model
from .stage import PipelineStage

__all__ = [
    "PipelineStage", "split_model",
    "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
    "PipelineError", "StepStats",
    "Action", "ActionKind", "Plan", "ScheduleError", "ScheduleTable", "SimResult",
    "plan_gpipe", "plan_1f1b", "plan_interleaved_1f1b", "simulate", "bubble_fraction",
    "PipelineDataGroups", "pipeline_data_groups", "all_reduce_gradients",
]
