"""Initialisation, the default group, sub-groups and job-wide failure propagation.

Rendezvous (see docs/launching.md):
  1. Work out rank, world size and the store's address: explicit arguments,
     then RINGLET_*, torchrun, Open MPI, MPICH/Hydra and Slurm variables; under
     MPI without an address, bootstrap through mpi4py.
  2. Rank 0 serves the key-value store (unless the launcher already does);
     every rank connects to it with the HMAC handshake.
  3. Every rank takes its generation: the count of its own init() calls
     against this store (one atomic ``add``), and prefixes every key of this
     world with it.  A store that outlives a world (``ringlet run``'s, or the
     one rank 0 keeps across shutdown()/init()) still holds the old world's
     endpoints and abort record; the new world never reads them.
  4. Every rank opens its listener on an ephemeral port of the chosen
     interface and publishes "host:port" with its world size; rank 0 checks
     the sizes, assembles the table once and every rank reads it with one
     request.  No data connection is opened yet.
  5. A watcher thread per rank waits on the generation's "abort" key: when any
     rank fails an operation it publishes why, and every rank cancels its
     groups, so no rank waits for a timeout on a peer that already knows the
     job failed.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import json
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence

from . import _core, _shm
from . import trace as _trace
from ._timeout import seconds
from .errors import (AuthenticationError, CollectiveTimeout, DesyncError, PeerClosedError,
                     ProtocolError, RendezvousError, RingletError)
from .group import ProcessGroup

_log = logging.getLogger("ringlet")

_INSECURE_KEY = b"ringlet/no-secret/loopback-only"
# Job-wide keys (no generation): each rank's count of init() calls against
# this store, and the job's latest first failure (read by `ringlet run`).
GEN_KEY = "ringlet/gen/{}"
FAILURE_KEY = "ringlet/failure"
_STATUS_OF = [  # most specific first
    (CollectiveTimeout, "TIMEOUT"), (PeerClosedError, "PEER_CLOSED"), (DesyncError, "DESYNC"),
    (AuthenticationError, "AUTH"), (ProtocolError, "PROTOCOL"),
]


def _status_of(exc: BaseException) -> int:
    for cls, name in _STATUS_OF:
        if isinstance(exc, cls):
            return _core.STATUS[name]
    return _core.STATUS["ABORTED"]


# Bound on a failed rank's last store requests (its failure record, its check-out).
_AFTER_FAILURE_S = 5.0
_CPUSET_CHARS = 256  # longest CPU list a rank sends at init (cpu_ranges' text)


class World:
    """Everything one rank holds for one initialised job."""

    def __init__(self, rank: int, size: int, *, timeout: float) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.secret = b""
        self.job_id = b"\0" * 16
        self.gen = 0
        self.prefix = "ringlet/0/"  # every key of this world starts with it
        self.host = "127.0.0.1"
        self.ctx: Optional[_core.Context] = None
        self.store = None
        self.server = None
        self.group: Optional[ProcessGroup] = None
        self._groups: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()
        self._watch_stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        self._store_args: Optional[tuple] = None
        self._watch_store = None
        self._fail_store: Any = None  # False once it could not be reached
        self._failed = False
        self._cancelled: Optional[tuple] = None  # _cancel_all's arguments, once called
        self._closed = False
        # Per world rank: its same-host identity; and the algorithm choice and
        # cost model rank 0 handed out, so every rank's groups decide alike.
        self.host_ids: List[str] = []
        self.own_cpus = False  # this world set the own_cpus knob (reset at close)
        self.unbind_cpus: Optional[List[int]] = None  # the CPU set before RINGLET_BIND's
        self.ptracer: Optional[int] = None  # the pid RINGLET_PTRACER declared (undone at close)
        self.algo = "auto"
        self.model: Any = None

    # ---- groups ------------------------------------------------------------
    def make_group(self, comm_id: int, ranks: Sequence[int],
                   timeout: Optional[float] = None,
                   setup_timeout: Optional[float] = None) -> ProcessGroup:
        ranks = list(ranks)
        rank = ranks.index(self.rank) if self.rank in ranks else -1
        coll = p2p = None
        if rank >= 0:
            coll = _core.Comm(self.ctx, comm_id, rank, ranks)
            p2p = _core.Comm(self.ctx, comm_id + 1, rank, ranks)
            try:  # collectives over shared memory when the ranks share a host
                _shm.setup(self, coll, ranks, setup_timeout or
                           (self.timeout if timeout is None else timeout), p2p)
                if self.host_ids and coll.transport == "tcp":
                    # TCP trees send one copy over each host's link (bcast.c)
                    ids = [self.host_ids[r] for r in ranks]
                    first: Dict[str, int] = {}
                    for i, h in enumerate(ids):
                        first.setdefault(h, i)
                    if len(first) > 1:
                        coll.set_hosts([first[h] for h in ids])
            except BaseException:
                coll.close()
                p2p.close()
                raise
        g = ProcessGroup(self, comm_id, ranks, rank, coll, p2p,
                         self.timeout if timeout is None else timeout)
        if self.host_ids:
            from . import _hier

            g._topology, g._hier = _hier.plan(g, [self.host_ids[r] for r in ranks], self.algo,
                                              self.model)
        self._groups.add(g)
        if self._cancelled is not None and rank >= 0:
            g._cancel(*self._cancelled)  # the job failed already: its ops fail at once
        return g

    def sub_groups(self, parent: ProcessGroup, lists: Sequence[Sequence[int]],
                   timeout: Optional[float] = None) -> list:
        """Groups of world ranks ``lists`` (collective over ``parent``: every member
        calls it with the same lists, at most once per parent); returns the groups
        this rank is in, None elsewhere.  One store round trip for all of them.
        ``timeout`` bounds the creation (the calling operation's); the groups keep
        the parent's default timeout."""
        wait = parent.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait  # one bound for the record and every set-up
        # Once per parent group, from inside one of its operations: a key of its
        # own, so a new_group() racing on another thread cannot shift it.
        key = f"{self.prefix}sub/{parent.comm_id}"
        want = [list(map(int, x)) for x in lists]
        if parent.rank == 0:
            last = self.store.add(self.prefix + "next_comm", len(want))
            ids = [2 * (last - len(want) + 1 + i) for i in range(len(want))]
            self.store.set(key, json.dumps({"ids": ids, "lists": want}).encode())
        else:
            rec = json.loads(self.store.get(key, timeout=wait).decode())
            if rec["lists"] != want:
                raise DesyncError(f"rank {parent.rank}: hierarchical sub-groups {want} but "
                                  f"group rank 0 made {rec['lists']}", rank=parent.rank)
            ids = rec["ids"]
        return [self.make_group(i, x, parent.timeout,
                                setup_timeout=max(0.001, deadline - time.monotonic()))
                if self.rank in x else None for i, x in zip(ids, want)]

    def job_key(self, purpose: str) -> bytes:
        return hmac.new(self.secret or _INSECURE_KEY,
                        b"ringlet/derived/" + self.job_id + purpose.encode(),
                        hashlib.sha256).digest()

    # ---- failure propagation ----------------------------------------------
    def _publish_failure(self, group: ProcessGroup, exc: BaseException) -> None:
        """Tell every rank that this rank's operation failed (first failure only)."""
        if self.store is None or self.size == 1:
            return
        if isinstance(exc, PeerClosedError) and self._blame_earlier(exc):
            self._failed = True
            return
        if self._failed:
            return
        self._failed = True
        peer = getattr(exc, "peer", None)
        if isinstance(peer, int) and 0 <= peer < len(group.ranks):
            peer = group.ranks[peer]  # the record speaks world ranks
        else:
            peer = None
        msg = str(exc)
        if not isinstance(exc, (RingletError, KeyboardInterrupt)):
            # Raised by this rank's own code (a signal handler, say): name it.
            msg = f"rank {self.rank}: {type(exc).__name__}: {msg}"
        self._publish_record(_status_of(exc), peer, group.comm_id, msg)

    def _blame_earlier(self, exc: BaseException) -> bool:
        """A peer that closed its connection may have done so because another rank
        failed first and its record stopped that peer: name that first failure in
        ``exc`` (True), rather than blame the peer for it."""
        store = self._store_after_failure()
        if store is None:
            return False
        try:
            raw = store.get(self.prefix + "abort", timeout=0)
            rec = json.loads(raw.decode())
        except (RingletError, OSError, ValueError):
            return False
        if not isinstance(rec, dict) or rec.get("rank") == self.rank:
            return False
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (f"{exc.args[0]}; the job had already failed: rank {rec.get('rank')} "
                        f"failed: {rec.get('message')}",) + exc.args[1:]
        return True

    def _publish_record(self, status: int, peer: Optional[int], comm_id: int,
                        message: str) -> None:
        """Store this generation's abort record unless some rank already did; it is
        also the job's latest first failure, which ``ringlet run`` reads to blame."""
        record = json.dumps({"rank": self.rank, "status": status, "peer": peer,
                             "gen": self.gen, "group": comm_id,
                             "message": message[:600]}).encode()
        try:
            store = self._store_after_failure()
            if store is not None and store.add(self.prefix + "abort_count", 1) == 1:
                store.set(self.prefix + "abort", record)
                store.set(FAILURE_KEY, record)
        except (RingletError, OSError):
            self._fail_store = False  # the store is gone too; peers notice through their sockets

    def _store_after_failure(self):
        """The store connection for a failed rank's record and check-out: one of its
        own with short deadlines, since the store may sit behind the link that failed
        and the main connection waits up to init's timeout (minutes) for a reply."""
        if self._fail_store is None and self._store_args is not None:
            from .store import Store

            host, port, key = self._store_args
            try:
                self._fail_store = Store(host, port, secret=key,
                                         timeout=min(self.timeout, _AFTER_FAILURE_S))
            except (RingletError, OSError):
                self._fail_store = False
        return self._fail_store or None

    def _cancel_all(self, status: int, reason: str, failed: Optional[int] = None) -> None:
        # Remembered first: a group made from here on is cancelled by make_group
        # (one made meanwhile is in the list below, or sees this).
        self._cancelled = (status, reason, failed)
        _trace.on_failure(self, None, reason)  # before the cancel: blocked ops show as started
        for g in list(self._groups):
            if g._failure is None and not g._closed:
                g._cancel(status, reason, failed)

    def _watch(self, store) -> None:
        try:
            while not self._watch_stop.is_set():
                try:
                    # Blocks until some rank publishes a failure, or until close()
                    # closes this connection from the main thread.
                    raw = store.get(self.prefix + "abort", timeout=3600.0)
                except (RendezvousError, OSError) as exc:
                    if self._watch_stop.is_set():
                        return
                    if getattr(exc, "waited", None) is not None:
                        continue  # the get timed out: keep watching
                    self._cancel_all(_core.STATUS["PEER_CLOSED"],
                                     f"lost the rendezvous store ({exc})")
                    return
                rec = json.loads(raw.decode())
                if rec.get("rank") != self.rank:
                    self._failed = True
                    self._cancel_all(int(rec["status"]),
                                     f"rank {rec['rank']} failed: {rec['message']}",
                                     failed=rec.get("rank"))
                return
        finally:
            store.close()

    def start_watcher(self) -> None:
        if self.size == 1 or self._store_args is None:
            return
        from .store import Store

        host, port, secret = self._store_args
        self._watch_store = Store(host, port, secret=secret, timeout=self.timeout)
        self._watcher = threading.Thread(target=self._watch, args=(self._watch_store,),
                                         name=f"ringlet-watch{self.rank}", daemon=True)
        self._watcher.start()

    # ---- teardown ------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        _trace.on_close(self)
        self._closed = True
        for g in list(self._groups):
            g._drain(min(self.timeout, 5.0))
        self._watch_stop.set()
        if self._watch_store is not None:
            self._watch_store.close()  # wakes the watcher's blocked get
        if self.store is not None:
            try:
                # Check out; the rank serving the store keeps it up until every
                # rank has, so no rank loses the store while still shutting down.
                out = self._store_after_failure() if self._failed else self.store
                if out is not None:
                    out.set(f"{self.prefix}exited/{self.rank}", b"1")
                if self.server is not None:
                    # Its sockets close first: a peer still blocked on this rank
                    # (in an operation this rank abandoned) fails now instead of
                    # waiting while this rank waits for its check-out.
                    self._close_comms()
                    self.store.wait([f"{self.prefix}exited/{r}" for r in range(self.size)],
                                    timeout=30.0)
            except (RingletError, OSError):
                pass
        self._close_comms()
        if self.unbind_cpus:
            from ._topology import bind_process

            try:
                bind_process(self.unbind_cpus)
            except OSError:
                pass
            self.unbind_cpus = None
        if self.own_cpus:
            self.own_cpus = False
            _core.set_tuning(own_cpus=0)
        if self.ptracer is not None:
            self.ptracer = None
            try:
                _core.set_ptracer(0)
            except OSError:
                pass
        for st in (self.store, self._fail_store):
            if st:
                try:
                    st.close()
                except Exception:  # noqa: BLE001
                    pass
        if self.server is not None and not _is_kept(self.server):
            self.server.close()

    def _close_comms(self) -> None:
        for g in list(self._groups):
            if not g._closed:
                g._close()
        if self.ctx is not None:
            # Deferred by the context itself while a communicator of it is still
            # in use by another thread (closed under it: Comm.close).
            self.ctx.close()
            self.ctx = None


# ---- the store rank 0 serves ------------------------------------------------------
# When no launcher serves the store, rank 0 keeps its server across shutdown()
# and init(): a rank that re-initialises before rank 0 has shut down then
# reaches the same store (and its generation counters) instead of a dying one.
# Closed at interpreter exit, or when init() needs that address with another secret.
_kept: Dict[tuple, Any] = {}  # (host, port) -> [key, StoreServer]


def _serve_store(host: str, port: int, key: bytes, *, kept_as: Optional[tuple] = None):
    from .store import StoreServer

    slot = (host, port) if kept_as is None else kept_as
    with _lock:
        entry = _kept.get(slot)
        if entry is not None:
            if entry[0] == key and not entry[1]._closed:
                return entry[1]
            entry[1].close()
            del _kept[slot]
        try:
            server = StoreServer(host, port, secret=key)
        except OSError as exc:
            raise RendezvousError(
                f"rank 0 cannot serve the store on {host}:{port}: {exc}; another process "
                f"holds that port (another job, or a program that is not ringlet): choose "
                f"another MASTER_PORT", rank=0) from exc
        _kept[slot] = [key, server]
        return server


_AGENT_KEY = "ringlet/store_addr/{}"


def _via_agent_store(rank: int, addr: str, port: Optional[int], host: str, key: bytes,
                     timeout: float, agent=None):
    """Rendezvous under torchrun, whose agent already serves a TCPStore on MASTER_PORT.

    Rank 0 serves ringlet's store on a port the OS picks and publishes
    "host:port" in torch's store; the other ranks read it there.  torch's store
    carries only that address: ringlet's store still authenticates every rank
    with the job secret, so a forged address cannot join the job.
    ``agent``: a torch store to use (the torch backend passes its group's);
    default: a client of torchrun's store at ``addr:port``.
    Returns (store address, store port, the server rank 0 runs or None).
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip() or "0"
    slot = _AGENT_KEY.format(restart)
    if agent is not None:
        return _publish_store_addr(agent, slot, rank, addr, host, key, timeout,
                                   "the torch group's store", ("torch-store", id(agent)))
    try:
        from datetime import timedelta

        import torch.distributed as tdist
    except ImportError:
        raise RendezvousError(
            f"rank {rank}: TORCHELASTIC_USE_AGENT_STORE is set (torchrun's agent serves "
            f"{addr}:{port}) but torch is not importable here; set RINGLET_MASTER_PORT to a "
            f"free port for ringlet's own store", rank=rank) from None
    try:
        agent = tdist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - torch raises several types here
        raise RendezvousError(f"rank {rank}: cannot reach torchrun's agent store on "
                              f"{addr}:{port}: {exc}", rank=rank) from exc
    return _publish_store_addr(agent, slot, rank, addr, host, key, timeout,
                               f"torchrun's agent store {addr}:{port}",
                               ("torchrun-agent", addr, port, restart))


def _publish_store_addr(agent, slot: str, rank: int, addr: str, host: str, key: bytes,
                        timeout: float, where: str, kept_as: tuple):
    if rank == 0:
        from .environment import is_loopback

        bind = addr if is_loopback(addr) else host
        server = _serve_store(bind, 0, key, kept_as=kept_as)
        agent.set(slot, f"{bind}:{server.port}")
        return bind, server.port, server
    try:
        raw = agent.get(slot).decode()
    except Exception as exc:  # noqa: BLE001 - torch raises several types here
        raise RendezvousError(f"rank {rank}: rank 0 never published ringlet's store address "
                              f"under {slot!r} in {where} within {timeout:g}s: {exc}",
                              rank=rank, peer=0) from exc
    h, _, p = raw.rpartition(":")
    return h.strip("[]"), int(p), None


def _is_kept(server) -> bool:
    return any(e[1] is server for e in list(_kept.values()))


def _close_kept() -> None:
    with _lock:
        entries = list(_kept.values())
        _kept.clear()
    for _key, server in entries:
        server.close()


# ---- the default group ---------------------------------------------------------
_lock = threading.Lock()
_default: Optional[World] = None
class _RankLocal(threading.local):
    # Class-level defaults: reading a missing thread-local attribute would cost
    # an AttributeError on every collective call.
    world: Optional[World] = None
    scoped = False


_tls = _RankLocal()  # thread-mode ranks (ringlet.testing) keep their own
_thread_scoped = False  # set once any thread has scoped its own world


def _scope_thread() -> None:
    """Give the calling thread its own world (thread-mode ranks)."""
    global _thread_scoped
    _thread_scoped = True
    _tls.scoped = True


def _current() -> Optional[World]:
    t = _tls
    if t.scoped:
        return t.world
    return _default


def _require(group: Optional[ProcessGroup]) -> ProcessGroup:
    if group is not None:
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"group must be a ringlet.ProcessGroup, got {type(group).__name__}")
        return group
    # The common case (one world per process) never reads the thread-local.
    w = _tls.world if _thread_scoped and _tls.scoped else _default
    if w is None or w.group is None:
        raise RuntimeError("ringlet is not initialised: call ringlet.init() first")
    return w.group


def is_initialized() -> bool:
    """True when this rank has called ``ringlet.init()`` (and not ``shutdown()``)."""
    return _current() is not None


# RINGLET_* variable -> knob, from the C core's one table (ringlet.h).
_TUNING_ENV = {k["env"]: k["name"] for k in _core.knobs() if k["env"]}


def _spin_yield_policy(local_world_size: int) -> int:
    """1 (yield between polls) when this host's ranks outnumber the CPUs this
    process may use, so a waiting rank hands its core to one that has work;
    else 0: two ranks that yield to each other on one core stay "cache hot"
    and the scheduler never spreads them to an idle core (docs/experiments.md,
    "Two speeds at 2 ranks")."""
    from .environment import usable_cpus

    return 1 if local_world_size > usable_cpus() else 0


def _tuning_from_env() -> Dict[str, int]:
    """The C core's knobs set by ``RINGLET_*`` variables, e.g. {"spin_us": 200}."""
    knobs = {}
    for var, knob in _TUNING_ENV.items():
        if var in os.environ:
            try:
                knobs[knob] = int(os.environ[var])
            except ValueError:
                raise ValueError(f"{var} must be an integer, got {os.environ[var]!r}") from None
    return knobs


def _apply_tuning_env() -> None:
    knobs = _tuning_from_env()
    if knobs:
        _core.set_tuning(**knobs)


def _secret_from(arg) -> Optional[bytes]:
    if arg is None:
        from .environment import load_secret

        return load_secret()
    return arg.encode() if isinstance(arg, str) else bytes(arg)


def init(*, rank: Optional[int] = None, world_size: Optional[int] = None,
         master_addr: Optional[str] = None, master_port: Optional[int] = None,
         timeout: float = 300.0, secret: Optional[bytes] = None,
         bind_addr: Optional[str] = None, _external_store: Optional[bool] = None,
         _torch_store: Any = None, _host_id: Optional[str] = None) -> ProcessGroup:
    """Join the job and return the world ``ProcessGroup`` (also the default group).

    Rank, world size and the rendezvous address come from the arguments, else
    from the launcher's environment (``ringlet run``, torchrun, Open MPI,
    MPICH/Hydra, Slurm).  Under ``mpirun`` with no address set, the job
    bootstraps through mpi4py.  A process with nothing set is a world of one.

    Args:
        rank, world_size: this process's rank and the number of ranks.
        master_addr, master_port: where rank 0 serves (or the launcher serves)
            the rendezvous store.
        timeout: seconds any operation may block before ``CollectiveTimeout``;
            also the rendezvous deadline.
        secret: the job secret (default: RINGLET_SECRET / RINGLET_SECRET_FILE,
            or the one MPI bootstrap distributes).
        bind_addr: listen address (default: RINGLET_IFNAME, else the address
            that routes to the master).
    Returns:
        The world group.
    Raises:
        RendezvousError: ranks could not meet before ``timeout``.
        AuthenticationError: no secret on a non-loopback job, or a wrong one.

    Example::

        group = ringlet.init()
        ringlet.all_reduce(grads)
    """
    global _default
    timeout = seconds(timeout)
    if _current() is not None:
        raise RuntimeError("ringlet is already initialised in this process; call "
                           "ringlet.shutdown() first")
    from . import environment as envmod

    env = None
    source = "args"
    port_from_env = False
    if rank is None or world_size is None:
        env = envmod.detect()
        if env is None:
            if rank is not None or world_size is not None:
                raise ValueError("give both rank and world_size, or neither")
            rank, world_size, source = 0, 1, "single"
            # A forgotten launcher would otherwise train N copies silently.
            if os.environ.get("RINGLET_QUIET") != "1":
                print("ringlet: no launcher detected, running as a world of 1 (start N ranks "
                      "with `ringlet run -n N`, mpirun or torchrun; RINGLET_QUIET=1 hides "
                      "this)", file=sys.stderr, flush=True)
        else:
            if world_size is not None and world_size != env.world_size:
                raise ValueError(
                    f"init(world_size={world_size}) but the launcher ({env.source}) started "
                    f"{env.world_size} ranks: world size {world_size} against "
                    f"{env.world_size}; drop world_size= or launch {world_size} ranks")
            rank = env.rank if rank is None else rank
            world_size = env.world_size if world_size is None else world_size
            master_addr = master_addr or env.master_addr
            port_from_env = master_port is None
            master_port = master_port or env.master_port
            source = env.source
            if env.ignored:  # a stale MASTER_ADDR under mpirun/srun (docs/launching.md)
                _log.debug("ringlet: rank %d: %s", rank, envmod.ignored_note(env))
    if isinstance(rank, bool) or not isinstance(rank, int) or not isinstance(world_size, int) \
            or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank!r} for world_size {world_size!r}")

    _apply_tuning_env()
    host_ranks = env.local_world_size if env is not None else world_size
    from . import _costmodel
    from ._topology import host_id

    algo = _costmodel.algo_from_env()  # checked on every rank; rank 0's value is used
    model = _costmodel.params_from_env()
    my_host = host_id() if _host_id is None else _host_id
    if "RINGLET_SPIN_YIELD" not in os.environ:
        _core.set_tuning(spin_yield=_spin_yield_policy(host_ranks))
    _core.set_tuning(host_ranks=host_ranks)
    if env is not None and world_size > 1:
        note = envmod.own_session_note(env.local_world_size)
        if note:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
    secret_b = _secret_from(secret)
    server = None
    if world_size > 1 and not master_addr and source in ("openmpi", "mpich", "slurm"):
        # mpirun/srun with no address: rank 0 serves the store, MPI tells everyone.
        _r, _s, master_addr, master_port, mpi_secret, server = envmod.mpi_bootstrap(timeout)
        secret_b = secret_b or mpi_secret
        _external_store = True
    if _torch_store is not None:  # the torch backend: rendezvous through torch's store
        master_addr = master_addr or "127.0.0.1"
    elif world_size > 1 and (not master_addr or not master_port):
        own = source in envmod.OWN_RENDEZVOUS  # MASTER_ADDR/MASTER_PORT do not count there
        raise RendezvousError(
            f"rank {rank}: world size {world_size} needs a rendezvous address: set "
            f"RINGLET_MASTER_ADDR and RINGLET_MASTER_PORT"
            f"{'' if own else ' (or MASTER_ADDR/MASTER_PORT)'}, pass master_addr=/master_port="
            f"{'' if own else ', or launch with `ringlet run` or mpirun'}", rank=rank)
    if master_addr and master_addr == "localhost":
        master_addr = "127.0.0.1"

    host = bind_addr or envmod.select_bind_address(master_addr, os.environ.get("RINGLET_IFNAME"))
    # torchrun's agent already serves its own store on MASTER_PORT.
    agent = world_size > 1 and (_torch_store is not None or (
        source == "torchrun" and port_from_env and master_port is not None
        and envmod.torchrun_agent_store()))
    if secret_b is None:
        loop = envmod.is_loopback(host) and (not master_addr or envmod.is_loopback(master_addr))
        if not loop and os.environ.get("RINGLET_ALLOW_INSECURE") != "1":
            raise AuthenticationError(
                "no job secret: ringlet refuses unauthenticated connections off loopback. "
                "Launch with `ringlet run` (it generates one), set RINGLET_SECRET (16+ bytes, the "
                "same on every rank) or RINGLET_SECRET_FILE, or set RINGLET_ALLOW_INSECURE=1 on a "
                "trusted network", rank=rank)
        if world_size > 1:
            warnings.warn("ringlet: no job secret set; connections are not authenticated "
                          + ("(loopback only)" if loop else "(RINGLET_ALLOW_INSECURE=1)"),
                          RuntimeWarning, stacklevel=2)
    key = secret_b or _INSECURE_KEY

    if agent:
        master_addr, master_port, server = _via_agent_store(
            rank, master_addr, master_port, host, key, timeout, agent=_torch_store)
        _external_store = True
    world = World(rank, world_size, timeout=timeout)
    world.secret = key
    world.host = host
    world.host_ids, world.algo, world.model = [my_host], algo, model
    try:
        if world_size > 1:
            from .store import Store

            if _external_store is None:
                _external_store = os.environ.get("RINGLET_EXTERNAL_STORE") == "1"
            if rank == 0 and not _external_store and server is None:
                server = _serve_store(host if not envmod.is_loopback(master_addr) else
                                      master_addr, int(master_port), key)
            world.server = server
            world.store = Store(master_addr, int(master_port), secret=key, timeout=timeout)
            world._store_args = (master_addr, int(master_port), key)
            # One round trip, no agreement protocol: every rank's n-th init()
            # against this store joins generation n.
            world.gen = world.store.add(GEN_KEY.format(rank), 1)
            world.prefix = f"ringlet/{world.gen}/"
            # Per generation, so a straggler of an old world fails the data
            # handshake with the new one instead of joining it.
            world.job_id = hashlib.sha256(world.store.job_id + b"/gen/%d" % world.gen
                                          ).digest()[:16]
            if not _external_store:
                # Rank 0 waits at exit for every rank's check-out; a rank that
                # dies leaves it through its closed connection instead of
                # holding that wait to its end.
                world.store.will(f"{world.prefix}exited/{rank}", b"lost")
        else:
            world.job_id = os.urandom(16)
        world.ctx = _core.Context(rank, world_size, host, key, world.job_id)
        if world_size > 1:
            _exchange_endpoints(world, timeout)
        world.group = world.make_group(0, range(world_size))
        world.start_watcher()
        _trace.on_init(world, source)
    except BaseException:
        world.close()
        raise
    with _lock:
        if _tls.scoped:
            _tls.world = world
        else:
            _default = world
    return world.group


_JOIN_WARN_ENV = "RINGLET_JOIN_WARN_S"


def _join_warn_interval() -> float:
    """Seconds between "still waiting for ranks" warnings at init (RINGLET_JOIN_WARN_S, 10)."""
    raw = os.environ.get(_JOIN_WARN_ENV)
    if raw is None or not raw.strip():
        return 10.0
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{_JOIN_WARN_ENV} must be a number of seconds, got {raw!r}") from None
    if not v > 0:
        raise ValueError(f"{_JOIN_WARN_ENV} must be positive, got {raw!r}")
    return v


def _missing_ranks(world: World) -> str:
    """The ranks whose endpoint is not in the store yet, e.g. "[2, 3] (rank 3 is still
    in generation 1)"; costs a few store requests, only while waiting."""
    store, notes, missing = world.store, [], []
    for q in range(world.size):
        if store.check(f"{world.prefix}ep/{q}"):
            continue
        missing.append(q)
        gk = GEN_KEY.format(q)
        g = int(store.get(gk, timeout=0).decode()) if store.check(gk) else 0
        if g == 0:
            notes.append(f"rank {q} has not called init() yet")
        elif g < world.gen:
            notes.append(f"rank {q} is still in generation {g}")
        elif g > world.gen:
            notes.append(f"rank {q} is already in generation {g}: ranks called init() a "
                         f"different number of times")
    return f"{missing}" + (f" ({'; '.join(notes)})" if notes else "")


class _Joiner:
    """Blocking store reads for the rendezvous, under one deadline, that name the
    missing ranks in a warning about every ``interval`` seconds while they wait."""

    def __init__(self, world: World, timeout: float) -> None:
        self.world = world
        self.timeout = timeout
        self.start = time.monotonic()
        self.deadline = self.start + timeout
        self.interval = _join_warn_interval()
        self.next_warn = self.start + self.interval

    def get(self, key: str) -> bytes:
        w = self.world
        while True:
            now = time.monotonic()
            left = self.deadline - now
            if left <= 0:
                raise RendezvousError(
                    f"rank {w.rank}: ranks {_missing_ranks(w)} never joined the job (world size "
                    f"{w.size}, generation {w.gen}) within {self.timeout:g}s", rank=w.rank)
            try:
                return w.store.get(key, timeout=max(0.0, min(left, self.next_warn - now)))
            except RendezvousError as exc:
                if getattr(exc, "waited", None) is None:
                    raise  # lost the store, not a timeout
            now = time.monotonic()
            if now >= self.next_warn and now < self.deadline:
                _log.warning("ringlet: rank %d waited %.0fs for ranks %s to join (world size %d, "
                             "generation %d); waiting up to %.0fs more", w.rank, now - self.start,
                             _missing_ranks(w), w.size, w.gen, self.deadline - now)
                self.next_warn = now + self.interval


def _size_mismatch(rank: int, size: int, other: int, other_size: int) -> str:
    return (f"world size mismatch: rank {rank} has world size {size} but rank {other} has "
            f"world size {other_size}; every rank must be started with the same world size "
            f"(WORLD_SIZE / -n / init(world_size=))")


def _exchange_endpoints(world: World, timeout: float) -> None:
    from ._shm import ptracer_mode, transport_mode
    from ._topology import bind_mode, cpu_digest, cpu_ranges, machine_id

    store, ctx, p = world.store, world.ctx, world.prefix
    bind = bind_mode()
    ptracer = ptracer_mode()
    try:
        my_cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        my_cpus = []
    # The set itself only when short (a launcher's binding is): rank 0 sends
    # every rank's to every rank.
    ranges = cpu_ranges(my_cpus)
    store.set(f"{p}ep/{world.rank}",
              json.dumps({"ep": f"{world.host}:{ctx.port}", "size": world.size,
                          "host_id": world.host_ids[0], "pid": os.getpid(),
                          "ppid": os.getppid(),
                          "machine": machine_id(world.host_ids[0]),
                          "cpus": cpu_digest(my_cpus),
                          "cpuset": ranges if len(ranges) <= _CPUSET_CHARS else ""}).encode())
    join = _Joiner(world, timeout)
    if world.rank == 0:
        # In rank order: a rank with another world size is caught as soon as
        # the ranks below it have joined, never after the whole timeout.
        table, hosts, pids, ppids, digests, sets, machines = [], [], [], [], [], [], []
        for r in range(world.size):
            entry = json.loads(join.get(f"{p}ep/{r}").decode())
            if entry["size"] != world.size:
                msg = _size_mismatch(0, world.size, r, entry["size"])
                store.set(f"{p}ep/all", json.dumps({"error": msg}).encode())
                raise RendezvousError(f"rank 0: {msg}", rank=0, peer=r)
            table.append(entry["ep"])
            hosts.append(str(entry.get("host_id", "")))
            pids.append(int(entry.get("pid", 0)))
            ppids.append(int(entry.get("ppid", 0)))
            digests.append(str(entry.get("cpus", "")))
            sets.append(str(entry.get("cpuset", "")))
            machines.append(str(entry.get("machine", hosts[-1])))
        store.set(f"{p}ep/all", json.dumps({"eps": table, "hosts": hosts, "pids": pids,
                                            "ppids": ppids,
                                            "cpus": digests, "cpusets": sets,
                                            "machines": machines,
                                            "algo": world.algo,
                                            "model": world.model.as_dict()}).encode())
    else:
        rec = json.loads(join.get(f"{p}ep/all").decode())
        if "error" in rec:
            raise RendezvousError(f"rank {world.rank}: {rec['error']}", rank=world.rank, peer=0)
        table = rec["eps"]
        hosts = rec.get("hosts") or world.host_ids * len(table)
        pids = rec.get("pids") or []
        ppids = rec.get("ppids") or []
        digests = rec.get("cpus") or []
        sets = rec.get("cpusets") or []
        machines = rec.get("machines") or list(hosts)
        world.algo = rec.get("algo", world.algo)
        if "model" in rec:
            from ._costmodel import ModelParams

            world.model = ModelParams.from_dict(rec["model"])
        if len(table) != world.size:
            # Only a rank beyond rank 0's world gets here (rank 0 checked the
            # others); its abort record stops the ranks that formed that world.
            msg = _size_mismatch(world.rank, world.size, 0, len(table))
            world._publish_record(_core.STATUS["ABORTED"], None, 0, f"rank {world.rank}: {msg}")
            raise RendezvousError(f"rank {world.rank}: {msg}", rank=world.rank, peer=0)
    for r, ep in enumerate(table):
        h, _, port = ep.rpartition(":")
        ctx.set_peer(r, h.strip("[]"), int(port))
    world.host_ids = list(hosts)
    # CPUs are shared by the ranks of a machine, whatever their host ids
    # (containers, network namespaces): the busy test (wait.c) counts the CPU
    # time of other processes as load, not that of these ranks (which may be
    # threads of one process), and the wait policy counts these ranks.
    if len(machines) != world.size:
        machines = list(hosts)
    me = machines[world.rank]
    mine = sorted({pid for pid, m in zip(pids, machines) if m == me and pid > 0})
    _core.set_host_pids(mine or [os.getpid()])
    on_machine = sum(1 for m in machines if m == me)
    if on_machine != _core.get_tuning()["host_ranks"]:
        if "RINGLET_SPIN_YIELD" not in os.environ:
            _core.set_tuning(spin_yield=_spin_yield_policy(on_machine))
        _core.set_tuning(host_ranks=on_machine)
    # Binding serves the shared-memory hand-over; over loopback TCP a rank that
    # shares its peer's CPU is woken locally, which beside busy processes beats
    # a bound peer's wake-up on another CPU (docs/launching.md, "CPU binding").
    # Blocks are cut from the machine's CPUs for all its ranks, so ranks with
    # other host ids (containers, network namespaces) never share a block.
    shm = transport_mode() != "tcp"
    peers = [r for r, h in enumerate(hosts) if h == hosts[world.rank] and r != world.rank]
    if shm and peers and len(ppids) == world.size:
        _declare_ptracer(world, ptracer, [ppids[r] for r in [world.rank] + peers])
    if bind == "auto" and shm and peers and my_cpus \
            and len(pids) == len(digests) == world.size:
        _bind_cpus(world, machines, pids, digests, my_cpus)
    if shm and not world.own_cpus and len(pids) == len(sets) == world.size:
        _note_own_cpus(world, machines, pids, sets)


def _declare_ptracer(world: World, mode: str, ppids: List[int]) -> None:
    """RINGLET_PTRACER=parent under Yama's ptrace_scope 1: declare this host's ranks'
    common parent, so that they may read each other's memory (single copy)."""
    from ._shm import ptracer_to_declare, yama_ptrace_scope
    from .trace import log

    if mode == "none":
        return
    try:
        scope = yama_ptrace_scope()
        yama = "no Yama module" if scope is None else f"Yama ptrace_scope {scope}"
    except (OSError, ValueError) as exc:
        scope, yama = None, f"Yama's setting unreadable: {exc}"
    parent = ptracer_to_declare(mode, scope, ppids)
    if parent is None:
        log(world.rank, 1, f"RINGLET_PTRACER=parent: no ptracer declared ({yama}; parents of "
                           f"this host's ranks {sorted(set(ppids))})")
        return
    try:
        _core.set_ptracer(parent)
    except OSError as exc:
        log(world.rank, 1, f"RINGLET_PTRACER=parent: could not declare pid {parent} the "
                           f"ptracer: {exc}")
        return
    world.ptracer = parent
    log(world.rank, 1, f"RINGLET_PTRACER=parent: declared this host's ranks' parent (pid "
                       f"{parent}) the ptracer, so that they may read this rank's memory")


def _bind_cpus(world: World, machines: List[str], pids: List[int], digests: List[str],
               my_cpus: List[int]) -> None:
    """RINGLET_BIND=auto: give this rank its block of its machine's CPUs
    (_topology.plan_binding); close() gives the process its old set back."""
    from ._topology import bind_process, plan_binding

    want = plan_binding(world.rank, machines, pids, digests, my_cpus)
    if want is None or want == my_cpus:
        return
    try:
        bind_process(want)
    except OSError as exc:  # a cpuset changed under us: run unbound
        _log.debug("ringlet: rank %d could not bind to CPUs %s: %s", world.rank, want, exc)
        return
    world.unbind_cpus = my_cpus
    # Its own CPUs: on a busy host its shared-memory waits may poll longer
    # (shm_busy_poll_us) without holding a core that another rank needs.
    world.own_cpus = True
    _core.set_tuning(own_cpus=1)
    _log.debug("ringlet: rank %d bound to CPUs %s of %s (RINGLET_BIND=none leaves them)",
               world.rank, want, my_cpus)


def _note_own_cpus(world: World, machines: List[str], pids: List[int],
                   sets: List[str]) -> None:
    """Ranks a launcher bound to disjoint CPUs own them as much as ranks
    RINGLET_BIND bound: their waits may poll longer on a busy host too."""
    from ._topology import owns_cpus

    if owns_cpus(world.rank, machines, pids, sets):
        world.own_cpus = True
        _core.set_tuning(own_cpus=1)
        _log.debug("ringlet: rank %d runs on CPUs %s, which no other rank of its host "
                   "may run on", world.rank, sets[world.rank])


def shutdown() -> None:
    """Finish pending async work, close every group and leave the job."""
    global _default
    with _lock:
        w = _current()
        if w is None:
            return
        if _tls.scoped:
            _tls.world = None
        else:
            _default = None
    w.close()


def _at_exit() -> None:
    shutdown()
    _close_kept()


atexit.register(_at_exit)


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (default: the world)."""
    return _require(group).rank


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """Number of ranks in ``group`` (default: the world)."""
    return _require(group).size


def get_bind_address() -> str:
    """The address this rank's listener is bound to (other ranks can reach it there).

    Other channels of the job (RPC) listen on the same interface.
    """
    w = _current()
    if w is None:
        raise RuntimeError("ringlet is not initialised: call ringlet.init() first")
    return w.host


def job_key(purpose: str) -> bytes:
    """A 32-byte key derived from the job secret for ``purpose`` (same on every rank).

    For authenticating other channels of the job (RPC uses ``job_key("rpc")``);
    the secret itself is never exposed.
    """
    w = _current()
    if w is None:
        raise RuntimeError("ringlet is not initialised: call ringlet.init() first")
    return w.job_key(purpose)


def new_group(ranks: Sequence[int], *, timeout: Optional[float] = None,
              group: Optional[ProcessGroup] = None) -> ProcessGroup:
    """Create a sub-group of world ranks ``ranks``.

    Every member of the parent group (default: the world) must call this, in
    the same order, with the same ranks, as with torch.distributed.  Ranks
    outside ``ranks`` get a non-member handle (``rank == -1``) whose
    collectives raise ``ValueError``.  The group gets fresh communicator ids,
    so its traffic never mixes with any other group's.

    Raises:
        ValueError: duplicate ranks, or ranks outside the parent group.
        DesyncError: ``ranks`` differ from parent rank 0's.  That is a failure of
            the parent group, published like any other: every other rank's next
            collective (on the new group too) raises it at once.

    Example::

        evens = ringlet.new_group([0, 2])
    """
    parent = _require(group)
    parent._usable()
    world = parent._world
    rl = [int(r) for r in ranks]
    if not rl:
        raise ValueError("new_group: ranks must not be empty")
    if len(set(rl)) != len(rl):
        raise ValueError(f"new_group: duplicate ranks in {rl}")
    missing = [r for r in rl if r not in parent.ranks]
    if missing:
        raise ValueError(f"new_group: ranks {missing} are not in the parent group {parent.ranks}")
    rl.sort()
    t = world.timeout if timeout is None else seconds(timeout)
    key = f"{world.prefix}group/{parent.comm_id}/{parent._ngroups}"
    parent._ngroups += 1
    first = rl
    if world.size == 1:
        comm_id = 2 * (parent._ngroups + 1)
    elif parent.rank == 0:
        comm_id = 2 * world.store.add(world.prefix + "next_comm", 1)
        world.store.set(key, json.dumps({"id": comm_id, "ranks": rl}).encode())
    else:
        rec = json.loads(world.store.get(key, timeout=t).decode())
        comm_id, first = int(rec["id"]), [int(r) for r in rec["ranks"]]
    # Every rank makes the group parent rank 0 recorded, even one that passed other
    # ranks, so its members never wait for that one (in the shared-memory hand-over).
    g = world.make_group(comm_id, first, t)
    if first != rl:
        exc = DesyncError(f"rank {parent.rank}: new_group({rl}) but parent rank 0 created "
                          f"new_group({first})", rank=parent.rank)
        # A failure of the parent: poisoned here, and every rank is told (the abort
        # record), so the others' next collective fails at once, on the new group
        # too; published before this rank's end of the group closes, so that a peer
        # which sees the close first still names this error.
        parent._record(exc)
        g._close()
        world._groups.discard(g)
        raise exc
    return g
