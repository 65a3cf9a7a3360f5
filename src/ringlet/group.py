"""``ProcessGroup``: a set of ranks and the collectives that run over it.

Every method validates its arguments before a byte is sent (``TypeError`` /
``ValueError`` naming the problem), then runs the C collective with the GIL
released, inline or, with ``async_op=True``, on the group's progress thread.
Collectives of one group run in the order they were issued.  A group keeps
two C communicators with distinct ids, one for collectives and one for
point-to-point traffic, so tagged messages never interleave with collective
frames.  After any failure the group is poisoned: later calls raise
``GroupPoisonedError`` whose ``__cause__`` is the original error.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from . import _core
from . import trace as _trace
from ._buffers import as_array as _as_array
from ._timeout import millis as _millis
from ._dtypes import ReduceOp, check_op, dtype_code
from .errors import CollectiveTimeout, GroupPoisonedError, RingletError
from .work import SerialExecutor, Work

__all__ = ["ProcessGroup"]

_MAX_TAG = 2**32 - 1
_SUM = ReduceOp.SUM

# _array(x, what, writable): TypeError unless x is a numpy array, ValueError
# unless C-contiguous (and writable).  The C binding's check, as it reads the
# flags without building numpy's flags object.
_array = _core.check_array
# _acode(x, what, writable, dtype_code): the same checks, then x's C dtype
# code, in one call (numpy's built-in types mapped in C, others by dtype_code).
_acode = _core.array_code
# _overlap(a, b): whether two checked (C-contiguous) arrays share a byte.
_overlap = _core.overlap
# _pair(output, input, op, P, kind, disjoint, fallback): every check of a
# two-array collective in one call; the output's dtype code.
_pair = _core.pair_code
_EQUAL, _GATHER, _SCATTER = _core.PAIR_EQUAL, _core.PAIR_GATHER, _core.PAIR_SCATTER


# Any accepted buffer (torch tensor, DLPack, buffer protocol) becomes a numpy
# view first; the check is one type comparison when it already is one.
_ND = np.ndarray


def _addr(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


# Unbound binding methods, called as fn(comm, ...): the synchronous path
# then builds no closure per call.
_C = _core.Comm
_NO = object()  # "no fifth argument" for ProcessGroup._call


# _counts(op, name, counts, P, size): a v-collective's count list, checked (P
# entries, none negative, their sum within the array's `size` elements), as a
# new list of ints.
_counts = _core.check_counts


def _barrier(comm: Any, _a: Any, _b: Any, _c: Any, ms: int) -> None:
    # The barrier binding in _call's form, whose last argument is the timeout.
    return _C.barrier(comm, ms)


def _dumps(obj: Any) -> bytes:
    # The object codec: bounded, documented in docs/rpc.md, never pickle.
    from ._wire.codec import dumps

    return dumps(obj)


def _loads(data: bytes) -> Any:
    from ._wire.codec import loads

    return loads(data)


def _encode(obj: Any) -> tuple:
    """(bytes of ``obj`` as uint8, None), or (the reason it cannot be encoded, the
    error): a rank that cannot encode its object still takes part in the exchange,
    so no other rank waits for it."""
    try:
        return np.frombuffer(_dumps(obj), dtype=np.uint8), None
    except Exception as exc:  # noqa: BLE001 - sent to every rank, then re-raised
        why = f"{type(exc).__name__}: {exc}".encode(errors="replace")[:2000]
        return np.frombuffer(why, dtype=np.uint8), exc


def _encode_failure(op: str, failed: dict, mine: Optional[BaseException]) -> BaseException:
    """The error every rank raises when ranks ``failed`` (rank -> reason) could not
    encode their objects: the same class (the first reason's TypeError, else
    ValueError) and message everywhere, chained to the codec's error where it rose."""
    reasons = {r: why.decode(errors="replace") for r, why in sorted(failed.items())}
    first = next(iter(reasons.values()))
    cls = TypeError if first.startswith("TypeError") else ValueError
    ranks = ", ".join(str(r) for r in reasons)
    detail = "; ".join(f"rank {r}: {why}" for r, why in reasons.items())
    err = cls(f"{op}: rank {ranks} could not encode its object, so nothing was exchanged "
              f"({detail})")
    err.__cause__ = mine
    return err


class ProcessGroup:
    """A group of ranks.  Created by ``ringlet.init`` (the world) or ``ringlet.new_group``.

    Attributes:
        rank: this process's rank in the group (-1 when not a member).
        size: number of ranks in the group.
        ranks: the world ranks of the members, in group-rank order.
    """

    def __init__(self, world: Any, comm_id: int, ranks: Sequence[int], rank: int,
                 coll: Any = None, p2p: Any = None, timeout: float = 300.0) -> None:
        self._world = world
        self.comm_id = comm_id
        self.ranks: List[int] = list(ranks)
        self.rank = rank
        self.size = len(self.ranks)
        self.timeout = timeout  # property: also caches the default in milliseconds
        self._coll = coll
        self._p2pc = p2p
        self._failure: Optional[BaseException] = None
        self._failed_peer: Optional[int] = None  # set by _cancel
        self._lock = threading.Lock()
        self._exec = SerialExecutor(f"ringlet-group{comm_id}")
        self._p2p_exec: dict = {}
        self._p2p_exec_lock = threading.Lock()
        self._ngroups = 0
        self._closed = False
        self._closed_by = "ringlet.shutdown()"  # named when a closed group is used
        # Set by World.make_group: the host layout, and the hierarchical plan
        # (None: every op runs flat; one attribute test on each op's path).
        self._topology: Any = None
        self._hier: Any = None

    def __repr__(self) -> str:
        return f"<ringlet.ProcessGroup id={self.comm_id} rank={self.rank} size={self.size}>"

    @property
    def topology(self) -> Any:
        """Which of this group's ranks share a host: a ``ringlet.Topology``.

        Example::

            t = group.topology
            t.num_hosts, t.ranks_per_host, t.local_rank
        """
        if self._topology is None:
            from ._hier import Topology

            ids = getattr(self._world, "host_ids", None) or []
            self._topology = Topology([ids[r] if r < len(ids) else "" for r in self.ranks],
                                      self.rank)
        return self._topology

    # ---- plumbing ----------------------------------------------------------
    def _usable(self) -> None:
        if self._closed:
            raise RingletError(f"the process group of world ranks {self.ranks} was closed by "
                               f"{self._closed_by} (world rank {self._world.rank})")
        if self.rank < 0:
            raise ValueError(f"this rank (world rank {self._world.rank}) is not a member of "
                             f"the group of world ranks {self.ranks}")

    @property
    def transport(self) -> Optional[str]:
        """What this group's collectives run over: ``"shm"`` (a shared-memory
        segment; its ranks share a host), ``"tcp"``, or None on a non-member
        or after shutdown.  Over shared memory, point-to-point messages in
        groups of more than 8 ranks still use TCP
        (docs/launching.md, ``RINGLET_TRANSPORT``)."""
        if self._coll is None or self._closed:
            return None
        return self._coll.transport

    @property
    def single_copy(self) -> Optional[int]:
        """Over shared memory, the block size in bytes from which large
        messages are copied straight from one rank's buffer into another's
        (``process_vm_readv``; docs/algorithms.md, "Single copy"); 0 when they
        are staged through the segment instead: ``RINGLET_SHM_CMA_BYTES=0``, or
        some rank of the group may not read its peers' memory (the kernel's
        ptrace rules; ``RINGLET_DEBUG=INFO`` logs which, docs/launching.md).
        None over TCP, on a non-member or after shutdown."""
        if self._coll is None or self._closed or self._coll.transport != "shm":
            return None
        return self._coll.single_copy[0]

    @property
    def timeout(self) -> float:
        """Default deadline in seconds of every operation of this group."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._default_ms = self._ms(value)
        self._timeout = value

    def _ms(self, timeout: Optional[float]) -> int:
        # Checked and capped in one place (ringlet._timeout): huge means "no deadline".
        return self._default_ms if timeout is None else _millis(timeout)

    def _raise_poisoned(self) -> None:
        raise GroupPoisonedError(
            f"rank {self.rank}: group {self.comm_id} is poisoned by an earlier failure "
            f"({self._failure}); call ringlet.shutdown() and ringlet.init() to recover",
            rank=self.rank) from self._failure

    def _guard(self, fn: Callable[[], Any], comm: Any = _NO) -> Any:
        if self._failure is not None:
            self._raise_poisoned()
        try:
            return fn()
        except BaseException as exc:
            self._fail(exc, self._coll if comm is _NO else comm)
            raise

    def _fail(self, exc: BaseException, comm: Any) -> None:
        """Record ``exc``, raised by an operation on ``comm`` (None: a hierarchical
        operation), unless it is a bad argument the binding refused before C ran:
        a ``TypeError``/``ValueError`` while the C communicator has no failure.
        Anything else (a ``RingletError``, ``KeyboardInterrupt``, an exception
        a signal handler raised, ``MemoryError``) ends the operation on this rank
        only, so the group is poisoned and the other ranks are told."""
        if comm is not None and isinstance(exc, (TypeError, ValueError)):
            try:
                if comm.error() is None:
                    return
            except RingletError:
                pass  # closed under the call: it failed
        self._record(exc)

    def _record(self, exc: BaseException) -> None:
        """Remember the first failure and tell the other ranks about it."""
        if isinstance(exc, RingletError) and exc.peer is None and self._failed_peer is not None:
            exc.peer = self._failed_peer  # stopped by that rank's published failure
        if not isinstance(exc, GroupPoisonedError) and self._failure is None:
            self._failure = exc
            if self._closed:
                # This rank's own shutdown ended the operation: nothing to publish
                # (its peers see the communicator close).
                return
            self._world._publish_failure(self, exc)
            _trace.on_failure(self._world, exc)

    def _call(self, op: str, async_op: bool, fn: Callable[..., Any], a: Any, b: Any, c: Any,
              d: Any, e: Any = _NO) -> Any:
        """Run the binding ``fn(self._coll, a, b, c, d[, e])`` in issue order.

        Returns its result, or a ``Work`` when ``async_op``.  Fixed arguments
        on the synchronous path: building and spreading argument tuples is a
        measurable share of a small op (docs/experiments.md).  The last
        argument is always the timeout in milliseconds.
        """
        if async_op or self._exec._busy or self._closed or self.rank < 0:
            args = (a, b, c, d) if e is _NO else (a, b, c, d, e)
            keep = tuple(x for x in args if isinstance(x, np.ndarray))
            return self._run_queued(op, fn, args, keep, async_op)
        lock = None
        if self._hier is not None:
            # Hierarchical ops run on the sub-groups' communicators under the
            # group's lock: flat ones take it too, so one op runs at a time.
            # Taken inline while uncontended: a small op pays for every layer.
            lock = self._lock
            if not lock.acquire(False):
                return self._locked(op, fn, (a, b, c, d) if e is _NO else (a, b, c, d, e),
                                    self._coll)
        # Without a plan no Python lock: the C communicator runs its collectives
        # one at a time (and gives a waiting thread its deadline).
        try:
            if self._failure is not None:
                self._raise_poisoned()
            try:
                if e is _NO:
                    return fn(self._coll, a, b, c, d)
                return fn(self._coll, a, b, c, d, e)
            except BaseException as exc:
                self._fail(exc, self._coll)
                raise
        finally:
            if lock is not None:
                lock.release()

    def _call_args(self, op: str, async_op: bool, fn: Callable[..., Any], args: tuple) -> Any:
        """``_call`` for the bindings of more arguments (the v-collectives')."""
        if async_op or self._exec._busy or self._closed or self.rank < 0:
            keep = tuple(x for x in args if isinstance(x, np.ndarray))
            return self._run_queued(op, fn, args, keep, async_op)
        if self._hier is not None:
            return self._locked(op, fn, args, self._coll)
        if self._failure is not None:
            self._raise_poisoned()
        try:
            return fn(self._coll, *args)
        except BaseException as exc:
            self._fail(exc, self._coll)
            raise

    def _run(self, op: str, fn: Callable[..., Any], args: tuple, keep: tuple,
             async_op: bool) -> Any:
        """``_call`` for hierarchical ops, whose phases (and first sub-group
        set-up) the group's lock keeps together."""
        if async_op or self._exec._busy or self._closed or self.rank < 0:
            return self._run_queued(op, fn, args, keep, async_op, comm=None)
        # Run here under the lock, never queued: async work another thread
        # queued meanwhile waits for this lock, so queueing behind it would
        # wait for itself.
        return self._locked(op, fn, args, None)

    def _locked(self, op: str, fn: Callable[..., Any], args: tuple, comm: Any) -> Any:
        """``fn(self._coll, *args)`` under the group's lock, synchronously.  The
        wait for the lock counts against the op's deadline (``args[-1]``, in
        milliseconds), as the C communicator's own wait does."""
        lock = self._lock
        if not lock.acquire(False):
            ms = args[-1]
            t0 = time.monotonic()
            try:
                got = lock.acquire(True, min(ms / 1000.0, threading.TIMEOUT_MAX))
            except BaseException as exc:  # Ctrl-C while waiting: the op is abandoned
                self._record(exc)
                raise
            if not got:
                exc = CollectiveTimeout(
                    f"rank {self.rank}: {op}: timed out after {ms / 1000.0:g}s waiting for "
                    f"this group's previous operation, still running in another thread",
                    rank=self.rank, op=op, waited=ms / 1000.0)
                self._record(exc)  # the other ranks would run the op this rank gave up
                raise exc
            left = max(1, ms - int((time.monotonic() - t0) * 1000))
            args = args[:-1] + (left,)
        try:
            if self._failure is not None:
                self._raise_poisoned()
            try:
                return fn(self._coll, *args)
            except BaseException as exc:
                self._fail(exc, comm)
                raise
        finally:
            lock.release()

    def _run_queued(self, op: str, fn: Callable[..., Any], args: tuple, keep: tuple,
                    async_op: bool, comm: Any = _NO) -> Any:
        """Queue ``fn(self._coll, *args)`` on the group's executor, under its lock.
        ``comm``: what ``_fail`` checks (None: a hierarchical op; default: the
        group's collective communicator)."""
        # busy: keep issue order behind queued async ops
        self._usable()

        def locked() -> Any:
            with self._lock:
                return self._guard(lambda: fn(self._coll, *args),
                                   self._coll if comm is _NO else comm)

        w = self._exec.submit(locked, Work(op, keep))
        return w if async_op else w.result()

    def _p2p_executor(self, kind: str, peer: int) -> SerialExecutor:
        with self._p2p_exec_lock:
            ex = self._p2p_exec.get((kind, peer))
            if ex is None:
                ex = self._p2p_exec[(kind, peer)] = SerialExecutor(
                    f"ringlet-group{self.comm_id}-{kind}{peer}")
            return ex

    def _peer(self, r: Any, what: str) -> int:
        if type(r) is int and 0 <= r < self.size:  # the common case, checked cheaply
            return r
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
            raise TypeError(f"{what} must be an int rank, got {type(r).__name__}")
        r = int(r)
        if not 0 <= r < self.size:
            raise ValueError(f"{what}={r} is out of range for a group of size {self.size}")
        return r

    # ---- collectives -------------------------------------------------------
    def all_reduce(self, array: np.ndarray, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False, timeout: Optional[float] = None):
        """Reduce ``array`` over the group in place; every rank gets the result.

        Args:
            array: C-contiguous, writable numpy array, same shape and dtype everywhere;
                or a CPU torch tensor, a DLPack or buffer-protocol object, reduced
                in place through a numpy view of its memory (every op takes these).
            op: a ``ReduceOp`` (AVG: floating dtypes; BAND/BOR/BXOR: integers and bool).
        Returns:
            None, or a ``Work`` when ``async_op``.
        Raises:
            TypeError/ValueError on bad arguments; a ``RingletError`` subclass on failure.

        Example::

            g = np.full(4, ringlet.get_rank(), np.float32)
            ringlet.all_reduce(g)  # every rank: sum of all ranks
        """
        if type(array) is not _ND:
            array = _as_array(array, "array", True)
        code = _acode(array, "array", True, dtype_code)
        op = 0 if op is _SUM else check_op(op, code, array.dtype)
        ms = self._default_ms if timeout is None else self._ms(timeout)
        h = self._hier
        if h is not None and array.nbytes >= h.floor_all_reduce \
                and h.use("all_reduce", array.nbytes, array.size):
            return self._run("all_reduce", h.all_reduce, (array, code, op, ms), (array,),
                             async_op)
        return self._call("all_reduce", async_op, _C.all_reduce, array, code, op, ms)

    def broadcast(self, array: np.ndarray, src: int = 0, *, async_op: bool = False,
                  timeout: Optional[float] = None):
        """Copy ``array`` from group rank ``src`` into ``array`` on every rank."""
        if type(array) is not _ND:
            array = _as_array(array, "array", True)
        code = _acode(array, "array", True, dtype_code)
        if type(src) is not int or not 0 <= src < self.size:
            src = self._peer(src, "src")
        ms = self._default_ms if timeout is None else self._ms(timeout)
        h = self._hier
        if h is not None and array.nbytes >= h.floor_broadcast \
                and h.use("broadcast", array.nbytes, array.size, src):
            return self._run("broadcast", h.broadcast, (array, code, src, ms), (array,),
                             async_op)
        return self._call("broadcast", async_op, _C.broadcast, array, code, src, ms)

    def reduce(self, array: np.ndarray, dst: int = 0, op: ReduceOp = ReduceOp.SUM, *,
               async_op: bool = False, timeout: Optional[float] = None):
        """Reduce ``array`` over the group into ``array`` on rank ``dst`` (others unchanged)."""
        if type(array) is not _ND:
            array = _as_array(array, "array", True)
        code = _acode(array, "array", True, dtype_code)
        op = 0 if op is _SUM else check_op(op, code, array.dtype)
        if type(dst) is not int or not 0 <= dst < self.size:
            dst = self._peer(dst, "dst")
        ms = self._default_ms if timeout is None else self._ms(timeout)
        h = self._hier
        if h is not None and array.nbytes >= h.floor_reduce \
                and h.use("reduce", array.nbytes, array.size, dst):
            return self._run("reduce", h.reduce, (array, code, op, dst, ms), (array,), async_op)
        return self._call("reduce", async_op, _C.reduce, array, code, op, dst, ms)

    def all_gather(self, output: np.ndarray, input: np.ndarray, *, async_op: bool = False,
                   timeout: Optional[float] = None):
        """Concatenate every rank's ``input`` into ``output`` (size × input.size), rank order."""
        if type(output) is not _ND:
            output = _as_array(output, "output", True)
        if type(input) is not _ND:
            input = _as_array(input, "input", False)
        code = _pair(output, input, "all_gather", self.size, _GATHER, False, dtype_code)
        o, i = output, input
        ms = self._default_ms if timeout is None else self._ms(timeout)
        h = self._hier
        if h is not None and o.nbytes >= h.floor_all_gather \
                and h.use("all_gather", o.nbytes, i.size):
            return self._run("all_gather", h.all_gather, (o, i, code, ms), (o, i), async_op)
        return self._call("all_gather", async_op, _C.all_gather, o, i, code, ms)

    def all_gather_v(self, output: np.ndarray, output_counts: Sequence[int], input: np.ndarray,
                     *, async_op: bool = False, timeout: Optional[float] = None):
        """Concatenate every rank's ``input`` into ``output`` in rank order, rank r
        contributing ``output_counts[r]`` elements (uneven blocks: MPI's Allgatherv).

        ``input`` holds this rank's ``output_counts[rank]`` elements; it may be this
        rank's block of ``output`` (in place) and overlap no other part of it.  Runs
        over the group's shared-memory segment where it has one, else the pairwise
        exchange over TCP (docs/algorithms.md).

        Example::

            n = ringlet.get_rank() + 1                  # rank r sends r + 1 values
            out = np.empty(sum(range(1, P + 1)), np.float32)
            ringlet.all_gather_v(out, list(range(1, P + 1)), np.full(n, n, np.float32))
        """
        if type(output) is not _ND:
            output = _as_array(output, "output", True)
        if type(input) is not _ND:
            input = _as_array(input, "input", False)
        i = _array(input, "input", False)
        code = _acode(output, "output", True, dtype_code)
        o = output
        if o.dtype != i.dtype:
            raise TypeError(f"all_gather_v: output dtype {o.dtype} differs from input dtype "
                            f"{i.dtype}")
        counts = _counts("all_gather_v", "output_counts", output_counts, self.size, o.size)
        r = self.rank
        if r >= 0 and counts[r] != i.size:
            raise ValueError(f"all_gather_v: output_counts[{r}] (this rank's) is {counts[r]} "
                             f"but the input has {i.size} elements")
        if r >= 0 and _overlap(o, i) and _addr(i) != _addr(o) + sum(counts[:r]) * o.itemsize:
            raise ValueError("all_gather_v: the input overlaps the output other than as this "
                             "rank's block (the in-place form)")
        ms = self._default_ms if timeout is None else self._ms(timeout)
        return self._call("all_gather", async_op, _C.all_gather_v, o, counts, i, code, ms)

    def reduce_scatter(self, output: np.ndarray, input: np.ndarray,
                       op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False,
                       timeout: Optional[float] = None):
        """Reduce ``input`` (size × output.size) over ranks; rank r gets block r in ``output``."""
        if type(output) is not _ND:
            output = _as_array(output, "output", True)
        if type(input) is not _ND:
            input = _as_array(input, "input", False)
        code = _pair(output, input, "reduce_scatter", self.size, _SCATTER, True, dtype_code)
        o, i = output, input
        op = 0 if op is _SUM else check_op(op, code, o.dtype)
        ms = self._default_ms if timeout is None else self._ms(timeout)
        h = self._hier
        if h is not None and i.nbytes >= h.floor_reduce_scatter \
                and h.use("reduce_scatter", i.nbytes, o.size):
            return self._run("reduce_scatter", h.reduce_scatter, (o, i, code, op, ms), (o, i),
                             async_op)
        return self._call("reduce_scatter", async_op, _C.reduce_scatter, o, i, code, op, ms)

    def all_to_all(self, output: np.ndarray, input: np.ndarray, *, async_op: bool = False,
                   timeout: Optional[float] = None):
        """Rank r sends block j of ``input`` to rank j, which stores it as block r of ``output``."""
        if type(output) is not _ND:
            output = _as_array(output, "output", True)
        if type(input) is not _ND:
            input = _as_array(input, "input", False)
        code = _pair(output, input, "all_to_all", self.size, _EQUAL, True, dtype_code)
        ms = self._default_ms if timeout is None else self._ms(timeout)
        return self._call("all_to_all", async_op, _C.all_to_all, output, input, code, ms)

    def all_to_all_v(self, output: np.ndarray, output_counts: Sequence[int], input: np.ndarray,
                     input_counts: Sequence[int], *, async_op: bool = False,
                     timeout: Optional[float] = None):
        """All-to-all with per-rank element counts (blocks laid out back to back, rank order).

        Rank s sends ``input_counts[d]`` elements to rank d, which expects
        ``output_counts[s]`` from it; a pair that disagrees fails as a ``DesyncError``
        naming both sizes.  Runs over the group's shared-memory segment where it has one,
        else the pairwise exchange over TCP (docs/algorithms.md)."""
        if self._closed or self.rank < 0:
            self._usable()  # before the checks below index the counts by this rank
        if type(output) is not _ND:
            output = _as_array(output, "output", True)
        if type(input) is not _ND:
            input = _as_array(input, "input", False)
        i = _array(input, "input", False)
        code = _acode(output, "output", True, dtype_code)
        o = output
        if o.dtype != i.dtype:
            raise TypeError(f"all_to_all: output dtype {o.dtype} differs from input dtype {i.dtype}")
        oc = _counts("all_to_all_v", "output_counts", output_counts, self.size, o.size)
        ic = _counts("all_to_all_v", "input_counts", input_counts, self.size, i.size)
        if oc[self.rank] != ic[self.rank]:
            raise ValueError(f"all_to_all_v: this rank sends itself {ic[self.rank]} elements "
                             f"but expects {oc[self.rank]}")
        if _overlap(o, i):
            raise ValueError("all_to_all: output must not overlap input")
        ms = self._default_ms if timeout is None else self._ms(timeout)
        return self._call_args("all_to_all", async_op, _C.all_to_all_v, (o, oc, i, ic, code, ms))

    def gather(self, output: Optional[np.ndarray], input: np.ndarray, dst: int = 0, *,
               async_op: bool = False, timeout: Optional[float] = None):
        """Collect every rank's ``input`` into ``output`` on ``dst`` (output may be None elsewhere)."""
        if output is not None and type(output) is not _ND:
            output = _as_array(output, "output", True)
        if type(input) is not _ND:
            input = _as_array(input, "input", False)
        if type(dst) is not int or not 0 <= dst < self.size:
            dst = self._peer(dst, "dst")
        o = None
        if self.rank == dst:
            if output is None:
                raise ValueError(f"gather: the destination rank {dst} needs an output array")
            o = output
            code = _pair(o, input, "gather", self.size, _GATHER, False, dtype_code)
        else:
            code = _acode(input, "input", False, dtype_code)
        ms = self._default_ms if timeout is None else self._ms(timeout)
        return self._call("gather", async_op, _C.gather, o, input, code, dst, ms)

    def scatter(self, output: np.ndarray, input: Optional[np.ndarray], src: int = 0, *,
                async_op: bool = False, timeout: Optional[float] = None):
        """Rank ``src`` sends block r of ``input`` to rank r's ``output`` (input may be None elsewhere)."""
        if type(output) is not _ND:
            output = _as_array(output, "output", True)
        if input is not None and type(input) is not _ND:
            input = _as_array(input, "input", False)
        o = output
        if type(src) is not int or not 0 <= src < self.size:
            src = self._peer(src, "src")
        i = None
        if self.rank == src:
            if input is None:
                raise ValueError(f"scatter: the source rank {src} needs an input array")
            i = input
            code = _pair(o, i, "scatter", self.size, _SCATTER, False, dtype_code)
            # The root copies its own block before sending the others, so an
            # output overlapping any other block would corrupt what is sent.
            if _overlap(o, i) and _addr(o) != _addr(i) + src * o.nbytes:
                raise ValueError(f"scatter: the root's output overlaps its input other than "
                                 f"as input block {src} (the in-place form); it would send "
                                 f"overwritten data")
        else:
            code = _acode(o, "output", True, dtype_code)
        ms = self._default_ms if timeout is None else self._ms(timeout)
        return self._call("scatter", async_op, _C.scatter, o, i, code, src, ms)

    def gather_v(self, output: Optional[np.ndarray], output_counts: Optional[Sequence[int]],
                 input: np.ndarray, dst: int = 0, *, async_op: bool = False,
                 timeout: Optional[float] = None):
        """Collect every rank's ``input`` into ``output`` on ``dst`` in rank order, rank r
        contributing ``output_counts[r]`` elements (uneven blocks: MPI's Gatherv).

        ``output`` and ``output_counts`` are read on ``dst`` only (None elsewhere); a rank
        whose ``input`` size differs from the root's count for it fails as a
        ``DesyncError`` naming both sizes.  On ``dst``, ``input`` may be its own block of
        ``output`` (in place).  Over the group's shared-memory segment where it has one,
        else direct over TCP (docs/algorithms.md).

        Example::

            r = ringlet.get_rank()                       # rank r sends r + 1 values
            counts = [q + 1 for q in range(P)]
            out = np.empty(sum(counts), np.float32) if r == 0 else None
            ringlet.gather_v(out, counts if r == 0 else None, np.full(r + 1, r, np.float32))
        """
        if type(input) is not _ND:
            input = _as_array(input, "input", False)
        if type(dst) is not int or not 0 <= dst < self.size:
            dst = self._peer(dst, "dst")
        i = _array(input, "input", False)
        code = _acode(i, "input", False, dtype_code)
        o = counts = None
        if self.rank == dst:
            if output is None or output_counts is None:
                raise ValueError(f"gather_v: the destination rank {dst} needs an output array "
                                 f"and output_counts")
            o = output if type(output) is _ND else _as_array(output, "output", True)
            _acode(o, "output", True, dtype_code)
            if o.dtype != i.dtype:
                raise TypeError(f"gather_v: output dtype {o.dtype} differs from input dtype "
                                f"{i.dtype}")
            counts = _counts("gather_v", "output_counts", output_counts, self.size, o.size)
            if counts[dst] != i.size:
                raise ValueError(f"gather_v: output_counts[{dst}] (the root's) is "
                                 f"{counts[dst]} but its input has {i.size} elements")
            if _overlap(o, i) and _addr(i) != _addr(o) + sum(counts[:dst]) * o.itemsize:
                raise ValueError("gather_v: the root's input overlaps its output other than "
                                 "as its own block (the in-place form)")
        ms = self._default_ms if timeout is None else self._ms(timeout)
        return self._call_args("gather", async_op, _C.rooted_v, (True, o, counts, i, code, dst, ms))

    def scatter_v(self, output: np.ndarray, input: Optional[np.ndarray],
                  input_counts: Optional[Sequence[int]], src: int = 0, *,
                  async_op: bool = False, timeout: Optional[float] = None):
        """Rank ``src`` sends ``input_counts[r]`` elements of ``input`` (blocks in rank
        order) to rank r's ``output`` (uneven blocks: MPI's Scatterv).

        ``input`` and ``input_counts`` are read on ``src`` only (None elsewhere); a rank
        whose ``output`` size differs from the root's count for it fails as a
        ``DesyncError`` naming both sizes.  On ``src``, ``output`` may be its own block of
        ``input`` (in place).  Over the group's shared-memory segment where it has one,
        else direct over TCP (docs/algorithms.md).

        Example::

            r = ringlet.get_rank()                       # rank r gets r + 1 values
            counts = [q + 1 for q in range(P)]
            data = np.arange(sum(counts), dtype=np.float32) if r == 0 else None
            ringlet.scatter_v(np.empty(r + 1, np.float32), data, counts if r == 0 else None)
        """
        if type(output) is not _ND:
            output = _as_array(output, "output", True)
        if type(src) is not int or not 0 <= src < self.size:
            src = self._peer(src, "src")
        o = output
        code = _acode(o, "output", True, dtype_code)
        i = counts = None
        if self.rank == src:
            if input is None or input_counts is None:
                raise ValueError(f"scatter_v: the source rank {src} needs an input array and "
                                 f"input_counts")
            i = input if type(input) is _ND else _as_array(input, "input", False)
            i = _array(i, "input", False)
            if o.dtype != i.dtype:
                raise TypeError(f"scatter_v: output dtype {o.dtype} differs from input dtype "
                                f"{i.dtype}")
            counts = _counts("scatter_v", "input_counts", input_counts, self.size, i.size)
            if counts[src] != o.size:
                raise ValueError(f"scatter_v: input_counts[{src}] (the root's) is "
                                 f"{counts[src]} but its output has {o.size} elements")
            # The root copies its own block while it sends the others, so an output
            # overlapping any other block would corrupt what is sent.
            if _overlap(o, i) and _addr(o) != _addr(i) + sum(counts[:src]) * i.itemsize:
                raise ValueError("scatter_v: the root's output overlaps its input other than "
                                 "as its own block (the in-place form)")
        ms = self._default_ms if timeout is None else self._ms(timeout)
        return self._call_args("scatter", async_op, _C.rooted_v, (False, i, counts, o, code, src, ms))

    def barrier(self, *, async_op: bool = False, timeout: Optional[float] = None):
        """Return once every rank of the group has entered the barrier."""
        if async_op or timeout is not None or self._exec._busy or self._closed or self.rank < 0 \
                or self._hier is not None:
            ms = self._default_ms if timeout is None else _millis(timeout)
            return self._call("barrier", async_op, _barrier, None, None, None, ms)
        # _call's synchronous path inlined: a barrier moves no data, and its
        # Python layers were most of its time (docs/experiments.md).
        if self._failure is not None:
            self._raise_poisoned()
        try:
            return _C.barrier(self._coll, self._default_ms, None, None, None)
        except BaseException as exc:
            self._fail(exc, self._coll)
            raise

    # ---- point to point -----------------------------------------------------
    def _p2p(self, fn: Callable[..., Any], kind: str, array: Any, peer: Any, tag: Any,
             timeout: Optional[float], async_op: bool, what: str) -> Any:
        if type(array) is not _ND:
            array = _as_array(array, "array", kind == "recv")
        code = _acode(array, "array", kind == "recv", dtype_code)
        a = array
        if peer is None and kind == "recv":
            # Any source: its own queue, beside those of the named sources.
            if self.size < 2:
                raise ValueError("recv from any source needs a group of at least 2 ranks")
            fn, peer = _C.recv_any, -1
        elif type(peer) is not int or not 0 <= peer < self.size or peer == self.rank:
            peer = self._peer(peer, what)
            if peer == self.rank:
                raise ValueError(f"{what}={peer} is this rank; a rank cannot message itself")
        if type(tag) is not int or not 0 <= tag <= _MAX_TAG:
            if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) \
                    or not 0 <= tag <= _MAX_TAG:
                raise ValueError(f"tag must be an int in [0, 2**32), got {tag!r}")
            tag = int(tag)
        ms = self._default_ms if timeout is None else self._ms(timeout)
        if self._closed or self.rank < 0:
            self._usable()
        # A synchronous call needs the executor only when async work for this
        # (kind, peer) is still queued, to keep issue order; it never creates one.
        ex = self._p2p_exec.get((kind, peer)) if self._p2p_exec else None
        if async_op or (ex is not None and ex._busy):
            if ex is None:
                ex = self._p2p_executor(kind, peer)
            args = (a, code, peer, tag, ms)
            w = ex.submit(lambda: self._guard(lambda: fn(self._p2pc, *args), self._p2pc),
                          Work(kind, (a,)))
            return w if async_op else w.result()
        if self._failure is not None:
            self._raise_poisoned()
        try:
            return fn(self._p2pc, a, code, peer, tag, ms)
        except BaseException as exc:
            self._fail(exc, self._p2pc)
            raise

    def send(self, array: np.ndarray, dst: int, tag: int = 0, *,
             timeout: Optional[float] = None) -> None:
        """Send ``array`` to group rank ``dst``; matched by the receiver on (source, tag)."""
        self._p2p(_C.send, "send", array, dst, tag, timeout, False, "dst")

    def recv(self, array: np.ndarray, src: Optional[int] = None, tag: int = 0, *,
             timeout: Optional[float] = None) -> int:
        """Receive into ``array`` the next message from ``src`` carrying ``tag``.

        ``src=None`` takes the first message carrying ``tag`` from any rank
        of the group (per sender still in send order).  Returns the sender's
        group rank.  Size and dtype must match the sender's (else
        ``DesyncError``)."""
        return self._p2p(_C.recv, "recv", array, src, tag, timeout, False, "src")

    def isend(self, array: np.ndarray, dst: int, tag: int = 0, *,
              timeout: Optional[float] = None) -> Work:
        """Asynchronous ``send``; the ``Work`` keeps ``array`` alive until sent."""
        return self._p2p(_C.send, "send", array, dst, tag, timeout, True, "dst")

    def irecv(self, array: np.ndarray, src: Optional[int] = None, tag: int = 0, *,
              timeout: Optional[float] = None) -> Work:
        """Asynchronous ``recv``; the ``Work``'s ``result()`` is the sender's group rank."""
        return self._p2p(_C.recv, "recv", array, src, tag, timeout, True, "src")

    # ---- small Python objects ----------------------------------------------
    def broadcast_object(self, obj: Any = None, src: int = 0, *,
                         timeout: Optional[float] = None) -> Any:
        """Send a small Python object from ``src`` to every rank; returns it everywhere.

        Objects travel in ringlet's bounded binary format (no pickle; see
        docs/rpc.md): None, bool, int, float, str, bytes, list, tuple, dict and
        numpy arrays.

        Raises:
            TypeError/ValueError: on every rank when ``src`` cannot encode ``obj``
                (the message names ``src`` and the codec's reason); the group stays
                usable.
        """
        src = self._peer(src, "src")
        bad: Optional[BaseException] = None
        if self.rank == src:
            payload, bad = _encode(obj)
            # A negative length says "no object": -1 - n bytes of the reason follow.
            n = np.array([payload.size if bad is None else -1 - payload.size], dtype=np.int64)
        else:
            n = np.zeros(1, dtype=np.int64)
        self.broadcast(n, src, timeout=timeout)
        size = int(n[0])
        if self.rank != src:
            payload = np.empty(size if size >= 0 else -1 - size, dtype=np.uint8)
        else:
            payload = payload.copy()
        self.broadcast(payload, src, timeout=timeout)
        if size < 0:
            raise _encode_failure("broadcast_object", {src: payload.tobytes()}, bad)
        return obj if self.rank == src else _loads(payload.tobytes())

    def all_gather_object(self, obj: Any, *, timeout: Optional[float] = None) -> list:
        """Gather a small Python object from every rank; returns the list in rank order.

        Raises:
            TypeError/ValueError: on every rank when some rank cannot encode its
                object (the message names those ranks); the group stays usable.
        """
        mine, bad = _encode(obj)
        sizes = np.zeros(self.size, dtype=np.int64)
        self.all_gather(sizes, np.array([mine.size if bad is None else -1 - mine.size],
                                        dtype=np.int64), timeout=timeout)
        lens = np.where(sizes < 0, -1 - sizes, sizes)
        width = int(lens.max()) if self.size else 0
        padded = np.zeros(width, dtype=np.uint8)
        padded[: mine.size] = mine
        out = np.empty(width * self.size, dtype=np.uint8)
        self.all_gather(out, padded, timeout=timeout)
        failed = {r: out[r * width: r * width + int(lens[r])].tobytes()
                  for r in range(self.size) if sizes[r] < 0}
        if failed:
            raise _encode_failure("all_gather_object", failed, bad)
        return [_loads(out[r * width: r * width + int(sizes[r])].tobytes())
                for r in range(self.size)]

    # ---- lifecycle -----------------------------------------------------------
    def _executors(self) -> list:
        return [self._exec, *list(self._p2p_exec.values())]

    def _drain(self, timeout: float) -> bool:
        """Wait for queued async work; True when every executor is idle."""
        deadline = time.monotonic() + timeout
        return all(ex.drain(max(0.0, deadline - time.monotonic())) for ex in self._executors())

    def _cancel(self, status: int, reason: str, failed: Optional[int] = None) -> None:
        """Poison and wake this group's calls; ``failed``: the world rank whose
        published failure this is, the ``peer`` of the errors it causes here."""
        if failed is not None and failed in self.ranks and self._failed_peer is None:
            self._failed_peer = self.ranks.index(failed)
        for comm in (self._coll, self._p2pc):
            if comm is not None:
                try:
                    comm.cancel(status, reason)
                except RingletError:
                    pass

    def close(self) -> None:
        """Release this rank's handle on a group made by ``new_group``: its
        connections, shared-memory segment and threads, and those of the intra- and
        inter-host sub-groups its hierarchical collectives made.

        Local, not collective: call it on every member once no rank will use
        the group again (after a barrier on it, when a peer may still be in an
        operation).  Work still pending on this rank is cancelled and fails.
        Calling it again does nothing; ``ringlet.shutdown()`` closes every group.
        Afterwards every operation on the group raises ``RingletError``.

        Raises:
            ValueError: on the world group (``ringlet.shutdown()`` ends it).

        Example::

            tp = ringlet.new_group([0, 1])
            ...
            tp.barrier()
            tp.close()
        """
        if self._closed:
            return
        if self is self._world.group:
            raise ValueError("ProcessGroup.close: this is the world group; "
                             "ringlet.shutdown() ends it")
        self._closed_by = "ProcessGroup.close()"
        self._close()
        self._world._groups.discard(self)

    def _close(self) -> None:
        self._closed = True
        h = self._hier  # its intra- and inter-host sub-groups close with this group
        if not self._drain(0.0):
            # Work still blocked in C (an irecv nobody answers, say): wake it
            # with a cancel, and give it a moment to finish.
            reason = f"rank {self.rank}: the group was shut down with work pending"
            self._cancel(3, reason)
            if h is not None:
                h.cancel(3, reason)  # a hierarchical op blocked in a sub-group's phase
            self._drain(5.0)
        for ex in self._executors():
            ex.close()
        # A thread still inside C on a communicator (work past the drain, or a
        # synchronous op of another thread, which no executor sees) is woken by
        # close() with an error, and the last such thread frees the communicator
        # (and the context it uses) on its way out: Comm.close, Context.close.
        for comm in (self._coll, self._p2pc):
            if comm is not None:
                comm.close()
        self._coll = self._p2pc = None
        if h is not None:
            h.close()
