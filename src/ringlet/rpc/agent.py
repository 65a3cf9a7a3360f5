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

This module holds the caller side (calls, connections out, startup and
shutdown); the other parts are one file each: ``listener`` (accepting and
reading requests), ``dispatch`` (running them and replying), ``timers``
(call deadlines), ``pool`` (worker threads), ``refcounts`` (RRef counting),
``protocol`` (frame kinds, ``WorkerInfo``) and ``current`` (which agent a
thread uses).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, ContextManager, Dict, List, Optional, Set, Tuple

from ringlet._auth import LogBudget
from ringlet.errors import CollectiveTimeout, PeerClosedError, ProtocolError, RingletError

from .._timeout import seconds
from .._wire import codec as ser
from . import registry
from .current import _agents, _agents_lock, _tls, current_agent  # noqa: F401 - re-exported
from .dispatch import _Dispatch
from .future import Future, RemoteError
from .listener import _Listener
from .pool import _Pool
from .protocol import (_ARG_SLOTS, _MAX_HANDSHAKES, AUTH_PURPOSE, HANDSHAKE_TIMEOUT, K_CALL,
                       K_CLOSE, K_ERROR, K_REMOTE, K_RESULT, K_RREF_CALL, K_RREF_FETCH,
                       PROTOCOL_VERSION, WorkerInfo, _exc_info)  # noqa: F401 - re-exported
from .refcounts import _RefCounts
from .rref import OwnedTable, RRef, RRefKey
from .timers import _Timers
from .transport import POLL_INTERVAL, Connection, Stopped, UndecodableFrame, configure_socket

_log = logging.getLogger("ringlet.rpc")

__all__ = ["Agent", "WorkerInfo", "current_agent", "PROTOCOL_VERSION"]


@dataclass
class _Pending:
    future: Future
    conn: Connection
    desc: str
    dst: int
    timeout: float


class Agent(_Listener, _Dispatch, _Timers, _RefCounts):
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
        # Done-callbacks of this agent's futures: never on a reader or the timer
        # thread, since a callback that calls (or sends an RRef) waits for a
        # reply only those threads deliver.
        self._callback_pool: Optional[_Pool] = None
        # How many callback jobs the current thread is running (see drain).
        self._in_callbacks = threading.local()
        # The thread running a graceful shutdown (guarded by _clock), and
        # whether close() has finished, for a second caller to wait on.
        self._shutdown_by: Optional[threading.Thread] = None
        self._closed_done = threading.Event()

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
        self._callback_pool = _Pool(self.num_worker_threads, f"rpc{self.rank}-callback", self)
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
        fut._deadline = deadline
        fut._link_s = max(timeout, self.rpc_timeout)
        fut._runner = self._run_callbacks
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
            conn.unanswered.add(rid)
            if transferred:
                conn.carried[rid] = transferred
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
                if rid in conn.unanswered:  # else the reader has uncounted it (_uncount_lost)
                    conn.unanswered.discard(rid)
                    self._sent_to[dst] -= 1
                # Unless the callee refused the frame and the reader released them already.
                transferred = conn.carried.pop(rid, [])
            self._release_transferred(transferred)
            if isinstance(e, RingletError):
                err: BaseException = type(e)(f"{desc}: {e}", rank=self.rank, peer=dst, op="rpc")
            else:
                err = self._shut_error(desc)
            self._complete(rid, exc=err)
        return fut

    def _run_callbacks(self, job: Any) -> None:
        """Run a future's done-callbacks (``job``) on the callback pool.

        They count as completing until they return, so graceful shutdown's
        drain waits for the calls they make.  Once the pool is closed they run
        on the completing thread (shutdown failing the last pending calls).
        """
        with self._plock:
            self._completing += 1

        def run() -> None:
            depth = getattr(self._in_callbacks, "n", 0)
            self._in_callbacks.n = depth + 1
            try:
                job()
            finally:
                self._in_callbacks.n = depth
                with self._plock:
                    self._completing -= 1
                    self._pcond.notify_all()

        pool = self._callback_pool
        if pool is None or not pool.submit(run):
            run()

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
                try:
                    header, value = conn.recv_frame(limits=self.limits, allow_pickle=self.allow_pickle,
                                                    ext_decode=self._ext_decode, skip_undecodable=True)
                except UndecodableFrame as bad:
                    if not bad.in_sync or bad.header.kind not in (K_RESULT, K_ERROR):
                        raise
                    self._undecodable_reply(conn, bad)
                    continue
                if header.kind in (K_RESULT, K_ERROR):
                    with self._plock:
                        conn.unanswered.discard(header.req_id)
                        conn.carried.pop(header.req_id, None)  # the callee holds those counts now
                if header.kind == K_RESULT:
                    self._complete(header.req_id, value=value)
                elif header.kind == K_ERROR:
                    self._remote_error(header.req_id, value)
                elif header.kind == K_CLOSE:
                    # Its request id names the request it refused without keeping any
                    # RRef in it (0: none): the counts made for them are this side's to drop.
                    with self._plock:
                        refused = conn.carried.pop(header.req_id, []) if header.req_id else []
                    self._release_transferred(refused)
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
            # A send that failed closed the connection under this reader: the
            # other calls on it fail for that reason, not a peer that closed.
            cause = conn.close_reason if conn.closed else None
            if cause is not None and cause is not err and not self.stop.is_set():
                err = PeerClosedError(f"the connection to {self._label(conn.peer_rank)} was "
                                      f"closed after a send on it failed ({cause})",
                                      rank=self.rank, peer=conn.peer_rank, op="rpc")
                err.__cause__ = cause
            conn.close(err)
            with self._clock:
                if self._out.get(conn.peer_rank) is conn:
                    del self._out[conn.peer_rank]
            self._uncount_lost(conn)
            self._fail_conn(conn, err)

    def _undecodable_reply(self, conn: Connection, bad: UndecodableFrame) -> None:
        """Fail the one call whose reply could not be decoded here (e.g. a class
        this worker cannot unpickle, or a limit stricter than the callee's).

        The frame was read to its declared end, so the connection and the
        other calls on it carry on.
        """
        rid = bad.header.req_id
        with self._plock:
            conn.unanswered.discard(rid)
            conn.carried.pop(rid, None)
            p = self._pending.get(rid)
        if p is None:
            return  # timed out already
        self._complete(rid, exc=ProtocolError(
            f"{p.desc}: its reply could not be decoded on worker {self.name!r}: {bad}",
            rank=self.rank, peer=p.dst, op="rpc"))

    def _uncount_lost(self, conn: Connection) -> None:
        """Stop counting as sent the requests a closed connection never answered.

        No reply can come for them now, and those the callee never read (say,
        queued behind a frame it refused) would never be counted as answered:
        graceful shutdown waited for them until its timeout.  Those the callee
        did read are still counted as answered when they finish, which the
        drain's "at least" allows.
        """
        with self._plock:
            lost = len(conn.unanswered)
            conn.unanswered.clear()
            self._sent_to[conn.peer_rank] -= lost

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
        if precreated:
            # A request that fails before it runs (an argument whose owner is
            # gone) must still settle the entry: its readers would wait out
            # their timeouts, and graceful shutdown with them.
            def settle(f: Future) -> None:
                exc = f.exception()
                if exc is not None:
                    self.owned.fail_pending(key, _exc_info(exc))

            fut.add_done_callback(settle)
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
    def serving_call(self) -> bool:
        """Whether the calling thread is running a function called over RPC."""
        return self._pool is not None and self._pool.owns(threading.current_thread())

    def in_callback(self) -> bool:
        """Whether the calling thread is running one of this agent's done-callbacks."""
        return getattr(self._in_callbacks, "n", 0) > 0

    def spare_callback_thread(self) -> ContextManager[None]:
        """A context in which the callback pool has one more thread, if the caller is one of them.

        A callback that shuts down holds its thread until the agent is closed,
        while the drain waits for the callbacks queued behind it.
        """
        pool = self._callback_pool
        if pool is None or not pool.owns(threading.current_thread()):
            return contextlib.nullcontext()
        return pool.one_more_thread()

    def claim_shutdown(self) -> Optional[threading.Thread]:
        """Make the calling thread the one that shuts down; None if it now is,
        else the thread already doing it."""
        with self._clock:
            if self._shutdown_by is None:
                self._shutdown_by = threading.current_thread()
                return None
            return self._shutdown_by

    def wait_closed(self, timeout: float) -> bool:
        """Wait until :meth:`close` has finished; False if ``timeout`` passed first."""
        return self._closed_done.wait(timeout)

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

        Called from a done-callback, the callbacks the calling thread is
        running do not count: they cannot finish before the drain does, and
        any call they make afterwards fails, the agent being closed.

        Raises:
            CollectiveTimeout: not quiet within ``timeout`` seconds.
        """
        import ringlet

        deadline = time.monotonic() + timeout
        own = getattr(self._in_callbacks, "n", 0)
        prev: Optional[tuple] = None
        while True:
            with self._pcond:
                while self._pending or self._completing > own:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        descs = sorted({p.desc for p in self._pending.values()})[:5]
                        raise CollectiveTimeout(f"rpc shutdown on worker {self.name!r}: calls still pending after "
                                                f"{timeout:.3g} s: {descs}", rank=self.rank, op="rpc.shutdown")
                    self._pcond.wait(min(left, POLL_INTERVAL))
                mine = [list(self._sent_to), list(self._handled_from),
                        len(self._pending) + self._completing - own]
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
        if self._callback_pool is not None:
            self._callback_pool.close(join_timeout=2.0)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(2.0)
        self.owned.clear()
        self._closed_done.set()


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
