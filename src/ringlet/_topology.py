"""Which ranks share a host: the same-host identity.

Two processes may share memory only if they run on one kernel, in one IPC
and mount view of it.  A host name alone does not say that: containers and
network namespaces often share or repeat names (every pod called "worker",
``mpirun`` on hosts that all report "localhost").  The identity is therefore
the kernel's boot id, the IPC and network namespace inodes, and the host
name, hashed; ``RINGLET_HOST_ID`` overrides it (tests use distinct values to
force TCP between ranks of one machine).

CPU binding (``RINGLET_BIND=auto|none``, default auto): left to itself the
scheduler balances a host's runnable tasks by count, so two ranks beside two
busy processes on two CPUs often share one CPU while the busy pair shares the
other, and every hand-over between the ranks becomes a context switch
(docs/launching.md, "CPU binding").  With ``auto`` the ranks of a host, when
no launcher bound them (every one may run on the same CPUs) and there are at
least as many of those CPUs as ranks, each take a contiguous block of them.
Binding and the wait policy count the ranks that share a *machine* (one
kernel, one process-id namespace: ``machine_id``), not a host: ranks in
different containers or network namespaces of one machine have distinct
host ids but compete for the same CPUs.
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import Dict, List, Optional, Sequence

from ._envvars import choice

__all__ = ["host_id", "machine_id", "host_groups", "HOST_ID_ENV", "BIND_ENV", "bind_mode", "cpu_digest",
           "cpu_ranges", "parse_cpu_ranges", "plan_binding", "owns_cpus", "bind_process"]

HOST_ID_ENV = "RINGLET_HOST_ID"
BIND_ENV = "RINGLET_BIND"
_BIND_MODES = ("auto", "none")


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(256).decode(errors="replace").strip()
    except OSError:
        return ""


def _ns(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def host_id(env: Optional[Dict[str, str]] = None) -> str:
    """This process's same-host identity, a short printable string.

    Args:
        env: environment to read ``RINGLET_HOST_ID`` from (default ``os.environ``).
    Returns:
        ``RINGLET_HOST_ID`` when set and non-empty, else 16 hex digits of a hash
        of the boot id, the IPC, mount and network namespaces and the host name.
    Raises:
        ValueError: ``RINGLET_HOST_ID`` longer than 64 characters or not printable.

    Example::

        same_host = host_id() == peer_host_id
    """
    e = os.environ if env is None else env
    forced = e.get(HOST_ID_ENV, "").strip()
    if forced:
        if len(forced) > 64 or not forced.isprintable():
            raise ValueError(f"{HOST_ID_ENV} must be at most 64 printable characters, "
                             f"got {forced!r}")
        return forced
    parts = (_read("/proc/sys/kernel/random/boot_id"), _ns("ipc"), _ns("mnt"), _ns("net"),
             socket.gethostname())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def machine_id(host: str = "") -> str:
    """This process's machine identity: which processes share its CPUs.

    Args:
        host: this process's ``host_id()``, the answer when the kernel's boot
            id cannot be read.
    Returns:
        16 hex digits of a hash of the boot id and the process-id namespace
        (so that process ids compare within a machine).  Unlike ``host_id``
        it ignores the network, IPC and mount namespaces, the host name and
        ``RINGLET_HOST_ID``: those set apart what may share memory, not CPUs.

    Example::

        shares_cpus_with_peer = machine_id() == peer_machine_id
    """
    boot = _read("/proc/sys/kernel/random/boot_id")
    if not boot:
        return host
    return hashlib.sha256(f"{boot}\0{_ns('pid')}".encode()).hexdigest()[:16]


def host_groups(ids: Sequence[str]) -> List[List[int]]:
    """Ranks grouped by host, in order of each host's lowest rank.

    Args:
        ids: ``ids[r]`` is rank r's ``host_id()``.
    Returns:
        A list of rank lists; each inner list is sorted.

    Example::

        host_groups(["a", "b", "a"])  # [[0, 2], [1]]
    """
    order: Dict[str, List[int]] = {}
    for r, h in enumerate(ids):
        order.setdefault(h, []).append(r)
    return list(order.values())


def bind_mode(env: Optional[Dict[str, str]] = None) -> str:
    """``RINGLET_BIND`` as ``auto`` (default) or ``none``.

    Raises:
        ValueError: any other value.
    """
    return choice(BIND_ENV, _BIND_MODES, env)


def cpu_digest(cpus: Sequence[int]) -> str:
    """A short digest of a CPU set: ranks compare these, not the sets (a set
    can list a thousand CPUs, and rank 0 sends every rank's to every rank)."""
    return hashlib.sha256(",".join(map(str, sorted(cpus))).encode()).hexdigest()[:16]


def cpu_ranges(cpus: Sequence[int]) -> str:
    """A CPU set in the kernel's list format, ``"0-3,8"``: short for the sets
    launchers bind ranks to, so ranks can send the sets themselves.

    Example::

        cpu_ranges([0, 1, 2, 3, 8])  # "0-3,8"
    """
    runs: List[List[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpu_ranges(text: str) -> Optional[set]:
    """The CPU set ``cpu_ranges`` wrote, or None if ``text`` is not one."""
    cpus: set = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            a, b = int(lo), int(hi) if hi else int(lo)
            if a < 0 or b < a or b - a > 1 << 16:
                return None
            cpus.update(range(a, b + 1))
    except ValueError:
        return None
    return cpus or None


def owns_cpus(rank: int, machines: Sequence[str], pids: Sequence[int],
              sets: Sequence[str]) -> bool:
    """Whether ``rank`` runs on CPUs no other rank of its machine may run on.

    Args:
        rank: this rank.
        machines, pids, sets: per rank, its ``machine_id()``, process id and
            ``cpu_ranges`` of the CPUs it may run on ("" when unknown).
    Returns:
        True when the machine has other ranks, each a process of its own whose
        set is known and shares no CPU with this rank's (a launcher bound
        them apart: ``mpirun --bind-to core``, ``srun --cpu-bind``).

    Example::

        owns_cpus(0, ["a", "a"], [10, 11], ["0", "1"])  # True
    """
    local = [r for r, m in enumerate(machines) if m == machines[rank]]
    if len(local) < 2 or len({pids[r] for r in local}) != len(local):
        return False
    mine = parse_cpu_ranges(sets[rank])
    if mine is None:
        return False
    for r in local:
        if r == rank:
            continue
        theirs = parse_cpu_ranges(sets[r])
        if theirs is None or pids[r] <= 0 or mine & theirs:
            return False
    return True


def plan_binding(rank: int, machines: Sequence[str], pids: Sequence[int],
                 digests: Sequence[str], cpus: Sequence[int]) -> Optional[List[int]]:
    """The CPUs ``rank`` should run on, or None to leave its affinity alone.

    Args:
        rank: this rank.
        machines, pids, digests: per rank, its ``machine_id()``, process id and
            ``cpu_digest`` of the CPUs it may run on.
        cpus: the CPUs this rank may run on.
    Returns:
        With L ranks on this machine, its block (the i-th of L contiguous,
        near-equal blocks of ``cpus``, i its position among them by rank);
        None when it runs alone on its machine, when ranks of its machine share a
        process (threads), when their CPU sets differ (a launcher bound them)
        or when they outnumber the CPUs (the scheduler must be free to move
        them then).

    Example::

        plan_binding(1, ["a", "a"], [10, 11], ["d", "d"], [0, 1, 2, 3])  # [2, 3]
    """
    local = [r for r, m in enumerate(machines) if m == machines[rank]]
    n, mine = len(local), sorted(cpus)
    if n < 2 or len(mine) < n:
        return None
    if len({pids[r] for r in local}) != n or any(pids[r] <= 0 for r in local):
        return None
    if any(digests[r] != digests[rank] for r in local):
        return None
    i = local.index(rank)
    return mine[i * len(mine) // n:(i + 1) * len(mine) // n]


def bind_process(cpus: Sequence[int]) -> None:
    """Restrict every thread of this process to ``cpus`` (threads started
    later inherit it).  A thread that exits meanwhile is skipped.

    Raises:
        OSError: the kernel refused the set for this thread.
    """
    want = set(cpus)
    os.sched_setaffinity(0, want)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, want)
        except (ProcessLookupError, PermissionError):
            pass
