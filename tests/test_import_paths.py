"""Every public import path of the parallel layers resolves, and old paths give the same objects.

Parallelism lives in ``ringlet.parallel``; the paths it had before
(``ringlet.mesh``, ``ringlet.dtensor``, ``ringlet.nn.tensor_parallel``,
``ringlet.pipeline`` and its submodules) are thin re-exports.  A user's import
must keep working and must hand back the very same class or function (so
``isinstance`` checks and monkeypatches agree across paths).
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

# (old path, new path): every name in the old module's __all__ is the new module's object
MOVED = [
    ("ringlet.mesh", "ringlet.parallel.mesh"),
    ("ringlet.dtensor", "ringlet.parallel.dtensor"),
    ("ringlet.nn.tensor_parallel", "ringlet.parallel.tensor_parallel"),
    ("ringlet.pipeline", "ringlet.parallel.pipeline"),
]

PIPELINE_SUBMODULES = ["layout", "runtime", "schedules", "split", "stage"]

# names documented or imported by users, by the path they use
PUBLIC = {
    "ringlet": ["DeviceMesh", "DTensor", "Shard", "Replicate", "Partial", "Placement",
                "distribute"],
    "ringlet.mesh": ["DeviceMesh"],
    "ringlet.dtensor": ["DTensor", "Partial", "Placement", "Replicate", "Shard", "distribute",
                        "shard_sizes"],
    "ringlet.nn": ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
                   "vocab_parallel_cross_entropy", "SequenceParallelScatter",
                   "SequenceParallelGather", "scatter_to_sequence_parallel",
                   "gather_from_sequence_parallel", "mark_sequence_parallel", "SyncBatchNorm",
                   "convert_sync_batchnorm"],
    "ringlet.parallel": ["DistributedDataParallel", "DDP", "GradBucket", "comm_hooks",
                         "finalize_model_grads", "FullyShardedDataParallel", "FSDP",
                         "MixedPrecision", "ShardingStrategy", "DeviceMesh", "DTensor"],
    "ringlet.parallel.fsdp": ["FSDP", "FullyShardedDataParallel", "MixedPrecision",
                              "ShardingStrategy"],
    "ringlet.parallel.ddp": ["DDP", "DistributedDataParallel", "GradBucket"],
    "ringlet.parallel.finalize": ["finalize_model_grads"],
    "ringlet.parallel.comm_hooks": ["allreduce_hook", "fp16_compress", "bf16_compress", "then"],
    "ringlet.pipeline": ["PipelineStage", "split_model", "PipelineSchedule", "ScheduleGPipe",
                         "Schedule1F1B", "ScheduleInterleaved1F1B", "PipelineError",
                         "StepStats", "Action", "ActionKind", "Plan", "ScheduleError",
                         "ScheduleTable", "SimResult", "plan_gpipe", "plan_1f1b",
                         "plan_interleaved_1f1b", "simulate", "bubble_fraction",
                         "PipelineDataGroups", "pipeline_data_groups", "all_reduce_gradients"],
}


@pytest.mark.parametrize("old,new", MOVED)
def test_moved_module_reexports_the_same_objects(old, new):
    o, n = importlib.import_module(old), importlib.import_module(new)
    assert o.__all__, old
    for name in o.__all__:
        assert getattr(o, name) is getattr(n, name), f"{old}.{name} is not {new}.{name}"


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_public_names_resolve(path):
    mod = importlib.import_module(path)
    for name in PUBLIC[path]:
        assert getattr(mod, name, None) is not None, f"{path}.{name} is missing"
    for name in getattr(mod, "__all__", ()):
        assert hasattr(mod, name), f"{path}.__all__ names {name!r}, which does not resolve"


@pytest.mark.parametrize("sub", PIPELINE_SUBMODULES)
def test_pipeline_submodules_are_the_same_modules(sub):
    # ``import ringlet.pipeline.runtime`` (and ``from ringlet.pipeline import
    # runtime``) must give the module itself, private helpers included.
    old = importlib.import_module(f"ringlet.pipeline.{sub}")
    new = importlib.import_module(f"ringlet.parallel.pipeline.{sub}")
    assert old is new
    import ringlet.pipeline as pp

    assert getattr(pp, sub) is new


def test_same_object_on_every_path():
    import ringlet
    from ringlet import mesh, dtensor, nn, parallel
    from ringlet.nn import tensor_parallel as nn_tp
    from ringlet.parallel import dtensor as p_dt, mesh as p_mesh, tensor_parallel as p_tp

    assert ringlet.DeviceMesh is mesh.DeviceMesh is p_mesh.DeviceMesh is parallel.DeviceMesh
    assert ringlet.DTensor is dtensor.DTensor is p_dt.DTensor is parallel.DTensor
    assert nn.ColumnParallelLinear is nn_tp.ColumnParallelLinear is p_tp.ColumnParallelLinear
    assert parallel.DDP is parallel.DistributedDataParallel
    assert parallel.FSDP is parallel.fsdp.FullyShardedDataParallel
    from ringlet import pipeline
    assert pipeline.Schedule1F1B is parallel.pipeline.Schedule1F1B


def test_importing_ringlet_loads_no_training_layer():
    # The package root only needs the mesh and DTensor; the training layers (and
    # ringlet.nn) load when first used, so no module sees a half-built package root.
    code = ("import sys, ringlet; "
            "print(sorted(m for m in sys.modules if m.startswith(('ringlet.nn', "
            "'ringlet.parallel.ddp', 'ringlet.parallel.fsdp', 'ringlet.pipeline', "
            "'ringlet.parallel.pipeline'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "[]", out


def test_every_parallel_module_imports_first():
    # Each module must import in a fresh interpreter before anything else of
    # ringlet (a cycle shows up only when the "wrong" module is imported first).
    import pathlib

    import ringlet

    root = pathlib.Path(ringlet.__file__).parent
    names = ["ringlet.mesh", "ringlet.dtensor", "ringlet.nn.tensor_parallel"]
    for f in sorted((root / "parallel").rglob("*.py")) + sorted((root / "pipeline").rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    # One interpreter: forget every ringlet module before each import.
    code = (
        "import importlib, sys, traceback\n"
        "bad = []\n"
        f"for n in {names!r}:\n"
        "    for m in [m for m in sys.modules if m == 'ringlet' or m.startswith('ringlet.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(n)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{n}: {type(e).__name__}: {e}')\n"
        "print(repr(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout.strip().splitlines()[-1]
    assert "ringlet.parallel._fsdp_state_dict" in names
    assert out == "[]", out
