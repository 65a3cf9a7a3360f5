"""Which transport a communicator uses, and the hand-over of its shared-memory segment.

Policy (``RINGLET_TRANSPORT``): ``auto`` (default) runs a comm's collectives
over shared memory when all of its ranks report the same ``host_id()``,
``tcp`` never does, ``shm`` requires it and fails at group creation otherwise.
The ranks exchange host ids through the job's store once per world.

Hand-over (docs/security.md, "Shared-memory segments"): comm rank 0 creates
the segment with ``memfd_create`` (no name in /dev/shm; the kernel frees it
when the last mapping goes, whatever killed the ranks), maps it, and listens
on an abstract Unix socket with a random name that only the store (which
needs the secret) tells.  Each other rank connects, proves it holds the job
secret with the handshake of ``_auth`` (purpose ``shm/<name>``, claim: its
rank) and only then receives the descriptor over ``SCM_RIGHTS``.  Every rank
closes its descriptor once mapped; the C core then waits until all ranks
attached.  The group's point-to-point comm gets a second segment (rings per
pair of ranks) in the same hand-over, when its size allows one.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import threading
import time
from typing import Any, Mapping, Optional, Sequence

from . import _auth, _core
from ._envvars import choice
from .errors import AuthenticationError, RendezvousError

__all__ = ["TRANSPORT_ENV", "transport_mode", "setup"]

TRANSPORT_ENV = "RINGLET_TRANSPORT"
_MODES = ("auto", "shm", "tcp")
# Handshakes one rank 0 runs at once; a flood of unauthenticated connections
# waits its turn (each is cut off at _HANDSHAKE_S) instead of exhausting threads.
_MAX_HANDSHAKES = 32
_HANDSHAKE_S = 2.0

rejected = 0  # connections refused by this process's hand-over servers (tests read it)
_rejected_lock = threading.Lock()


def transport_mode(env: Optional[dict] = None) -> str:
    """``RINGLET_TRANSPORT`` as one of auto, shm, tcp (default auto).

    Raises:
        ValueError: any other value.
    """
    return choice(TRANSPORT_ENV, _MODES, env)


def setup(world: Any, comm: Any, ranks: Sequence[int], timeout: float,
          p2p: Any = None) -> str:
    """Give ``comm`` (this rank's member comm of the group ``ranks``) a segment
    when the policy says so, and ``p2p`` (the group's point-to-point comm) one
    of its own; every member calls this in the same order.

    Returns:
        "shm" or "tcp": what the comm's collectives run over.
    Raises:
        ValueError: ``RINGLET_TRANSPORT`` is invalid.
        RendezvousError: ``RINGLET_TRANSPORT=shm`` but the ranks span hosts, or
            the hand-over did not finish within ``timeout``.
    """
    from .trace import log

    mode = transport_mode()
    P = len(ranks)
    if mode == "tcp" or P == 1:
        return "tcp"
    deadline = time.monotonic() + timeout
    ids = world.host_ids  # every world rank's, from init's endpoint exchange
    hosts = sorted({ids[r] for r in ranks})
    if len(hosts) > 1:
        if mode == "shm":
            by = {h: [r for r in ranks if ids[r] == h] for h in hosts}
            raise RendezvousError(
                f"rank {world.rank}: {TRANSPORT_ENV}=shm but group {list(ranks)} spans "
                f"{len(hosts)} hosts (world ranks by host id: "
                + "; ".join(f"{h}: {rs}" for h, rs in by.items())
                + f"); unset {TRANSPORT_ENV} (auto) to use TCP between hosts", rank=world.rank)
        log(world.rank, 1, f"communicator {comm.comm_id}: transport tcp ({len(hosts)} hosts)")
        return "tcp"
    size = _core.shm_segment_bytes(P)
    if size == 0:
        if mode == "shm":
            raise RendezvousError(f"rank {world.rank}: {TRANSPORT_ENV}=shm but {P} ranks exceed "
                                  f"the shared-memory limit", rank=world.rank)
        return "tcp"
    key = world.job_key("shm")
    rec_key = f"{world.prefix}shm/{comm.comm_id}"
    p2p_size = _core.shm_p2p_segment_bytes(P) if p2p is not None else 0
    comms = [(comm, size, comm.attach_shm)]
    if p2p is not None:
        comms.append((p2p, p2p_size, lambda fd, n, create: p2p.attach_shm(fd, n, create, True)))
    if comm.rank == 0:
        del comms[1 if not p2p_size else 2:]  # rank 0's knobs decide; the others follow
        _create(world, comm, comms, key, rec_key, P, deadline)
    else:
        _join(world, comms, key, rec_key, deadline)
    for c, _size, _attach in comms:
        c.shm_ready(max(1, int((deadline - time.monotonic()) * 1000)))
    log(world.rank, 1, f"communicator {comm.comm_id}: transport shm ({P} ranks, segment "
                       f"{size} bytes" + (f"; point to point: {comms[1][1]} bytes)"
                                          if len(comms) > 1 else ")")
        + "; " + single_copy_words(comm, ranks))
    return "shm"


YAMA_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


def yama_ptrace_scope(path: str = YAMA_PTRACE_SCOPE) -> Optional[int]:
    """The kernel's Yama ptrace_scope, or None where Yama is absent.

    Raises:
        OSError, ValueError: the setting exists but cannot be read as a number.
    """
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{path} holds {text.strip()[:40]!r}, not a number") from None


PTRACER_ENV = "RINGLET_PTRACER"
PTRACER_CHOICES = ("none", "parent")


def ptracer_mode(environ: Optional[Mapping[str, str]] = None) -> str:
    """``RINGLET_PTRACER`` checked: "none" (unset: ranks keep the kernel's ptrace rules) or
    "parent" (under Yama's ptrace_scope 1, ranks with one common parent declare it)."""
    return choice(PTRACER_ENV, PTRACER_CHOICES, environ)


def ptracer_to_declare(mode: str, scope: Optional[int], ppids: Sequence[int]) -> Optional[int]:
    """The process a rank declares as its ptracer, or None for none.

    Only with ``RINGLET_PTRACER=parent`` and Yama's ptrace_scope 1, which lets a
    process read another's memory when it descends from the process that other
    declared: ``ppids`` are the parents of this host's ranks (this one's
    included), and when they are one process other than init (the launcher:
    ``ringlet run``, mpirun's daemon, torchrun's agent, slurmstepd), every rank
    declaring it lets its siblings read it (single copy).
    """
    if mode != "parent" or scope != 1:
        return None
    parents = set(ppids)
    if len(parents) != 1:
        return None
    (parent,) = parents
    return parent if parent > 1 else None


def single_copy_outlook(scope: Optional[int], ptracer: str = "none") -> str:
    """What a Yama ptrace_scope (and ``RINGLET_PTRACER``) means for single copy between
    ranks of one host."""
    if scope == 1 and ptracer == "parent":
        return ("Yama ptrace_scope 1 and RINGLET_PTRACER=parent: ranks whose parent is one "
                "launcher declare it their ptracer and copy large shared-memory messages "
                "once; ranks with different parents stage them through the segment "
                "(docs/security.md)")
    if scope is None or scope == 0:
        return (("no Yama module" if scope is None else "Yama ptrace_scope 0")
                + ": ranks of one user may read each other's memory, so large shared-memory "
                "messages are copied once (each group probes it at set-up)")
    if scope == 1:
        return ("Yama ptrace_scope 1: ranks started side by side may not read each other's "
                "memory, so large shared-memory messages are staged through the segment "
                "(RINGLET_PTRACER=parent lets ranks of one launcher read each other; root: "
                "sysctl kernel.yama.ptrace_scope=0; docs/launching.md)")
    if scope == 2:
        return ("Yama ptrace_scope 2: only processes with CAP_SYS_PTRACE may read another's "
                "memory, so large shared-memory messages are staged through the segment "
                "unless the ranks hold it")
    return (f"Yama ptrace_scope {scope}: no process may read another's memory, so large "
            f"shared-memory messages are staged through the segment")


def single_copy_words(comm: Any, ranks: Sequence[int]) -> str:
    """What the comm's set-up probe decided about single copy, for the log."""
    n, who, peer, err = comm.single_copy
    if n:
        return f"single copy from {n}-byte blocks"
    if who < 0:
        return "single copy off (RINGLET_SHM_CMA_BYTES=0)"
    why = os.strerror(err) if err else "it read another word than the peer wrote"
    return (f"single copy off: world rank {ranks[who]} may not read the memory of world rank "
            f"{ranks[peer]} (process_vm_readv: {why}; the kernel's ptrace rules, e.g. Yama's "
            f"ptrace_scope: RINGLET_PTRACER=parent, docs/launching.md), so large messages are "
            f"staged through the segment")


def _create(world: Any, comm: Any, comms: list, key: bytes, rec_key: str, P: int,
            deadline: float) -> None:
    fds: list = []
    listener = None
    try:
        for c, size, attach in comms:
            # Named after the job and comm: /proc/<pid>/maps of a rank shows whose it is.
            fd = os.memfd_create(f"ringlet-{world.job_id.hex()[:8]}-comm{c.comm_id}",
                                 os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            fds.append(fd)
            os.ftruncate(fd, size)
            # Fixed size: no holder of the descriptor can shrink it under the others.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            attach(fd, size, True)
        name = "ringlet-shm-" + secrets.token_hex(16)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.bind("\0" + name)
        listener.listen(64)
        world.store.set(rec_key, json.dumps({"name": name,
                                             "sizes": [size for _c, size, _a in comms]})
                        .encode())
        _serve(world, listener, fds, key, name, P, deadline)
    finally:
        if listener is not None:
            listener.close()
        for fd in fds:
            os.close(fd)


def _serve(world: Any, listener: socket.socket, fds: list, key: bytes, name: str, P: int,
           deadline: float) -> None:
    """Hand fds to comm ranks 1..P-1, each once, after it proves the secret."""
    served: set = set()
    lock = threading.Lock()
    done = threading.Event()
    slots = threading.BoundedSemaphore(_MAX_HANDSHAKES)

    def claim(raw: bytes) -> None:  # raising refuses the claim
        r = int(raw.decode())
        with lock:
            if not 1 <= r < P or r in served:
                raise ValueError(f"rank {r} is not a peer still to attach")

    def hand_over(conn: socket.socket) -> None:
        global rejected
        try:
            with conn:
                end = min(deadline, time.monotonic() + _HANDSHAKE_S)
                r = int(_auth.server_handshake(conn, key, "shm/" + name, deadline=end,
                                               check_claim=claim).decode())
                with lock:
                    if r in served:
                        raise AuthenticationError(f"rank {r} attached twice")
                conn.settimeout(max(0.01, end - time.monotonic()))
                socket.send_fds(conn, [b"\1"], fds)
                # Counted once sent: `done` lets _create close the descriptors, and a
                # rank whose hand-over failed may try again.
                with lock:
                    served.add(r)
                    if len(served) == P - 1:
                        done.set()
        except (OSError, AuthenticationError, ValueError):
            with _rejected_lock:
                rejected += 1
        finally:
            slots.release()

    listener.settimeout(0.1)
    while not done.is_set():
        if time.monotonic() >= deadline:
            missing = sorted(set(range(1, P)) - served)
            raise RendezvousError(f"rank {world.rank}: comm ranks {missing} did not fetch the "
                                  f"shared-memory segment in time", rank=world.rank)
        if not slots.acquire(timeout=0.1):
            continue
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            slots.release()
            continue
        conn.setblocking(True)
        threading.Thread(target=hand_over, args=(conn,), name="ringlet-shm-handover",
                         daemon=True).start()


def _join(world: Any, comms: list, key: bytes, rec_key: str, deadline: float) -> None:
    comm = comms[0][0]
    rec = json.loads(world.store.get(rec_key, timeout=max(0.0, deadline - time.monotonic()))
                     .decode())
    name, sizes = str(rec["name"]), [int(x) for x in rec["sizes"]]
    for attempt in range(3):
        # A hand-over that rank 0 dropped (its 2 s handshake window passed on a
        # loaded host) is tried again, within the deadline.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            s.connect("\0" + name)
            _auth.client_handshake(s, key, "shm/" + name, deadline=deadline,
                                   claim=str(comm.rank).encode())
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                msg, fds, _flags, _addr = socket.recv_fds(s, 1, 2)
            except OSError:
                msg, fds = b"", []
        if msg or attempt == 2 or time.monotonic() >= deadline:
            break
    # Rank 0 sized the segments by its knobs: a point-to-point segment it made
    # is used here too, one it did not make is not.
    if msg != b"\1" or len(fds) != len(sizes) or not 1 <= len(sizes) <= len(comms):
        for f in fds:
            os.close(f)
        raise RendezvousError(f"rank {world.rank}: no shared-memory segment came with the "
                              f"hand-over of communicator {comm.comm_id}", rank=world.rank)
    comms[:] = [(c, size, attach) for (c, _s, attach), size in zip(comms, sizes)]
    try:
        for (c, size, attach), fd in zip(comms, fds):
            attach(fd, size, False)
    finally:
        for fd in fds:
            os.close(fd)
