"""Where am I in the job?  Launcher detection, network interface choice, the job secret.

``detect()`` reads rank, world size and the rendezvous address from whichever
launcher started this process:

==========  ==============================================  ===========================
source      rank / world size / local rank / local size     rendezvous address
==========  ==============================================  ===========================
ringlet     RINGLET_RANK, RINGLET_WORLD_SIZE,               RINGLET_MASTER_ADDR/_PORT
            RINGLET_LOCAL_RANK, RINGLET_LOCAL_WORLD_SIZE
torchrun    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE  MASTER_ADDR/MASTER_PORT
openmpi     OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK,       none: bootstrap via mpi4py
            _LOCAL_SIZE
mpich       PMI_RANK, PMI_SIZE, MPI_LOCALRANKID,            none: bootstrap via mpi4py
            MPI_LOCALNRANKS
slurm       SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,      first node of SLURM_STEP_NODELIST
            tasks on this node from                         (or SLURM_JOB_NODELIST); port
            SLURM_STEP_TASKS_PER_NODE + SLURM_NODEID        20000 + (SLURM_JOB_ID +
                                                            7919 SLURM_STEP_ID) % 20000
==========  ==============================================  ===========================

When several are set, RINGLET_* wins; then RANK/WORLD_SIZE if torchrun set them
(TORCHELASTIC_RUN_ID or GROUP_RANK beside them: torchrun under srun or mpirun,
one agent per node); then Open MPI's, then MPICH's variables, which only their
launcher sets, and a hand-set RANK/WORLD_SIZE that disagrees with them is an
error rather than a guess (a stale export would give ranks the wrong places);
then RANK/WORLD_SIZE; then Slurm's (an interactive ``srun --pty bash`` or a
batch script sets them for a shell that may start a job by hand).

RINGLET_MASTER_ADDR / RINGLET_MASTER_PORT override the address for every
source.  MASTER_ADDR / MASTER_PORT (torch's env:// pair) count only beside
the variables they belong with: for the ringlet and torchrun sources.  Open
MPI, MPICH and Slurm never set them and bring their own rendezvous (the MPI
bootstrap, Slurm's first node), so under them a MASTER_ADDR is left from an
earlier torchrun or meant for torch's own store: it is passed over
(``LaunchEnv.ignored`` names it; ``init`` logs it at debug level).  Missing
local rank / size fall back to the global ones (one host).

Slurm's port rule gives every job step its own port in [20000, 40000) without
any coordination (step 0 takes 20000 + the job id mod 20000, later steps are
spread from it); two steps sharing the first node collide only when their
numbers are congruent mod 20000.  Set RINGLET_MASTER_PORT to override it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import socket
import stat
import struct
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Tuple

from .errors import RendezvousError

if TYPE_CHECKING:
    from .store import StoreServer

__all__ = ["LaunchEnv", "detect", "ignored_note", "torchrun_agent_store", "is_loopback",
           "select_bind_address", "list_interfaces", "parse_nodelist", "load_secret",
           "mpi_bootstrap", "own_session_note", "OWN_RENDEZVOUS", "MIN_SECRET_BYTES"]

MIN_SECRET_BYTES = 16
SOURCES = ("ringlet", "torchrun", "openmpi", "mpich", "slurm")


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job, as its launcher described it.

    Attributes:
        rank, world_size: global rank and number of ranks.
        local_rank, local_world_size: rank among the ranks on this host, and
            their number.
        master_addr, master_port: where the rendezvous store is served; None
            under MPI without an explicit address (``init`` then bootstraps
            through mpi4py).
        source: "ringlet", "torchrun", "openmpi", "mpich" or "slurm".
        ignored: ``"NAME=value"`` of each MASTER_ADDR / MASTER_PORT that is
            set but does not count for this source (Open MPI, MPICH, Slurm:
            only RINGLET_MASTER_ADDR / RINGLET_MASTER_PORT override their
            rendezvous).  Not part of equality.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: Optional[str]
    master_port: Optional[int]
    source: str
    ignored: Tuple[str, ...] = field(default=(), compare=False)


# ---- detection ----------------------------------------------------------------------------
def _get(env: Mapping[str, str], name: str) -> Optional[str]:
    v = env.get(name)
    if v is None:
        return None
    v = v.strip()
    return v or None


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> Optional[int]:
    v = _get(env, name)
    if v is None:
        return None
    try:
        n = int(v, 10)
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None
    if n < minimum:
        raise ValueError(f"environment variable {name}={n} must be >= {minimum}")
    return n


def _first_int(env: Mapping[str, str], names: Tuple[str, ...], minimum: int = 0
               ) -> Tuple[Optional[int], Optional[str]]:
    for name in names:
        n = _int(env, name, minimum=minimum)
        if n is not None:
            return n, name
    return None, None


def _port(env: Mapping[str, str],
          names: Tuple[str, ...] = ("RINGLET_MASTER_PORT", "MASTER_PORT"),
          ) -> Tuple[Optional[int], Optional[str]]:
    for name in names:
        p = _int(env, name, minimum=1)
        if p is not None:
            if p > 65535:
                raise ValueError(f"environment variable {name}={p} is not a TCP port (1..65535)")
            return p, name
    return None, None


# Launchers that bring their own rendezvous and never set MASTER_ADDR /
# MASTER_PORT: a pair found under them is not theirs (a stale export from a
# torchrun session, or meant for torch's own store, whose port would clash).
OWN_RENDEZVOUS = ("openmpi", "mpich", "slurm")
_TORCH_ADDR_VARS = ("MASTER_ADDR", "MASTER_PORT")


def _rendezvous(env: Mapping[str, str], source: str
                ) -> Tuple[Optional[str], Optional[int], Tuple[str, ...]]:
    """``(address, port, ignored)`` as the variables give them for ``source``."""
    if source in OWN_RENDEZVOUS:
        ignored = tuple(f"{n}={_get(env, n)}" for n in _TORCH_ADDR_VARS
                        if _get(env, n) is not None)
        port, _ = _port(env, ("RINGLET_MASTER_PORT",))
        return _get(env, "RINGLET_MASTER_ADDR"), port, ignored
    port, _ = _port(env)
    return _get(env, "RINGLET_MASTER_ADDR") or _get(env, "MASTER_ADDR"), port, ()


def ignored_note(launched: Optional["LaunchEnv"]) -> str:
    """What a launch passed over, as a sentence for a log line or an error ("" if nothing)."""
    if launched is None or not launched.ignored:
        return ""
    how = {"slurm": "Slurm's first node (or the MPI bootstrap)"}.get(launched.source,
                                                                    "the MPI bootstrap")
    return (f"{', '.join(launched.ignored)} ignored: under {launched.source} the rendezvous "
            f"address comes from {how}, and MASTER_ADDR/MASTER_PORT are torchrun's (often "
            f"left from an earlier job); set RINGLET_MASTER_ADDR and RINGLET_MASTER_PORT to "
            f"choose the address")


_SPECS = (
    # source, rank variable, size variable, local rank variables, local size variables
    ("ringlet", "RINGLET_RANK", "RINGLET_WORLD_SIZE", ("RINGLET_LOCAL_RANK",),
     ("RINGLET_LOCAL_WORLD_SIZE",)),
    ("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    ("mpich", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID",), ("MPI_LOCALNRANKS",)),
    ("slurm", "SLURM_PROCID", None, ("SLURM_LOCALID",), ()),
)
# torchrun (torch.distributed.elastic) sets these beside RANK/WORLD_SIZE; a shell
# export or a job script that sets RANK/WORLD_SIZE by hand does not.
TORCHRUN_MARKERS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK")
_MPI_LAUNCHER = {"openmpi": "Open MPI's mpirun", "mpich": "MPICH's mpiexec (or another PMI "
                 "process manager)"}


def detect(environ: Optional[Mapping[str, str]] = None) -> Optional[LaunchEnv]:
    """Work out rank, world size and rendezvous address from the launcher's variables.

    Which launcher's variables count when several are set (docs/launching.md,
    "Which launcher wins"): RINGLET_RANK/RINGLET_WORLD_SIZE always; else
    RANK/WORLD_SIZE when torchrun set them (TORCHELASTIC_RUN_ID or GROUP_RANK
    beside them); else an MPI launcher's (Open MPI, then MPICH), which must
    agree with a hand-set RANK/WORLD_SIZE; else RANK/WORLD_SIZE; else Slurm's.

    Args:
        environ: the environment to read (default: ``os.environ``).
    Returns:
        A ``LaunchEnv``, or None when no launcher variables are set (a
        stand-alone process).
    Raises:
        ValueError: a variable is malformed (not an integer, rank >= world
            size, only one of a rank/size pair set while no later launcher's
            variables are complete); or RANK/WORLD_SIZE set without torchrun's
            markers disagree with the MPI launcher's rank and size (a stale
            export: the message names both sets and their values).
        RendezvousError: Slurm's first node name does not resolve.

    Example::

        env = detect()
        if env is not None:
            print(env.source, env.rank, env.world_size)
    """
    env = os.environ if environ is None else environ
    # A pair half set (WORLD_SIZE exported by a batch script, say) is an error
    # only if no later launcher's variables are complete.
    half: List[str] = []
    specs = {spec[0]: spec for spec in _SPECS}
    found = _read_source(env, specs["ringlet"], half)
    if found is not None:
        return found  # explicit: never second-guessed
    torch = _read_source(env, specs["torchrun"], half)
    if torch is not None and any(_get(env, m) is not None for m in TORCHRUN_MARKERS):
        # torchrun started this process; an srun or mpirun around it (one agent
        # per node) numbers nodes, not ranks.
        return torch
    for source in ("openmpi", "mpich"):
        mpi = _read_source(env, specs[source], half)
        if mpi is None:
            continue
        if torch is not None and (torch.rank, torch.world_size) != (mpi.rank, mpi.world_size):
            raise ValueError(_conflict(env, specs["torchrun"], specs[source]))
        return torch or mpi
    if torch is not None:
        return torch
    found = _read_source(env, specs["slurm"], half)
    if found is not None:
        return found
    if half:
        raise ValueError(half[0])
    return None


def _conflict(env: Mapping[str, str], torch_spec: tuple, mpi_spec: tuple) -> str:
    def values(spec: tuple) -> str:
        return f"{spec[1]}={_get(env, spec[1])}, {spec[2]}={_get(env, spec[2])}"

    return (f"conflicting launcher variables: {values(mpi_spec)} ({mpi_spec[0]}: set by "
            f"{_MPI_LAUNCHER[mpi_spec[0]]}, which started this process) but "
            f"{values(torch_spec)} (set by hand or left over: torchrun would also have set "
            f"{' or '.join(TORCHRUN_MARKERS)}). Each rank would take the wrong place in the "
            f"job. Unset RANK and WORLD_SIZE (and LOCAL_RANK, LOCAL_WORLD_SIZE) before "
            f"launching with mpirun or mpiexec, or set RINGLET_RANK and RINGLET_WORLD_SIZE "
            f"to choose explicitly")


def _read_source(env: Mapping[str, str], spec: tuple, half: List[str]) -> Optional[LaunchEnv]:
    """One launcher's ``LaunchEnv``, or None when its variables are absent or half set
    (then a message goes to ``half``).

    Raises:
        ValueError: a malformed value.
        RendezvousError: Slurm's first node name does not resolve.
    """
    source, rank_var, size_var, lrank_vars, lsize_vars = spec
    if source == "slurm":
        if _get(env, rank_var) is None:
            return None
        size, size_var = _first_int(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
                                          "SLURM_NPROCS"), minimum=1)
        if size is None:
            raise ValueError("SLURM_PROCID is set but none of SLURM_STEP_NUM_TASKS, "
                             "SLURM_NTASKS, SLURM_NPROCS is")
    else:
        has_rank, has_size = _get(env, rank_var) is not None, _get(env, size_var) is not None
        if not has_rank and not has_size:
            return None
        if not (has_rank and has_size):
            missing = size_var if has_rank else rank_var
            present = rank_var if has_rank else size_var
            half.append(f"{present} is set but {missing} is not; a {source} launch sets both")
            return None
        size = _int(env, size_var, minimum=1)
    rank = _int(env, rank_var)
    if rank >= size:
        raise ValueError(f"{rank_var}={rank} is not below {size_var}={size}")
    lrank, lrank_var = _first_int(env, lrank_vars)
    if source == "slurm":
        lsize, lsize_var = _slurm_local_size(env)
    else:
        lsize, lsize_var = _first_int(env, lsize_vars, minimum=1)
    if lrank is None:
        lrank, lrank_var = rank, rank_var
    if lsize is None:
        lsize, lsize_var = size, size_var
    if lrank >= lsize:
        raise ValueError(f"{lrank_var}={lrank} is not below {lsize_var}={lsize}")
    addr, port, ignored = _rendezvous(env, source)
    if source == "slurm":
        if addr is None:
            addr = _slurm_master(env)
        if port is None:
            job, _ = _first_int(env, ("SLURM_JOB_ID", "SLURM_JOBID"))
            if job is not None:
                # The step too: steps of one job run side by side (srun a & srun b).
                step, _ = _first_int(env, ("SLURM_STEP_ID", "SLURM_STEPID"))
                port = 20000 + (job + 7919 * (step or 0)) % 20000
    return LaunchEnv(rank, size, lrank, lsize, addr, port, source, ignored)


def torchrun_agent_store(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when torchrun's agent serves its own TCPStore on MASTER_PORT.

    torchrun (torch >= 2.4) sets TORCHELASTIC_USE_AGENT_STORE=True; rank 0 then
    cannot bind MASTER_PORT, and ringlet's store goes on a port the OS picks,
    published through torch's store.  An explicit RINGLET_MASTER_PORT wins.
    """
    env = os.environ if environ is None else environ
    flag = (_get(env, "TORCHELASTIC_USE_AGENT_STORE") or "").lower()
    return flag in ("true", "1") and _get(env, "RINGLET_MASTER_PORT") is None


def _slurm_local_size(env: Mapping[str, str]) -> Tuple[Optional[int], Optional[str]]:
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        spec = _get(env, var)
        if spec is None:
            continue
        counts = _parse_tasks_per_node(spec, var)
        node = _int(env, "SLURM_NODEID") or 0
        if node >= len(counts):
            raise ValueError(f"SLURM_NODEID={node} is out of range for {var}={spec!r}")
        return counts[node], var
    return _first_int(env, ("SLURM_NTASKS_PER_NODE",), minimum=1)


def _parse_tasks_per_node(spec: str, var: str) -> List[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out: List[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"{var}={spec!r} is not a Slurm tasks-per-node list "
                             f"(like '2(x3),1')")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def _slurm_master(env: Mapping[str, str]) -> Optional[str]:
    for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        spec = _get(env, var)
        if spec is None:
            continue
        hosts = parse_nodelist(spec, var)
        if not hosts:
            raise ValueError(f"{var}={spec!r} names no hosts")
        host = hosts[0]
        try:
            infos = socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise RendezvousError(f"Slurm's first node {host!r} (from {var}) does not resolve: "
                                  f"{exc}; set RINGLET_MASTER_ADDR") from None
        # Prefer IPv4: it is what interface selection (SIOCGIFADDR) reports.
        infos.sort(key=lambda i: i[0] != socket.AF_INET)
        return infos[0][4][0]
    return None


def parse_nodelist(spec: str, var: str = "nodelist") -> List[str]:
    """Expand a Slurm host list: ``"node[01-03,07],gpu5"`` -> node01 node02 node03 node07 gpu5.

    Ranges keep the zero padding of their first bound; several bracket groups
    in one name expand as a product (``"r[1-2]n[1-2]"`` -> r1n1 r1n2 r2n1 r2n2).

    Raises:
        ValueError: unbalanced brackets or a bad range (the message names ``var``).
    """
    hosts: List[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(spec + ","):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"{var}={spec!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{var}={spec!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            item = spec[start:i].strip()
            if item:
                hosts.extend(_expand_host(item, spec, var))
            start = i + 1
    if depth != 0:
        raise ValueError(f"{var}={spec!r}: unbalanced '['")
    return hosts


def _expand_host(item: str, spec: str, var: str) -> List[str]:
    lb = item.find("[")
    if lb < 0:
        return [item]
    rb = item.index("]", lb)
    prefix, body, rest = item[:lb], item[lb + 1:rb], item[rb + 1:]
    values: List[str] = []
    for part in body.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"{var}={spec!r}: bad range {part!r} in [{body}]")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"{var}={spec!r}: range {part!r} runs backwards")
        if int(hi) - int(lo) > 100000:
            raise ValueError(f"{var}={spec!r}: range {part!r} is implausibly large")
        width = len(lo)
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    tails = _expand_host(rest, spec, var) if rest else [""]
    return [prefix + v + t for v in values for t in tails]


# ---- scheduling -----------------------------------------------------------------------------
_AUTOGROUP_SYSCTL = "/proc/sys/kernel/sched_autogroup_enabled"


def usable_cpus() -> int:
    """How many CPUs this process may run on (its affinity mask where known)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def own_session_note(local_world_size: int) -> Optional[str]:
    """A warning for a rank that will wait slowly, or None.

    With more ranks on this host than CPUs this process may run on, ranks
    take turns on cores, and a waiting rank hands its core to the others by
    yielding.  With the kernel's scheduler autogroups (every session a group
    of its own) a yield reaches only tasks of the yielder's session, so ranks
    that each lead a session of their own (torchrun and MPICH's mpiexec start
    them so) keep half a shared core while they wait.  ``ringlet run`` and Open
    MPI's mpirun keep their ranks in one session.
    """
    if local_world_size < 2:
        return None
    cpus = usable_cpus()
    try:
        with open(_AUTOGROUP_SYSCTL) as f:
            autogroups = f.read().strip() == "1"
        leader = os.getsid(0) == os.getpid()
    except OSError:
        return None
    if not (autogroups and leader and local_world_size > cpus):
        return None
    return (f"ringlet: {local_world_size} ranks on this host share {cpus} CPU(s) and this rank "
            "leads a session of its own (as torchrun and MPICH's mpiexec start ranks); with "
            "kernel.sched_autogroup_enabled=1 a waiting rank cannot yield its core to the rank "
            "it waits for, and small collectives can take twice as long. Launch with "
            "`ringlet run` or Open MPI's mpirun, or set kernel.sched_autogroup_enabled=0 "
            "(docs/launching.md)")


# ---- addresses ------------------------------------------------------------------------------
def is_loopback(host: Optional[str]) -> bool:
    """True when ``host`` names this machine's loopback (127.0.0.0/8, ::1, "localhost").

    Hostnames are resolved; a name that does not resolve is not loopback.

    Example::

        is_loopback("127.0.0.1")   # True
        is_loopback("10.0.0.5")    # False
    """
    if not host:
        return False
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(h.split("%", 1)[0])
    except ValueError:
        try:
            infos = socket.getaddrinfo(h, None, 0, socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            return False
        return bool(infos) and all(is_loopback(i[4][0]) for i in infos)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


_SIOCGIFADDR = 0x8915


def list_interfaces() -> List[Tuple[str, str]]:
    """``(name, IPv4 address)`` of every interface that has one, in kernel order (Linux).

    Raises:
        RendezvousError: the platform cannot list interface addresses.
    """
    try:
        import fcntl
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError, AttributeError) as exc:
        raise RendezvousError(f"cannot list network interfaces on this platform ({exc}); "
                              f"pass bind_addr= or unset RINGLET_IFNAME") from None
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                req = struct.pack("256s", name.encode()[:15])
                res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:
                continue  # no IPv4 address on this interface
            out.append((name, socket.inet_ntoa(res[20:24])))
    return out


def _match_interfaces(spec: str, ifaces: List[Tuple[str, str]]) -> List[Tuple[str, str]]:
    s = spec.strip()
    exclude = s.startswith("^")
    if exclude:
        s = s[1:]
    exact = s.startswith("=")
    if exact:
        s = s[1:]
    pats = [p.strip() for p in s.split(",") if p.strip()]
    if not pats:
        raise ValueError(f"RINGLET_IFNAME={spec!r} names no interface")

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in pats)

    return [(n, a) for n, a in ifaces if hit(n) != exclude]


def select_bind_address(master_addr: Optional[str], ifname: Optional[str] = None) -> str:
    """Choose the local address this rank listens on.

    With ``ifname`` (the value of RINGLET_IFNAME, NCCL syntax): comma-separated
    name prefixes ("eth,ib"); a leading "^" excludes them ("^docker,lo"); a
    leading "=" matches exact names ("=eth0"; "^=" excludes exact names).  The
    first matching interface with an IPv4 address wins, non-loopback ones
    first.  Without ``ifname``: "127.0.0.1" when ``master_addr`` is None or
    loopback, else the local address the kernel routes ``master_addr``
    through.

    Args:
        master_addr: the rendezvous host, or None (single host).
        ifname: interface selection, e.g. ``os.environ.get("RINGLET_IFNAME")``.
    Returns:
        An IP address string.
    Raises:
        RendezvousError: no interface matches (the message lists those seen),
            the master is unreachable, or the choice is loopback while
            ``master_addr`` is not (a multi-host job must never fall back to
            loopback silently).

    Example::

        host = select_bind_address("10.0.0.1", os.environ.get("RINGLET_IFNAME"))
    """
    remote = master_addr is not None and not is_loopback(master_addr)
    if ifname is not None and ifname.strip():
        ifaces = list_interfaces()
        matches = _match_interfaces(ifname, ifaces)
        if not matches:
            seen = ", ".join(f"{n}={a}" for n, a in ifaces) or "none with an IPv4 address"
            raise RendezvousError(f"RINGLET_IFNAME={ifname!r} matches no interface with an "
                                  f"IPv4 address; interfaces seen: {seen}")
        matches.sort(key=lambda na: is_loopback(na[1]))  # stable: non-loopback first
        name, addr = matches[0]
        if remote and is_loopback(addr):
            raise RendezvousError(f"RINGLET_IFNAME={ifname!r} selects loopback interface "
                                  f"{name} ({addr}) but the master {master_addr} is another "
                                  f"host; choose a routable interface")
        return addr
    if not remote:
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(master_addr, 9, 0, socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise RendezvousError(f"master address {master_addr!r} does not resolve: {exc}") from None
    last: Optional[BaseException] = None
    for family, stype, proto, _, sockaddr in infos:
        try:
            # A UDP connect sends nothing; it only asks the kernel for a route.
            with socket.socket(family, stype, proto) as s:
                s.connect(sockaddr)
                addr = s.getsockname()[0]
        except OSError as exc:
            last = exc
            continue
        if is_loopback(addr):
            raise RendezvousError(
                f"the route to master {master_addr!r} leaves through loopback ({addr}): "
                f"{master_addr!r} resolves to this host's loopback here but is used as a "
                f"multi-host address.  Set RINGLET_MASTER_ADDR to a routable IP or set "
                f"RINGLET_IFNAME")
        return addr
    raise RendezvousError(f"no route to master {master_addr!r}: {last}")


# ---- the job secret ------------------------------------------------------------------------
def load_secret(environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The job secret from RINGLET_SECRET or RINGLET_SECRET_FILE, or None if neither is set.

    RINGLET_SECRET is used as its UTF-8 bytes; RINGLET_SECRET_FILE names a file
    whose content (surrounding whitespace stripped) is the secret.  Either must
    give at least 16 bytes.  RINGLET_SECRET wins when both are set.  The secret
    never appears in any message.

    Raises:
        ValueError: the secret is shorter than 16 bytes, RINGLET_SECRET is set
            but empty (or only whitespace), or the file cannot be read.
    Warns:
        UserWarning: the secret file is readable by group or others.

    Example::

        secret = load_secret() or secrets.token_bytes(32)
    """
    env = os.environ if environ is None else environ
    raw = env.get("RINGLET_SECRET")
    if raw is not None and not raw.strip():
        # Set but empty (`RINGLET_SECRET= python train.py`, an unset shell
        # variable expanded): refuse rather than silently run with no secret.
        raise ValueError("RINGLET_SECRET is set but empty; give it a secret of at least "
                         f"{MIN_SECRET_BYTES} bytes, or unset it (a job then runs without a "
                         "secret only on loopback)")
    if raw:
        secret = raw.encode("utf-8")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"RINGLET_SECRET is {len(secret)} bytes; it must be at least "
                             f"{MIN_SECRET_BYTES} (e.g. `python -c 'import secrets; "
                             f"print(secrets.token_hex(32))'`)")
        return secret
    path = env.get("RINGLET_SECRET_FILE")
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            secret = f.read(1 << 20).strip()
    except OSError as exc:
        raise ValueError(f"RINGLET_SECRET_FILE={path!r} cannot be read: "
                         f"{exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings.warn(f"RINGLET_SECRET_FILE={path!r} is accessible by group or others (mode "
                      f"{stat.S_IMODE(mode):o}); restrict it with `chmod 600 {path}`",
                      UserWarning, stacklevel=2)
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"RINGLET_SECRET_FILE={path!r} holds {len(secret)} bytes; the secret "
                         f"must be at least {MIN_SECRET_BYTES}")
    return secret


# ---- MPI bootstrap -------------------------------------------------------------------------
_MPI_MISSING = ("launched under MPI without RINGLET_MASTER_ADDR; install mpi4py (pip install "
                "mpi4py) or set RINGLET_MASTER_ADDR/RINGLET_MASTER_PORT")
_ID_BYTES = 64  # a same-host identity (ringlet._topology.host_id) is at most 64 characters
_BCAST_BYTES = 1024


def _mpi_wait(req, deadline: float, what: str, rank: int, *,
              step: str = "MPI bootstrap", reached: str = "ringlet.init()") -> None:
    # MPI's blocking collectives have no timeout; a non-blocking one polled
    # against our deadline turns a missing rank into an error, not a hang.
    pause = 0.0002
    while not req.Test():
        if time.monotonic() > deadline:
            raise RendezvousError(f"rank {rank}: {step} timed out during {what}: some "
                                  f"rank never reached {reached}", rank=rank)
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _routable_address() -> str:
    """A non-loopback IPv4 address of this host, for a store other hosts must reach."""
    ifaces = [(n, a) for n, a in list_interfaces() if not is_loopback(a)]
    if not ifaces:
        raise RendezvousError("this MPI job spans several hosts but rank 0's host has no "
                              "non-loopback IPv4 address; set RINGLET_IFNAME or "
                              "RINGLET_MASTER_ADDR")
    return ifaces[0][1]


def mpi_bootstrap(timeout: float) -> Tuple[int, int, str, int, bytes, Optional["StoreServer"]]:
    """Start the rendezvous store on rank 0 and share its address over MPI.

    Rank 0 picks an address (RINGLET_IFNAME if set; loopback when every rank
    runs on its host; else a non-loopback address), serves a ``StoreServer``
    on an OS-chosen port, takes the secret from ``load_secret()`` or makes a
    random 32-byte one, and broadcasts ``(address, port, secret)``: MPI is the
    trusted channel, so the secret never touches the network unauthenticated.
    "Its host" is the same-host identity (``_topology.host_id``: boot id and
    namespaces), not MPI's processor name, which many clusters and containers
    report alike on every node.  A rank handed a loopback store address by a
    rank 0 on another host fails at once instead of after ``timeout``.

    Args:
        timeout: seconds to wait for every rank to take part.
    Returns:
        ``(rank, size, master_addr, master_port, secret, server)``; ``server``
        is the ``StoreServer`` on rank 0 (the caller closes it) and None elsewhere.
    Raises:
        ImportError: mpi4py is not installed.
        RendezvousError: a rank did not take part in time, rank 0 could not
            start the store (every rank gets the reason), or MPI's rank and size
            differ from the launcher's variables (mpi4py loaded another MPI).

    Example::

        rank, size, addr, port, secret, server = mpi_bootstrap(60.0)
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        note = ignored_note(detect())
        raise ImportError(_MPI_MISSING + (f" ({note})" if note else "")) from exc
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    launched = detect()
    if launched is not None and (launched.rank, launched.world_size) != (rank, size):
        # mpi4py loaded another MPI than the launcher's (Open MPI's libmpi under
        # MPICH's mpiexec): every process is a world of one and would serve a
        # store of its own, so the job could only time out.
        lib = MPI.Get_library_version().strip().splitlines()[0][:80]
        raise RendezvousError(
            f"rank {launched.rank}: the launcher ({launched.source}) started this process as "
            f"rank {launched.rank} of {launched.world_size} but MPI ({lib}) sees rank {rank} "
            f"of {size}: mpi4py loaded a different MPI library than the launcher's. Point "
            f"mpi4py at the launcher's library (MPI4PY_LIBMPI=/path/to/libmpi.so), launch "
            f"with the mpiexec of mpi4py's MPI, or set RINGLET_MASTER_ADDR and "
            f"RINGLET_MASTER_PORT", rank=launched.rank)
    deadline = time.monotonic() + timeout

    # Which hosts does the job span?  Fixed-size buffers, non-blocking.
    from ._topology import host_id

    mine = bytearray(host_id().encode()[:_ID_BYTES].ljust(_ID_BYTES, b"\0"))
    ids = bytearray(_ID_BYTES * size)
    _mpi_wait(comm.Iallgather([mine, MPI.BYTE], [ids, MPI.BYTE]), deadline,
              "the host identity exchange", rank)
    hosts = {bytes(ids[i:i + _ID_BYTES]) for i in range(0, len(ids), _ID_BYTES)}
    # The machine itself, whatever RINGLET_HOST_ID says: for the loopback check below.
    machine = host_id({})

    server = None
    buf = bytearray(_BCAST_BYTES)
    if rank == 0:
        try:
            ifname = os.environ.get("RINGLET_IFNAME")
            if ifname and ifname.strip():
                addr = select_bind_address(None, ifname)
                if len(hosts) > 1 and is_loopback(addr):
                    raise RendezvousError(f"RINGLET_IFNAME={ifname!r} selects loopback but the "
                                          f"job spans {len(hosts)} hosts")
            elif len(hosts) > 1:
                addr = _routable_address()
            else:
                addr = "127.0.0.1"
            secret = load_secret() or secrets.token_bytes(32)
            server = _start_server(addr, secret)
            body = b"\x00" + _pack_bootstrap(addr, server.port, secret, machine)
        except Exception as exc:  # noqa: BLE001 - every rank must hear why
            body = b"\x01" + f"{type(exc).__name__}: {exc}".encode()[:_BCAST_BYTES - 1]
            failure: Optional[BaseException] = exc
        else:
            failure = None
        buf[:len(body)] = body
    try:
        _mpi_wait(comm.Ibcast([buf, MPI.BYTE], root=0), deadline, "the store-address broadcast",
                  rank)
    except BaseException:
        if server is not None:
            server.close()
        raise
    if rank == 0 and failure is not None:
        raise failure
    if buf[0] != 0:
        msg = bytes(buf[1:]).rstrip(b"\0").decode("utf-8", "replace")
        raise RendezvousError(f"rank {rank}: rank 0 could not start the rendezvous store: {msg}",
                              rank=rank, peer=0)
    addr, port, secret, root_machine = _unpack_bootstrap(bytes(buf[1:]))
    # A loopback store is out of reach of ranks on other machines.  Every rank
    # learns which ranks those are (one byte each), so all fail now together
    # rather than wait for them until the rendezvous deadline.
    far = bytearray([is_loopback(addr) and root_machine != machine])
    fars = bytearray(size)
    try:
        _mpi_wait(comm.Iallgather([far, MPI.BYTE], [fars, MPI.BYTE]), deadline,
                  "the store reachability check", rank)
    except BaseException:
        if server is not None:
            server.close()
        raise
    cut_off = [r for r in range(size) if fars[r]]
    if cut_off:
        if server is not None:
            server.close()
        where = (f"this rank runs on another host (host id {machine}) than rank 0 "
                 f"(host id {root_machine})" if far[0] else
                 f"ranks {cut_off} run on other hosts than rank 0")
        raise RendezvousError(
            f"rank {rank}: rank 0 serves the rendezvous store on loopback ({addr}:{port}) but "
            f"{where}, so they cannot reach it: rank 0 took the job for a single host "
            f"(RINGLET_HOST_ID set alike on every host?). Set RINGLET_IFNAME to an interface "
            f"between the hosts, or RINGLET_MASTER_ADDR/RINGLET_MASTER_PORT",
            rank=rank, peer=0)
    return rank, size, addr, port, secret, server


def _start_server(addr: str, secret: bytes) -> "StoreServer":
    from .store import StoreServer

    return StoreServer(addr, 0, secret=secret)


def _pack_bootstrap(addr: str, port: int, secret: bytes, machine: str) -> bytes:
    a, m = addr.encode(), machine.encode()[:_ID_BYTES]
    if len(a) > 255 or len(secret) > 512:
        raise ValueError("bootstrap address or secret too long")
    return struct.pack("!BHHB", len(a), port, len(secret), len(m)) + a + secret + m


def _unpack_bootstrap(data: bytes) -> Tuple[str, int, bytes, str]:
    alen, port, slen, mlen = struct.unpack_from("!BHHB", data, 0)
    a = data[6:6 + alen].decode()
    secret = data[6 + alen:6 + alen + slen]
    m = data[6 + alen + slen:6 + alen + slen + mlen].decode(errors="replace")
    return a, port, secret, m


def _environ_summary(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The launcher-related variables that are set (secrets redacted), for ``ringlet info``."""
    env = os.environ if env is None else env
    prefixes = ("RINGLET_", "OMPI_COMM_WORLD_", "PMI_", "SLURM_PROCID", "SLURM_NTASKS",
                "SLURM_LOCALID", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")
    plain = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "MPI_LOCALRANKID", "MPI_LOCALNRANKS") + TORCHRUN_MARKERS
    out = {}
    for k in sorted(env):
        if k.startswith(prefixes) or k in plain:
            out[k] = "<redacted>" if k == "RINGLET_SECRET" else env[k]
    return out

