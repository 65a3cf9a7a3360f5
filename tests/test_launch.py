"""Real launch paths: mpirun (Open MPI from PyPI), torchrun-style variables, `ringlet run`."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import numpy as np, ringlet
    g = ringlet.init(timeout=60)
    x = np.full(3, ringlet.get_rank() + 1, np.float32)
    ringlet.all_reduce(x)
    n = ringlet.get_world_size()
    assert np.all(x == n * (n + 1) / 2), x
    print(f"OK rank={ringlet.get_rank()} size={n} sum={x[0]:g}", flush=True)
    ringlet.shutdown()
""")


def _env(**extra):
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("RINGLET_", "OMPI_", "PMI_", "SLURM_")) or k in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            del env[k]
    env.update(extra)
    return env


def _mpirun():
    exe = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(exe):
        return None
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return exe


def test_mpirun_bootstraps_through_mpi4py(tmp_path):
    if _mpirun() is None:  # declared test dependencies: missing is a failure
        pytest.fail("Open MPI / mpi4py not installed: pip install -e '.[test]'", pytrace=False)
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = _env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    out = subprocess.run([_mpirun(), "-n", "4", "--oversubscribe", sys.executable, str(script)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(l for l in out.stdout.splitlines() if l.startswith("OK")) == \
        [f"OK rank={r} size=4 sum=10" for r in range(4)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_style_environment(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    # torchrun hands every rank MASTER_PORT; rank 0 binds it.  The port is picked
    # here like torchrun's own default would be, so retry if someone took it.
    for _attempt in range(3):
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, str(script)], env=_env(
            RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), RINGLET_SECRET="torchrun-style-test-secret"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
        outs = [p.communicate(timeout=120) for p in procs]
        if all(p.returncode == 0 for p in procs):
            break
        if not any("Address already in use" in e for _, e in outs):
            break
    assert all(p.returncode == 0 for p in procs), outs
    lines = sorted(o.strip() for o, _ in outs)
    assert lines == [f"OK rank={r} size=3 sum=6" for r in range(3)]


def test_ringlet_run_launcher(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "4", str(script)],
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(4):
        assert f"OK rank={r} size=4 sum=10" in out.stdout
    assert "RINGLET_SECRET" not in out.stdout + out.stderr


def test_no_secret_off_loopback_is_refused(tmp_path):
    import ringlet
    from ringlet import _world
    from ringlet.errors import AuthenticationError

    # A non-loopback bind address with no secret must be refused before any connection.
    env_backup = {k: os.environ.pop(k) for k in ("RINGLET_SECRET", "RINGLET_SECRET_FILE",
                                                  "RINGLET_ALLOW_INSECURE") if k in os.environ}
    try:
        with pytest.raises(AuthenticationError, match="RINGLET_SECRET"):
            ringlet.init(rank=0, world_size=2, master_addr="10.255.255.1", master_port=1,
                         bind_addr="10.255.255.2", timeout=1)
    finally:
        os.environ.update(env_backup)
    assert not _world.is_initialized()
