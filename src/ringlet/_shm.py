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

import array
import errno
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
# Handshakes (threads) one rank 0 runs at once, each cut off at _HANDSHAKE_S;
# beyond, a new connection evicts the oldest one not yet authenticated (_serve).
_MAX_HANDSHAKES = 32
_HANDSHAKE_S = 2.0
# accept() errors that mean "no descriptor to be had" (_serve evicts then).
_NO_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

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
    """Hand fds to comm ranks 1..P-1, each once, after it proves the secret.

    Each connection runs its handshake on a thread of its own, at most
    ``_MAX_HANDSHAKES`` at once.  A connection that arrives while every slot is
    taken evicts the oldest one whose handshake has not verified yet (its
    socket is shut down, which ends its thread at once), as the store does:
    idle connections from any local process cannot hold genuine ranks back.
    """
    served: set = set()
    cond = threading.Condition()  # guards served, pending, running
    done = threading.Event()
    # Unauthenticated connections, oldest first (dicts keep insertion order).
    pending: dict = {}
    running = [0]  # handshake threads alive

    def claim(raw: bytes) -> None:  # raising refuses the claim
        r = int(raw.decode())
        with cond:
            if not 1 <= r < P or r in served:
                raise ValueError(f"rank {r} is not a peer still to attach")

    def hand_over(conn: socket.socket) -> None:
        global rejected
        try:
            end = min(deadline, time.monotonic() + _HANDSHAKE_S)
            r = int(_auth.server_handshake(conn, key, "shm/" + name, deadline=end,
                                           check_claim=claim).decode())
            with cond:
                pending.pop(conn, None)  # proven: never evicted from here on
                if r in served:
                    raise AuthenticationError(f"rank {r} attached twice")
            conn.settimeout(max(0.01, end - time.monotonic()))
            socket.send_fds(conn, [b"\1"], fds)
            # Counted once sent: `done` lets _create close the descriptors, and a
            # rank whose hand-over failed may try again.
            with cond:
                served.add(r)
                if len(served) == P - 1:
                    done.set()
        except (OSError, AuthenticationError, ValueError):
            with _rejected_lock:
                rejected += 1
        finally:
            # Out of `pending` before the close, so an eviction never shuts down
            # a descriptor number that another socket may reuse.
            with cond:
                pending.pop(conn, None)
                running[0] -= 1
                cond.notify_all()
            conn.close()

    def evict_oldest() -> bool:  # with cond held
        if not pending:
            return False
        victim = next(iter(pending))
        del pending[victim]
        try:
            victim.shutdown(socket.SHUT_RDWR)  # its handshake fails at once
        except OSError:
            pass
        return True

    listener.settimeout(0.1)
    try:
        while not done.is_set():
            if time.monotonic() >= deadline:
                missing = sorted(set(range(1, P)) - served)
                raise RendezvousError(f"rank {world.rank}: comm ranks {missing} did not fetch "
                                      f"the shared-memory segment in time", rank=world.rank)
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if exc.errno not in _NO_FDS:
                    raise
                # Out of descriptors: free one by evicting the oldest unproven
                # connection (its thread closes it), as the rank listener and the
                # store do; with none to evict, rest until a handshake ends (0.1 s).
                with cond:
                    evict_oldest()
                    cond.wait(0.1)
                continue
            conn.setblocking(True)
            with cond:
                # Every slot taken: make room by evicting, then wait for the
                # evicted thread to end (a moment), within the deadline.
                while running[0] >= _MAX_HANDSHAKES and not done.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    evict_oldest()
                    cond.wait(min(left, 0.1))
                admit = running[0] < _MAX_HANDSHAKES and not done.is_set()
                if admit:
                    running[0] += 1
                    pending[conn] = None
            if not admit:
                conn.close()
                continue
            try:
                threading.Thread(target=hand_over, args=(conn,), name="ringlet-shm-handover",
                                 daemon=True).start()
            except RuntimeError:  # no thread to be had: this connection goes
                with cond:
                    pending.pop(conn, None)
                    running[0] -= 1
                conn.close()
    finally:
        # Every rank has its descriptors (or the deadline passed): end the
        # handshakes still pending instead of leaving them to their deadline,
        # and let the threads finish before _create closes the descriptors
        # that one of them might still be sending.
        with cond:
            while evict_oldest():
                pass
            cond.wait_for(lambda: running[0] == 0, timeout=_HANDSHAKE_S)


def _join(world: Any, comms: list, key: bytes, rec_key: str, deadline: float) -> None:
    comm = comms[0][0]
    rec = json.loads(world.store.get(rec_key, timeout=max(0.0, deadline - time.monotonic()))
                     .decode())
    name, sizes = str(rec["name"]), [int(x) for x in rec["sizes"]]
    msg, fds = _fetch(world, name, key, comm.rank, deadline)
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


def _fetch(world: Any, name: str, key: bytes, rank: int, deadline: float) -> tuple:
    """The hand-over's message and descriptors from rank 0's socket ``name``.

    A hand-over that rank 0 dropped (a crowded server evicts handshakes that
    have not verified yet, and cuts each one after ``_HANDSHAKE_S``) or that
    went unanswered is tried again on a fresh connection, pausing 1, 2, 4, ...
    up to 50 ms, until ``deadline``.  A verdict on the key or the claim, and a
    socket nobody listens on any more, fail at once.
    """
    pause, tries, why = 0.001, 0, None
    while True:
        tries += 1
        end = min(deadline, time.monotonic() + 2 * _HANDSHAKE_S)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
                s.settimeout(max(0.01, end - time.monotonic()))
                s.connect("\0" + name)
                _auth.client_handshake(s, key, "shm/" + name, deadline=end,
                                       claim=str(rank).encode())
                s.settimeout(max(0.01, end - time.monotonic()))
                msg, fds = _recv_fds(s, 1, 2)
            if msg:
                return msg, fds
            for f in fds:
                os.close(f)
            why = "rank 0 closed the connection before sending the segment"
        except ConnectionRefusedError as exc:
            raise RendezvousError(f"rank {world.rank}: rank 0's shared-memory hand-over socket "
                                  f"refused the connection ({exc}): rank 0 left or failed",
                                  rank=world.rank) from exc
        except _auth.HandshakeAborted as exc:
            why = str(exc)  # dropped before a verdict: evicted, or cut at its deadline
        except AuthenticationError as exc:
            if time.monotonic() < end - 0.05:
                raise  # a verdict on the key or the claim, not a timeout
            why = str(exc)
        except OSError as exc:  # connect or receive timed out (a full backlog), a reset
            why = str(exc) or type(exc).__name__
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"rank {world.rank}: no shared-memory segment from rank 0 "
                                  f"after {tries} attempts within the deadline (last: {why})",
                                  rank=world.rank)
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)


def _recv_fds(sock: socket.socket, bufsize: int, maxfds: int) -> tuple:
    """``socket.recv_fds``, with the descriptors close-on-exec from the start
    (``MSG_CMSG_CLOEXEC``): no program that another thread ``exec``s before
    they are closed inherits the segment.  (Python's ``recv_fds`` drops its
    ``flags`` argument, so it cannot ask for that.)"""
    fds = array.array("i")
    msg, ancdata, _flags, _addr = sock.recvmsg(bufsize, socket.CMSG_LEN(maxfds * fds.itemsize),
                                               socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds)
