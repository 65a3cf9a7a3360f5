"""Recovery (shutdown() then init() after a failure) under every launcher; world-size
mismatches, missing ranks and port clashes at init (docs/errors.md, docs/launching.md)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import ringlet
from ringlet import _world
from ringlet.errors import RendezvousError

SRC = os.path.dirname(os.path.dirname(os.path.abspath(ringlet.__file__)))
ROUNDS = 20

# Every round: a fresh world must work (an all_reduce checked against its
# oracle), then fail in one of two ways, then shut down:
#  - even rounds, a desync (rank 0 reduces 4 elements, the others 8): every
#    rank raises and the generation's abort record is set;
#  - odd rounds, a straggler: rank 1 reduces alone while the others shut
#    down, so its failure (and abort record) lands in a generation the others
#    have already left, often while they are joining the next one.
# A new world that read an old world's endpoints or abort record fails the
# next round's all_reduce or init.
RECOVER = textwrap.dedent("""
    import json, sys, numpy as np, ringlet
    from ringlet import _world
    rounds = int(sys.argv[1])
    gens, errors = [], set()
    for i in range(rounds):
        ringlet.init(timeout=60)
        r, n = ringlet.get_rank(), ringlet.get_world_size()
        gens.append(_world.default_world().gen)
        x = np.full(5, r + i, np.float64)
        ringlet.all_reduce(x)
        assert np.all(x == n * (n - 1) / 2 + n * i), (i, x)
        # Everyone has its result before anyone fails: otherwise this round's
        # failure could legitimately cancel a slow rank's all_reduce above.
        w = _world.default_world()
        w.store.set(f"{w.prefix}test/done/{r}", b"")
        w.store.wait([f"{w.prefix}test/done/{q}" for q in range(n)], timeout=60)
        if i % 2 == 0:
            y = np.ones(4 if r == 0 else 8, np.float32)
            try:
                ringlet.all_reduce(y)
                raise SystemExit(f"round {i}: a desynced all_reduce did not fail")
            except ringlet.RingletError as exc:
                errors.add(type(exc).__name__)
        elif r == 1:
            try:
                ringlet.all_reduce(np.ones(3, np.float32))
                raise SystemExit(f"round {i}: an all_reduce without peers did not fail")
            except ringlet.RingletError as exc:
                errors.add(type(exc).__name__)
        ringlet.shutdown()
    print("RECOVERED", r, json.dumps(gens, separators=(",", ":")), ",".join(sorted(errors)),
          flush=True)
""")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RINGLET_", "OMPI_", "PMI_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_recovered(stdout: str, n: int, gens) -> None:
    lines = sorted(l[l.index("RECOVERED"):] for l in stdout.splitlines() if "RECOVERED" in l)
    assert len(lines) == n, stdout
    for r, line in enumerate(lines):
        _tag, rank, got, errors = line.split(" ")
        assert int(rank) == r
        assert json.loads(got) == list(gens), line
        assert set(errors.split(",")) <= {"DesyncError", "PeerClosedError", "CollectiveTimeout"}, line


def test_recovery_loop_under_ringlet_run(tmp_path):
    script = tmp_path / "recover.py"
    script.write_text(RECOVER)
    out = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "3", "--timeout", "120",
                          str(script), str(ROUNDS)], env=_env(), capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    # The launcher's store outlives every world: generations 1..ROUNDS.
    _check_recovered(out.stdout, 3, range(1, ROUNDS + 1))


def test_recovery_loop_under_torchrun_variables(tmp_path):
    script = tmp_path / "recover.py"
    script.write_text(RECOVER)
    for _attempt in range(3):
        port = _free_port()
        procs = [subprocess.Popen(
            [sys.executable, str(script), str(ROUNDS)],
            env=_env(RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), RINGLET_SECRET="recovery-test-secret-0123456789"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
        outs = [p.communicate(timeout=180) for p in procs]
        if not any("Address already in use" in e for _, e in outs):
            break
    assert all(p.returncode == 0 for p in procs), outs
    # Rank 0 keeps its store across shutdown()/init(): generations 1..ROUNDS.
    _check_recovered("".join(o for o, _ in outs), 3, range(1, ROUNDS + 1))


def _mpirun():
    exe = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(exe):
        return None
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return exe


@pytest.mark.skipif(_mpirun() is None, reason="Open MPI / mpi4py not installed")
def test_recovery_loop_under_mpirun(tmp_path):
    script = tmp_path / "recover.py"
    script.write_text(RECOVER)
    env = _env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    out = subprocess.run([_mpirun(), "-n", "3", "--oversubscribe", sys.executable, str(script),
                          str(ROUNDS)], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    # Every init bootstraps a fresh store over MPI: always generation 1.
    _check_recovered(out.stdout, 3, [1] * ROUNDS)
