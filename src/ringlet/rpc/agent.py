"""The RPC agent: one per worker, owning its listener, connections, threads and RRef table.

Connections (see docs/rpc.md, "Transport"):

* Every worker listens on an ephemeral TCP port of the interface the ringlet
  world uses; ``init_rpc`` exchanges ``(name, host, port)`` with
  ``all_gather_object``.
* A caller opens one connection to each callee the first time it calls it and
  keeps it: one connection per (caller, callee) *direction*.  Requests go one
  way, replies come back on the same socket, matched by request id, so many
  calls can be in flight on one connection.  Two workers calling each other use
  two connections, which keeps each socket's roles simple: the caller side has
  one reader thread that completes futures, the callee side one reader thread
  that decodes requests and hands them to the worker pool.
* Each connection starts with the mutual HMAC handshake of ``ringlet._auth``
  keyed by ``ringlet.job_key("rpc")``; the caller's claim is its rank.

Threads per worker: an accept thread, one reader per connection, a pool of
``num_worker_threads`` running the called functions, a timer thread that
fails calls at their deadline, and a release thread that sends RRef
releases.  All are daemon threads and all blocking I/O wakes up every
``POLL_INTERVAL`` to check deadlines and the stop flag.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import socket
import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ringlet._auth import LogBudget
from ringlet.errors import CollectiveTimeout, PeerClosedError, ProtocolError, RingletError

from .._timeout import seconds
from . import registry
from .._wire import codec as ser
from .future import Future, RemoteError
from .rref import OwnedTable, RRef, RRefKey
from .transport import POLL_INTERVAL, Connection, Stopped, configure_socket

__all__ = ["Agent", "WorkerInfo", "current_agent", "PROTOCOL_VERSION"]

_log = logging.getLogger("ringlet.rpc")

PROTOCOL_VERSION = 1
AUTH_PURPOSE = "ringlet-rpc"

# Frame kinds (the header's "kind" byte).  Requests that expect a reply are
# CALL, REMOTE, RREF_FETCH, RREF_CALL and RREF_INC; each gets exactly one
# RESULT or ERROR with the same request id.  RREF_DEC is fire-and-forget.
K_CALL = 1
K_RESULT = 2
K_ERROR = 3
K_REMOTE = 4
K_RREF_FETCH = 5
K_RREF_CALL = 6
K_RREF_INC = 7
K_RREF_DEC = 8
K_CLOSE = 9  # callee -> caller: "I am dropping this connection because ..." (best effort)

EXT_RREF = 1

# Where args and kwargs sit in each request's payload list (for error messages).
_ARG_SLOTS = {K_CALL: {1: "args", 2: "kwargs"}, K_REMOTE: {3: "args", 4: "kwargs"},
              K_RREF_CALL: {3: "args", 4: "kwargs"}}

HANDSHAKE_TIMEOUT = 10.0
_MAX_HANDSHAKES = 64
_MAX_ERROR_TEXT = 1 << 16


@dataclass(frozen=True)
class WorkerInfo:
    """A worker of the RPC job: its unique name, rank, and listening address."""

    name: str
    rank: int
    host: str
    port: int


@dataclass
class _Pending:
    future: Future
    conn: Connection
    desc: str
    dst: int
    timeout: float


class _BadRequest(Exception):
    """Internal: a well-framed request whose contents do not make sense."""


# ---- which agent does this thread use -------------------------------------------
_tls = threading.local()
_agents_lock = threading.Lock()
_agents: List["Agent"] = []


def current_agent() -> "Agent":
    """The agent of this worker: the one this thread initialised or serves, else the only one.

    Raises:
        RingletError: RPC is not initialised (or, with several agents in one
            process, this thread belongs to none of them).
    """
    a = getattr(_tls, "agent", None)
    if a is not None and not a.closed:
        return a
    if getattr(_tls, "bound", False):
        # This thread started (and has since shut down) an agent: never borrow
        # another rank's agent (thread-mode worlds keep several in one process).
        raise RingletError("ringlet.rpc is not initialised on this worker: call ringlet.rpc.init_rpc(name) first")
    with _agents_lock:
        live = [x for x in _agents if not x.closed]
    if len(live) == 1:
        return live[0]
    raise RingletError("ringlet.rpc is not initialised on this worker: call ringlet.rpc.init_rpc(name) first"
                       + (" (several RPC agents live in this process; use the thread that called init_rpc)"
                          if live else ""))


class _Pool:
    """A fixed pool of daemon threads running submitted callables in order of arrival."""

    def __init__(self, n: int, name: str, agent: "Agent") -> None:
        self._q: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._agent = agent
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._q.put(job)

    def _run(self) -> None:
        _tls.agent = self._agent
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job()
            except BaseException:  # a job must never take a pool thread down
                _log.exception("rpc: internal error in a worker job")
            # Drop the finished job now: an idle thread must not keep its
            # arguments (e.g. RRefs) alive until the next job arrives.
            job = None

    def close(self, join_timeout: float) -> None:
        for _ in self._threads:
            self._q.put(None)
        deadline = time.monotonic() + join_timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))


def _exc_info(exc: BaseException) -> Tuple[str, str, str]:
    t = type(exc)
    name = t.__qualname__ if t.__module__ in ("builtins", "__main__") else f"{t.__module__}.{t.__qualname__}"
    tb = "".join(traceback.format_exception(t, exc, exc.__traceback__))
    return name, str(exc)[:_MAX_ERROR_TEXT], tb[-_MAX_ERROR_TEXT:]


def _is_int(x: Any) -> bool:
    return type(x) is int


class Agent:
    """One worker's RPC machinery.  Created by :func:`ringlet.rpc.init_rpc`; not for direct use."""

    def __init__(self, *, name: str, rank: int, world_size: int, group: Any, key: bytes, host: str,
                 num_worker_threads: int, allow_pickle: bool, rpc_timeout: float, limits: ser.Limits,
                 created_world: bool) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.created_world = created_world
        self.allow_pickle = allow_pickle
        self.rpc_timeout = rpc_timeout
        self.limits = limits
        self.num_worker_threads = num_worker_threads
        self._key = key
        self.closed = False
        self.stop = threading.Event()

        self.workers: List[WorkerInfo] = []
        self._by_name: Dict[str, int] = {}
        self._peer_pickle: List[bool] = []
        self._peer_limits: List[ser.Limits] = []

        self._plock = threading.Lock()
        self._pcond = threading.Condition(self._plock)
        self._pending: Dict[int, _Pending] = {}
        self._completing = 0
        self._n_sent = 0
        self._n_handled = 0
        # Per peer rank, for shutdown's termination detection (see drain).
        self._sent_to = [0] * world_size
        self._handled_from = [0] * world_size
        self._ids = itertools.count(1)
        self._rref_seq = itertools.count(1)

        self._tcond = threading.Condition()
        self._heap: List[Tuple[float, int]] = []

        self._clock = threading.Lock()
        self._out: Dict[int, Connection] = {}
        self._in: Set[Connection] = set()
        self._connect_locks: Dict[int, threading.Lock] = {}
        self.rejected_connections = 0
        # Sockets still in their handshake, oldest first (guarded by _clock):
        # the oldest is evicted to make room, so idle ones cannot lock callers out.
        self._handshaking: Dict[socket.socket, bool] = {}
        self._warn = LogBudget(_log)
        self.rejected_frames = 0

        self.owned = OwnedTable()
        self._release_q: "queue.SimpleQueue[Optional[Tuple[int, RRefKey]]]" = queue.SimpleQueue()

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=128)
        self._listener.settimeout(POLL_INTERVAL)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._threads: List[threading.Thread] = []
        self._pool: Optional[_Pool] = None

    # ---- startup ------------------------------------------------------------------
    def endpoint_record(self) -> list:
        return [PROTOCOL_VERSION, self.name, self.host, self.port, self.allow_pickle, self.limits.max_frame_bytes]

    def start(self, records: List[list]) -> None:
        """Adopt the gathered endpoint table and start serving.

        Raises:
            ValueError: duplicate worker names or mismatched protocol versions.
        """
        versions = {int(r[0]) for r in records}
        if versions != {PROTOCOL_VERSION}:
            raise ValueError(f"init_rpc: workers speak different RPC protocol versions {sorted(versions)}")
        seen: Dict[str, int] = {}
        for rank, rec in enumerate(records):
            nm = rec[1]
            if nm in seen:
                raise ValueError(f"init_rpc: worker name {nm!r} is used by ranks {seen[nm]} and {rank}; "
                                 "names must be unique")
            seen[nm] = rank
        self.workers = [WorkerInfo(str(r[1]), i, str(r[2]), int(r[3])) for i, r in enumerate(records)]
        self._by_name = seen
        self._peer_pickle = [bool(r[4]) for r in records]
        self._peer_limits = [replace(self.limits, max_frame_bytes=min(int(r[5]), self.limits.max_frame_bytes))
                             for r in records]
        self._connect_locks = {r: threading.Lock() for r in range(self.world_size)}
        self._pool = _Pool(self.num_worker_threads, f"rpc{self.rank}-worker", self)
        for target, nm in ((self._accept_loop, "accept"), (self._timer_loop, "timer"),
                           (self._release_loop, "release")):
            t = threading.Thread(target=target, name=f"rpc{self.rank}-{nm}", daemon=True)
            t.start()
            self._threads.append(t)
        with _agents_lock:
            _agents.append(self)
        _tls.agent = self
        _tls.bound = True

    # ---- small helpers ----------------------------------------------------------
    def worker_info(self, to: Any = None) -> WorkerInfo:
        if to is None:
            return self.workers[self.rank]
        return self.workers[self.resolve(to)]

    def resolve(self, to: Any) -> int:
        """Rank of ``to`` (a worker name, a rank, or a WorkerInfo).

        Raises:
            TypeError: ``to`` has another type.
            ValueError: no such worker.
        """
        if isinstance(to, WorkerInfo):
            to = to.rank
        if isinstance(to, str):
            r = self._by_name.get(to)
            if r is None:
                raise ValueError(f"no RPC worker named {to!r}; workers are {sorted(self._by_name)}")
            return r
        if isinstance(to, bool) or not isinstance(to, int):
            raise TypeError(f"'to' must be a worker name (str), rank (int) or WorkerInfo, got {type(to).__name__}")
        if not 0 <= to < self.world_size:
            raise ValueError(f"rank {to} is out of range for {self.world_size} workers")
        return int(to)

    def check_timeout(self, timeout: Any) -> float:
        """``timeout`` validated, or the default ``rpc_timeout`` for None.

        Raises:
            TypeError: not a number.
            ValueError: not > 0 (NaN included); inf and huge values are capped
                at ``ringlet.MAX_TIMEOUT``.
        """
        if timeout is None:
            return self.rpc_timeout
        return seconds(timeout)

    def _label(self, rank: int) -> str:
        return f"worker {self.workers[rank].name!r} (rank {rank})"

    def _pickle_with(self, rank: int) -> bool:
        return self.allow_pickle and self._peer_pickle[rank]

    def _check_open(self) -> None:
        if self.closed:
            raise RingletError(f"ringlet.rpc on worker {self.name!r} is shut down")

    def new_rref_key(self) -> RRefKey:
        return (self.rank, next(self._rref_seq))

    # ---- RRef transfer (see rref.py for the protocol) -----------------------------
    def _ext_encoder(self, transferred: List[Tuple[int, RRefKey]], deadline: float) -> Callable[[Any], Any]:
        def enc(obj: Any) -> Optional[Tuple[int, Any]]:
            if not isinstance(obj, RRef):
                return None
            if obj._agent is not self:
                raise TypeError("an RRef of another RPC agent cannot be sent from this worker")
            self._add_count(obj._owner, obj._key, deadline)
            transferred.append((obj._owner, obj._key))
            return EXT_RREF, [obj._owner, obj._key[0], obj._key[1]]

        return enc

    def _add_count(self, owner: int, key: RRefKey, deadline: float) -> None:
        """Create one more count at the owner; returns only once the owner has it."""
        if owner == self.rank:
            try:
                self.owned.incref(key)
            except KeyError:
                raise RingletError(f"RRef {key} is no longer held by its owner {self.name!r}") from None
            return
        fut = self._call(K_RREF_INC, owner, [[key[0], key[1]]], max(1e-3, deadline - time.monotonic()),
                         f"RRef reference count increment on {self._label(owner)}")
        fut.result()

    def _release_transferred(self, transferred: List[Tuple[int, RRefKey]]) -> None:
        for owner, key in transferred:
            self.release(owner, key)

    def _ext_decode(self, code: int, value: Any) -> Any:
        if code != EXT_RREF or type(value) is not list or len(value) != 3 or not all(map(_is_int, value)):
            raise ProtocolError(f"malformed extension value (code {code})")
        owner, c, s = value
        if not 0 <= owner < self.world_size:
            raise ProtocolError(f"RRef owner rank {owner} out of range")
        return RRef(_agent=self, _owner=owner, _key=(c, s))

    def clone_rref(self, rref: RRef) -> RRef:
        self._add_count(rref._owner, rref._key, time.monotonic() + self.rpc_timeout)
        return RRef(_agent=self, _owner=rref._owner, _key=rref._key)

    def release(self, owner: int, key: RRefKey) -> None:
        """Drop one count of ``key`` at ``owner`` (called from ``RRef.__del__``: must not block)."""
        if not self.closed:
            self._release_q.put((owner, key))

    def _release_loop(self) -> None:
        _tls.agent = self
        while True:
            try:
                item = self._release_q.get(timeout=POLL_INTERVAL)
            except queue.Empty:
                if self.stop.is_set():
                    return
                continue
            if item is None:
                return
            batch = [item]
            while len(batch) < 4096:
                try:
                    nxt = self._release_q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._release_q.put(None)
                    break
                batch.append(nxt)
            by_owner: Dict[int, List[list]] = {}
            for owner, key in batch:
                if owner == self.rank:
                    self.owned.decref(key)
                else:
                    by_owner.setdefault(owner, []).append([key[0], key[1]])
            for owner, keys in by_owner.items():
                try:
                    deadline = time.monotonic() + self.rpc_timeout
                    conn = self._conn_to(owner, deadline)
                    conn.send_frame(K_RREF_DEC, 0, ser.encode(keys, limits=self._peer_limits[owner]),
                                    deadline=deadline)
                except (RingletError, OSError, Stopped) as e:
                    _log.debug("rpc: could not release %d RRef(s) on %s: %s", len(keys), self._label(owner), e)

    # ---- calling ------------------------------------------------------------------
    def _call(self, kind: int, dst: int, payload: Any, timeout: float, desc: str) -> Future:
        """Encode, send and register one request; errors after validation go into the future.

        Raises:
            TypeError, ValueError: the payload cannot be encoded for ``dst``.
            RingletError: the agent is shut down.
        """
        self._check_open()
        deadline = time.monotonic() + timeout
        fut = Future(desc, rank=self.rank, peer=dst)
        transferred: List[Tuple[int, RRefKey]] = []
        try:
            enc = ser.encode(payload, limits=self._peer_limits[dst], allow_pickle=self._pickle_with(dst),
                             ext_encode=self._ext_encoder(transferred, deadline), what="request",
                             top_names=_ARG_SLOTS.get(kind))
        except RingletError as e:  # an RRef argument's owner could not be reached
            self._release_transferred(transferred)
            fut._complete(exc=e)
            return fut
        except BaseException:
            self._release_transferred(transferred)
            raise
        try:
            conn = self._conn_to(dst, deadline)
        except (RingletError, Stopped) as e:
            self._release_transferred(transferred)
            fut._complete(exc=e if isinstance(e, RingletError) else self._shut_error(desc))
            return fut
        rid = next(self._ids)
        with self._plock:
            self._pending[rid] = _Pending(fut, conn, desc, dst, timeout)
            conn.pending_ids.add(rid)
            self._n_sent += 1
            self._sent_to[dst] += 1
        with self._tcond:
            heapq.heappush(self._heap, (deadline, rid))
            if self._heap[0][1] == rid:
                self._tcond.notify()
        try:
            conn.send_frame(kind, rid, enc, deadline=deadline)
        except (RingletError, Stopped, OSError) as e:
            with self._plock:
                self._n_sent -= 1  # the callee never got the whole frame
                self._sent_to[dst] -= 1
            self._release_transferred(transferred)
            if isinstance(e, RingletError):
                err: BaseException = type(e)(f"{desc}: {e}", rank=self.rank, peer=dst, op="rpc")
            else:
                err = self._shut_error(desc)
            self._complete(rid, exc=err)
        return fut

    def _shut_error(self, desc: str) -> RingletError:
        return RingletError(f"{desc}: ringlet.rpc on worker {self.name!r} was shut down", rank=self.rank, op="rpc")

    def _complete(self, rid: int, value: Any = None, exc: Optional[BaseException] = None) -> None:
        with self._plock:
            p = self._pending.pop(rid, None)
            if p is None:
                return  # already timed out or failed; a late reply is dropped
            p.conn.pending_ids.discard(rid)
            self._completing += 1
        try:
            if exc is None:
                p.future._complete(value)
            else:
                p.future._complete(exc=exc)
        finally:
            with self._plock:
                self._completing -= 1
                self._pcond.notify_all()

    def _remote_error(self, rid: int, value: Any) -> None:
        with self._plock:
            p = self._pending.get(rid)
        if p is None:
            return
        if type(value) is list and len(value) == 4 and all(type(x) is str for x in value):
            t, m, tb, fn = value
            err: BaseException = RemoteError(t, m, tb, worker=self.workers[p.dst].name, function=fn,
                                             rank=self.rank, peer=p.dst)
        else:
            err = ProtocolError(f"{p.desc}: malformed error reply from {self._label(p.dst)}",
                                rank=self.rank, peer=p.dst, op="rpc")
        self._complete(rid, exc=err)

    # ---- timer --------------------------------------------------------------------
    def _timer_loop(self) -> None:
        while not self.stop.is_set():
            expired: List[int] = []
            with self._tcond:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    expired.append(heapq.heappop(self._heap)[1])
                if not expired:
                    if len(self._heap) > 1024 and len(self._heap) > 4 * len(self._pending):
                        # Entries of completed calls are removed lazily; compact now and then.
                        self._heap = [e for e in self._heap if e[1] in self._pending]
                        heapq.heapify(self._heap)
                    wait = self._heap[0][0] - now if self._heap else POLL_INTERVAL
                    self._tcond.wait(min(wait, POLL_INTERVAL))
                    continue
            for rid in expired:
                with self._plock:
                    p = self._pending.get(rid)
                if p is not None:
                    self._complete(rid, exc=CollectiveTimeout(
                        f"{p.desc} timed out after {p.timeout:.3g} s", rank=self.rank, peer=p.dst,
                        op="rpc", waited=p.timeout))

    # ---- connections (caller side) -----------------------------------------------
    def _conn_to(self, dst: int, deadline: float) -> Connection:
        with self._clock:
            c = self._out.get(dst)
        if c is not None and not c.closed:
            return c
        lock = self._connect_locks[dst]
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise CollectiveTimeout(f"timed out waiting to connect to {self._label(dst)}", rank=self.rank,
                                    peer=dst, op="rpc")
        try:
            with self._clock:
                c = self._out.get(dst)
            if c is not None and not c.closed:
                return c
            self._check_open()
            return self._connect(dst, deadline)
        finally:
            lock.release()

    def _connect(self, dst: int, deadline: float) -> Connection:
        from ringlet._auth import HandshakeAborted, open_connection

        w = self.workers[dst]
        pause = 0.001
        for attempt in itertools.count(1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeout(f"no time left to connect to {self._label(dst)}"
                                        + (f" (it cut {attempt - 1} handshakes short: flooded by "
                                           f"unauthenticated connections?)" if attempt > 1 else ""),
                                        rank=self.rank, peer=dst, op="rpc")
            try:
                sock = open_connection(w.host, w.port, self._key, AUTH_PURPOSE, connect_timeout=remaining,
                                       deadline=min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT),
                                       claim=str(self.rank).encode())
            except HandshakeAborted:
                # The server cut the handshake before any verdict: it evicts its
                # oldest pending handshake when crowded.  Try a fresh connection.
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, 0.05)
                continue
            except socket.timeout:
                raise CollectiveTimeout(f"connecting to {self._label(dst)} at {w.host}:{w.port} timed out",
                                        rank=self.rank, peer=dst, op="rpc") from None
            except OSError as e:
                raise PeerClosedError(f"cannot connect to {self._label(dst)} at {w.host}:{w.port}: {e}",
                                      rank=self.rank, peer=dst, op="rpc") from None
            configure_socket(sock)
            break
        conn = Connection(sock, peer_rank=dst, peer_name=w.name, stop=self.stop, frame_timeout=self.rpc_timeout)
        with self._clock:
            if self.closed:
                conn.close()
                raise self._shut_error(f"connecting to {self._label(dst)}")
            self._out[dst] = conn
        t = threading.Thread(target=self._client_reader, args=(conn,), name=f"rpc{self.rank}-to{dst}", daemon=True)
        t.start()
        return conn

    def _client_reader(self, conn: Connection) -> None:
        _tls.agent = self
        err: Optional[BaseException] = None
        try:
            while True:
                header, value = conn.recv_frame(limits=self.limits, allow_pickle=self.allow_pickle,
                                                ext_decode=self._ext_decode)
                if header.kind == K_RESULT:
                    self._complete(header.req_id, value=value)
                elif header.kind == K_ERROR:
                    self._remote_error(header.req_id, value)
                elif header.kind == K_CLOSE:
                    err = ProtocolError(f"{self._label(conn.peer_rank)} dropped the connection: {value}",
                                        rank=self.rank, peer=conn.peer_rank, op="rpc")
                    return
                else:
                    err = ProtocolError(f"unexpected frame kind {header.kind} from {self._label(conn.peer_rank)}",
                                        rank=self.rank, peer=conn.peer_rank, op="rpc")
                    return
                value = None  # do not keep the last reply (and RRefs in it) alive while idle
        except Stopped:
            err = None
        except RingletError as e:
            err = e
        except Exception as e:  # e.g. a reply this worker cannot decode
            err = ProtocolError(f"bad reply from {self._label(conn.peer_rank)}: {type(e).__name__}: {e}",
                                rank=self.rank, peer=conn.peer_rank, op="rpc")
        finally:
            conn.close(err)
            with self._clock:
                if self._out.get(conn.peer_rank) is conn:
                    del self._out[conn.peer_rank]
            self._fail_conn(conn, err)

    def _fail_conn(self, conn: Connection, err: Optional[BaseException]) -> None:
        with self._plock:
            rids = list(conn.pending_ids)
            descs = {rid: self._pending[rid].desc for rid in rids if rid in self._pending}
        for rid, desc in descs.items():
            if err is None or self.stop.is_set():
                exc: BaseException = self._shut_error(desc)
            elif isinstance(err, (PeerClosedError, CollectiveTimeout, ProtocolError)):
                exc = type(err)(f"{desc}: {err}", rank=self.rank, peer=conn.peer_rank, op="rpc")
            else:
                exc = PeerClosedError(f"{desc}: connection to {self._label(conn.peer_rank)} failed: {err}",
                                      rank=self.rank, peer=conn.peer_rank, op="rpc")
            exc.__cause__ = err
            self._complete(rid, exc=exc)

    # ---- serving (callee side) ---------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.stop.is_set():
            try:
                sock, addr = self._listener.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self.stop.is_set():
                    return
                if self._evict_oldest():
                    continue  # e.g. out of descriptors: one was just freed
                self._warn.warn("rpc: accept failed on worker %r: %s", self.name, e)
                self.stop.wait(0.05)  # nothing to free: do not spin
                continue
            # Unauthenticated clients cost a thread each for up to
            # HANDSHAKE_TIMEOUT; at the cap the oldest makes room.
            if len(self._handshaking) >= _MAX_HANDSHAKES:
                self._evict_oldest()
            with self._clock:
                self._handshaking[sock] = True
            threading.Thread(target=self._serve, args=(sock, addr), name=f"rpc{self.rank}-serve",
                             daemon=True).start()

    def _evict_oldest(self) -> bool:
        """Cut the oldest pending handshake (its thread then fails it); False if none."""
        with self._clock:
            victim = next(iter(self._handshaking), None)
            if victim is None:
                return False
            del self._handshaking[victim]
        try:
            victim.shutdown(socket.SHUT_RDWR)  # wakes its handshake thread at once
        except OSError:
            pass
        return True

    def _admit(self, sock: socket.socket, claim: bytes) -> bool:
        """check_claim of a handshake whose proof verified: leave the evictable set.

        An eviction that got here first wins: the socket is shut before any
        status is sent, so the client sees a cut handshake and retries.
        """
        with self._clock:
            admitted = self._handshaking.pop(sock, False)
        if not admitted:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return False
        return self._check_claim(claim)

    def _check_claim(self, claim: bytes) -> bool:
        try:
            r = int(claim.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return False
        return 0 <= r < self.world_size and claim.decode("ascii") == str(r)

    def _serve(self, sock: socket.socket, addr: Any) -> None:
        from ringlet._auth import server_handshake

        _tls.agent = self
        try:
            claim = server_handshake(sock, self._key, AUTH_PURPOSE, deadline=time.monotonic() + HANDSHAKE_TIMEOUT,
                                     check_claim=lambda c: self._admit(sock, c))
            peer = int(bytes(claim).decode("ascii"))
            configure_socket(sock)
        except (RingletError, OSError, ValueError) as e:
            with self._clock:
                self._handshaking.pop(sock, None)
                self.rejected_connections += 1
            self._warn.warn("rpc: worker %r rejected a connection from %s: %s", self.name, addr, e)
            sock.close()
            return
        conn = Connection(sock, peer_rank=peer, peer_name=self.workers[peer].name, stop=self.stop,
                          frame_timeout=self.rpc_timeout)
        with self._clock:
            if self.closed:
                conn.close()
                return
            self._in.add(conn)
        err: Optional[BaseException] = None
        try:
            while True:
                header, value = conn.recv_frame(limits=self.limits, allow_pickle=self.allow_pickle,
                                                ext_decode=self._ext_decode)
                self._dispatch(conn, header, value)
                value = None  # the pool job holds what it needs; do not pin args while idle
        except Stopped:
            pass
        except ProtocolError as e:
            err = e
            self._reject_frame(conn, e)
        except PeerClosedError:
            pass  # the caller went away: normal at the end of a job
        except RingletError as e:
            err = e
            _log.warning("rpc: connection from %s failed: %s", self._label(peer), e)
        except Exception as e:  # a frame that decodes into nonsense (e.g. a bad RRef)
            err = ProtocolError(f"{type(e).__name__}: {e}")
            self._reject_frame(conn, err)
        finally:
            conn.close(err)
            with self._clock:
                self._in.discard(conn)

    def _reject_frame(self, conn: Connection, err: BaseException) -> None:
        with self._clock:
            self.rejected_frames += 1
        _log.warning("rpc: worker %r dropped the connection from %s: %s", self.name, self._label(conn.peer_rank), err)
        try:  # tell the caller why, so its pending calls fail with the reason (best effort)
            conn.send_frame(K_CLOSE, 0, ser.encode(str(err)[:_MAX_ERROR_TEXT]), deadline=time.monotonic() + 1.0)
            # Half-close and discard what the peer still sends (bounded): closing
            # with unread input would send a reset that can destroy the notice.
            conn.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 1.0
            budget = 1 << 20
            while budget > 0 and time.monotonic() < deadline and not self.stop.is_set():
                try:
                    chunk = conn.sock.recv(65536)
                except socket.timeout:
                    continue
                if not chunk:
                    break
                budget -= len(chunk)
        except (RingletError, Stopped, OSError):
            pass

    def _dispatch(self, conn: Connection, header: ser.Header, value: Any) -> None:
        kind, rid = header.kind, header.req_id
        if kind == K_RREF_DEC:
            for c, s in self._keys(value):
                self.owned.decref((c, s))
            return
        if kind not in (K_CALL, K_REMOTE, K_RREF_FETCH, K_RREF_CALL, K_RREF_INC):
            raise ProtocolError(f"unexpected frame kind {kind} on a request connection")
        try:
            if kind == K_CALL:
                self._on_call(conn, rid, value)
            elif kind == K_REMOTE:
                self._on_remote(conn, rid, value)
            elif kind == K_RREF_FETCH:
                self._on_fetch(conn, rid, value)
            elif kind == K_RREF_CALL:
                self._on_rref_call(conn, rid, value)
            else:
                for c, s in self._keys(value):
                    try:
                        self.owned.incref((c, s))
                    except KeyError:
                        raise _BadRequest(f"RRef {(c, s)} is not (or no longer) held by worker {self.name!r}") \
                            from None
                self._reply(conn, rid, value=None, fn="RRef")
        except _BadRequest as e:
            self._reply(conn, rid, error=("ValueError", str(e), ""), fn="rpc")

    @staticmethod
    def _keys(value: Any) -> List[Tuple[int, int]]:
        if type(value) is not list or not all(type(k) is list and len(k) == 2 and all(map(_is_int, k))
                                              for k in value):
            raise ProtocolError("malformed RRef key list")
        return [(k[0], k[1]) for k in value]

    @staticmethod
    def _call_parts(name: Any, args: Any, kwargs: Any) -> Tuple[str, tuple, dict]:
        if type(name) is not str:
            raise _BadRequest("function name must be a str")
        if type(args) not in (tuple, list):
            raise _BadRequest("args must be a tuple")
        if type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
            raise _BadRequest("kwargs must be a dict with str keys")
        return name, tuple(args), kwargs

    def _lookup(self, name: str) -> Callable[..., Any]:
        fn = registry.lookup(name)
        if fn is None:
            raise _BadRequest(f"no function registered as {name!r} on worker {self.name!r} "
                              "(only functions passed to ringlet.rpc.register can be called)")
        return fn

    def _on_call(self, conn: Connection, rid: int, value: Any) -> None:
        if type(value) is not list or len(value) != 3:
            raise _BadRequest("malformed call request")
        name, args, kwargs = self._call_parts(*value)
        fn = self._lookup(name)

        def job() -> None:
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # reported to the caller; the worker thread lives on
                self._reply(conn, rid, error=_exc_info(e), fn=name)
                return
            self._reply(conn, rid, value=result, fn=name)

        assert self._pool is not None
        self._pool.submit(job)

    def _on_remote(self, conn: Connection, rid: int, value: Any) -> None:
        if type(value) is not list or len(value) != 6 or not _is_int(value[0]) or not _is_int(value[1]) \
                or type(value[5]) is not bool:
            raise _BadRequest("malformed remote request")
        key = (value[0], value[1])
        name, args, kwargs = self._call_parts(value[2], value[3], value[4])
        if key[0] != conn.peer_rank or (value[5] and conn.peer_rank != self.rank):
            raise _BadRequest(f"RRef id {key} was not created by the calling worker")
        if not value[5]:
            # Created here, on the reader thread, so that a release arriving
            # later on this connection always finds the entry.
            try:
                self.owned.create(key, name)
            except RingletError as e:
                raise _BadRequest(str(e)) from None
        try:
            fn = self._lookup(name)
        except _BadRequest as e:
            self.owned.set_result(key, error=("ValueError", str(e), ""))
            raise

        def job() -> None:
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                info = _exc_info(e)
                self.owned.set_result(key, error=info)
                self._reply(conn, rid, error=info, fn=name)
                return
            self.owned.set_result(key, value=result)
            self._reply(conn, rid, value=None, fn=name)

        assert self._pool is not None
        self._pool.submit(job)

    def _when_ready(self, key: RRefKey, job: Callable[[Any], None]) -> None:
        try:
            self.owned.when_ready(key, lambda entry: self._pool.submit(lambda: job(entry)))  # type: ignore[union-attr]
        except KeyError:
            raise _BadRequest(f"RRef {key} is not (or no longer) held by worker {self.name!r}") from None

    def _on_fetch(self, conn: Connection, rid: int, value: Any) -> None:
        if type(value) is not list or len(value) != 2 or not all(map(_is_int, value)):
            raise _BadRequest("malformed RRef fetch request")

        def job(entry: Any) -> None:
            if entry.error is not None:
                self._reply(conn, rid, error=entry.error, fn=entry.function)
            else:
                self._reply(conn, rid, value=entry.value, fn=f"RRef.to_here ({entry.function})")

        self._when_ready((value[0], value[1]), job)

    def _on_rref_call(self, conn: Connection, rid: int, value: Any) -> None:
        if type(value) is not list or len(value) != 5 or not _is_int(value[0]) or not _is_int(value[1]):
            raise _BadRequest("malformed RRef method call")
        method, args, kwargs = self._call_parts(value[2], value[3], value[4])
        if not method.isidentifier() or method.startswith("_"):
            # The safety rule: only public methods; dunder/private names would
            # expose the object's internals (and, through them, everything).
            raise _BadRequest(f"refusing to call method {method!r} on an RRef value: only public "
                              "methods (names not starting with '_') can be called")

        def job(entry: Any) -> None:
            label = f"{type(entry.value).__name__}.{method}"
            if entry.error is not None:
                self._reply(conn, rid, error=entry.error, fn=entry.function)
                return
            try:
                m = getattr(entry.value, method)
                if not callable(m):
                    raise TypeError(f"attribute {method!r} of {type(entry.value).__name__} is not callable")
                result = m(*args, **kwargs)
            except BaseException as e:
                self._reply(conn, rid, error=_exc_info(e), fn=label)
                return
            self._reply(conn, rid, value=result, fn=label)

        self._when_ready((value[0], value[1]), job)

    def _reply(self, conn: Connection, rid: int, *, value: Any = None, error: Optional[Tuple[str, str, str]] = None,
               fn: str) -> None:
        """Send the one reply a request gets (RESULT or ERROR), and count it as handled."""
        peer = conn.peer_rank
        transferred: List[Tuple[int, RRefKey]] = []
        deadline = time.monotonic() + self.rpc_timeout
        try:
            if error is None:
                try:
                    enc = ser.encode(value, limits=self._peer_limits[peer], allow_pickle=self._pickle_with(peer),
                                     ext_encode=self._ext_encoder(transferred, deadline), what=f"result of {fn!r}")
                    kind = K_RESULT
                except (TypeError, ValueError, RingletError) as e:
                    self._release_transferred(transferred)
                    transferred = []
                    error = (type(e).__name__, f"the result cannot be sent back: {e}", "")
            if error is not None:
                enc = ser.encode([error[0], error[1], error[2], fn])
                kind = K_ERROR
            try:
                conn.send_frame(kind, rid, enc, deadline=deadline)
            except (RingletError, Stopped, OSError) as e:
                self._release_transferred(transferred)
                _log.debug("rpc: reply to %s lost: %s", self._label(peer), e)
        finally:
            with self._plock:
                self._n_handled += 1
                if 0 <= peer < self.world_size:
                    self._handled_from[peer] += 1
                self._pcond.notify_all()

    # ---- RRef requests (caller side) -----------------------------------------------
    def remote(self, to: Any, fn: Any, args: Any, kwargs: Any, timeout: Any) -> RRef:
        dst = self.resolve(to)
        name = registry.name_of(fn)
        args, kwargs = _check_args(args, kwargs)
        timeout = self.check_timeout(timeout)
        key = self.new_rref_key()
        precreated = dst == self.rank
        if precreated:  # the owner is this worker: the entry must exist before our own release can run
            self.owned.create(key, name)
        try:
            fut = self._call(K_REMOTE, dst, [key[0], key[1], name, args, kwargs, precreated], timeout,
                             f"remote({name!r}) on {self._label(dst)}")
        except BaseException:
            if precreated:
                self.owned.decref(key)
            raise
        return RRef(_agent=self, _owner=dst, _key=key, _created=fut)

    def rref_fetch(self, rref: RRef, timeout: Any) -> Future:
        return self._call(K_RREF_FETCH, rref._owner, [rref._key[0], rref._key[1]], self.check_timeout(timeout),
                          f"RRef.to_here() from {self._label(rref._owner)}")

    def rref_call(self, rref: RRef, method: str, args: Any, kwargs: Any, timeout: float) -> Future:
        args, kwargs = _check_args(args, kwargs)
        return self._call(K_RREF_CALL, rref._owner, [rref._key[0], rref._key[1], method, args, kwargs], timeout,
                          f"RRef method {method!r} on {self._label(rref._owner)}")

    # ---- introspection -------------------------------------------------------------
    def debug_info(self) -> Dict[str, Any]:
        with self._plock:
            pending, sent, handled = len(self._pending), self._n_sent, self._n_handled
        with self._clock:
            n_out, n_in = len(self._out), len(self._in)
            rej_c, rej_f = self.rejected_connections, self.rejected_frames
            handshaking = len(self._handshaking)
        return {"name": self.name, "rank": self.rank, "world_size": self.world_size, "host": self.host,
                "port": self.port, "pending_calls": pending, "calls_sent": sent, "calls_handled": handled,
                "owned_rrefs": len(self.owned), "connections_out": n_out, "connections_in": n_in,
                "rejected_connections": rej_c, "rejected_frames": rej_f, "pending_handshakes": handshaking,
                "allow_pickle": self.allow_pickle}

    # ---- shutdown -----------------------------------------------------------------
    def drain(self, timeout: float) -> None:
        """Wait until no worker has an RPC in flight (a collective over the RPC group).

        Termination detection by counting: every worker reports, per peer
        rank, the requests it sent to it and the requests from it it
        answered, and its calls still pending locally.  The job is quiet when,
        in two consecutive rounds, nothing is pending, every pair has
        answered at least what was sent, and no count changed; a request still
        being served shows up as sent-but-not-answered.  "At least", not
        "equal": an authenticated client that is not a worker (a tool holding
        the job key) has its calls answered but never counted as sent, and
        must not keep shutdown waiting.

        Raises:
            CollectiveTimeout: not quiet within ``timeout`` seconds.
        """
        import ringlet

        deadline = time.monotonic() + timeout
        prev: Optional[tuple] = None
        while True:
            with self._pcond:
                while self._pending or self._completing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        descs = sorted({p.desc for p in self._pending.values()})[:5]
                        raise CollectiveTimeout(f"rpc shutdown on worker {self.name!r}: calls still pending after "
                                                f"{timeout:.3g} s: {descs}", rank=self.rank, op="rpc.shutdown")
                    self._pcond.wait(min(left, POLL_INTERVAL))
                mine = [list(self._sent_to), list(self._handled_from),
                        len(self._pending) + self._completing]
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeout(f"rpc shutdown on worker {self.name!r}: other workers still busy after "
                                        f"{timeout:.3g} s", rank=self.rank, op="rpc.shutdown")
            stats = ringlet.all_gather_object(mine, group=self.group, timeout=left)
            n = len(stats)
            sent = tuple(tuple(int(x) for x in s[0]) for s in stats)  # sent[src][dst]
            handled = tuple(tuple(int(x) for x in s[1]) for s in stats)  # handled[dst][src]
            busy = sum(int(s[2]) for s in stats)
            quiet = busy == 0 and all(handled[d][s] >= sent[s][d]
                                      for s in range(n) for d in range(n))
            if quiet and prev == (sent, handled):
                return
            prev = (sent, handled) if quiet else None
            if not quiet:
                # Someone is still serving: give it a moment before the next round.
                with self._pcond:
                    self._pcond.wait(min(0.02, max(0.0, deadline - time.monotonic())))

    def close(self, reason: str = "shut down") -> None:
        """Stop everything now: pending calls fail, connections close, threads exit."""
        with self._clock:
            if self.closed:
                return
            self.closed = True
            conns = list(self._out.values()) + list(self._in)
        self.stop.set()
        with _agents_lock:
            if self in _agents:
                _agents.remove(self)
        if getattr(_tls, "agent", None) is self:
            _tls.agent = None
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread at once (Linux)
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        for c in conns:
            c.close()
        with self._plock:
            rids = list(self._pending)
            descs = {rid: self._pending[rid].desc for rid in rids}
        for rid in rids:
            self._complete(rid, exc=RingletError(f"{descs[rid]}: ringlet.rpc on worker {self.name!r} was {reason}",
                                                 rank=self.rank, op="rpc"))
        with self._tcond:
            self._tcond.notify_all()
        self._release_q.put(None)
        if self._pool is not None:
            self._pool.close(join_timeout=2.0)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(2.0)
        self.owned.clear()


def _check_args(args: Any, kwargs: Any) -> Tuple[tuple, dict]:
    if type(args) is list:
        args = tuple(args)
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple (or list), got {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    bad = [k for k in kwargs if not isinstance(k, str)]
    if bad:
        raise TypeError(f"kwargs keys must be str, got {bad[0]!r}")
    return tuple(args), dict(kwargs)
