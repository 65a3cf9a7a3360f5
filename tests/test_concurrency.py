"""Several async operations in flight, on one group and on two groups at once."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import ringlet
from ringlet import ReduceOp, _world
from ringlet.errors import RingletError
from ringlet.testing import run_world

from _blocked import blocked_in_poll, wait_until_blocked
from _oracle import data, reduce_np, same


def _many_async(rank, P):
    sizes = [1, 1000, 100_003, 7, 300_000]
    arrs = [np.full(n, rank + i, np.float32) for i, n in enumerate(sizes)]
    works = [ringlet.all_reduce(a, async_op=True) for a in arrs]
    out = np.empty(P * 10, np.int64)
    works.append(ringlet.all_gather(out, np.full(10, rank, np.int64), async_op=True))
    b = np.full(50_000, rank, np.float64)
    works.append(ringlet.broadcast(b, src=P - 1, async_op=True))
    ringlet.barrier()  # a sync op issued behind the async ones runs after them
    assert all(w.is_completed() for w in works)
    for w in works:
        w.wait(timeout=30)
    ok = all(np.all(a == sum(r + i for r in range(P))) for i, a in enumerate(arrs))
    ok &= bool(np.array_equal(out, np.repeat(np.arange(P), 10)))
    ok &= bool(np.all(b == P - 1))
    return ok


def test_many_async_ops_one_group():
    assert all(run_world(_many_async, 4, mode="thread", timeout=120))


def _two_groups(rank, P):
    evens = ringlet.new_group([r for r in range(P) if r % 2 == 0])
    odds = ringlet.new_group([r for r in range(P) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    x = np.full(200_001, rank, np.float32)
    y = np.full(1000, rank, np.int32)
    w1 = ringlet.all_reduce(x, async_op=True, group=mine)
    w2 = ringlet.all_reduce(y, ReduceOp.MAX, async_op=True)  # world, at the same time
    z = np.full(77, rank, np.float64)
    w3 = mine.all_reduce(z, async_op=True)
    for w in (w1, w2, w3):
        w.wait()
    members = mine.ranks
    return (bool(np.all(x == sum(members))) and bool(np.all(y == P - 1))
            and bool(np.all(z == sum(members))) and mine.size == len(members)
            and (evens.rank == -1) == (rank % 2 == 1))


def test_async_on_two_groups_at_once():
    assert all(run_world(_two_groups, 4, mode="thread", timeout=120))


def _p2p_exchange(rank, P):
    # Both sides send a large message before receiving: isend/irecv must not deadlock.
    peer = 1 - rank
    big = np.full(8 << 20, rank, np.uint8)
    got = np.empty_like(big)
    ws = ringlet.isend(big, peer, tag=5)
    wr = ringlet.irecv(got, peer, tag=5)
    ws.wait()
    wr.wait()
    return bool(np.all(got == peer))


def test_isend_irecv_exchange_of_large_messages():
    assert all(run_world(_p2p_exchange, 2, mode="thread", timeout=60))


def _gil_free(rank, P, go):
    # A thread of rank 0 blocks in recv; once the kernel shows it sitting in
    # poll, this thread must still run Python (it cannot if the call holds
    # the GIL: then it runs only after the recv has timed out).  Only then is
    # rank 1 told to send.
    if rank == 1:
        assert go.wait(60), "rank 0 never released rank 1"
        ringlet.send(np.arange(8, dtype=np.float32), 0, tag=3)
        return True
    got = np.zeros(8, np.float32)
    world = _world._require(None)  # the rank's world, which a new thread does not inherit
    t = threading.Thread(target=world.recv, args=(got, 1, 3), kwargs=dict(timeout=20))
    t.start()
    blocked = wait_until_blocked(t.native_id)
    n = 0
    for _ in range(100_000):  # bytecode: needs the GIL
        n += 1
    still_waiting = t.is_alive()
    go.set()
    t.join(60)
    return blocked and n == 100_000 and still_waiting and \
        bool(np.array_equal(got, np.arange(8, dtype=np.float32)))


def test_python_runs_while_a_blocking_call_waits():
    go = threading.Event()
    assert run_world(_gil_free, 2, mode="thread", timeout=90, args=(go,)) == [True, True]


def _waiting(tid: int) -> bool:
    # In a ringlet wait, or sleeping between tries of the communicator's lock
    # (nanosleep / clock_nanosleep on x86-64).
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            nr = f.read().split()[0]
    except (OSError, IndexError):
        return False
    return nr in ("35", "230") or blocked_in_poll(tid)


def _two_threads_one_group(rank, P, go):
    # Rank 0 issues two collectives on one group from two threads, the second
    # while the first waits for rank 1; rank 1 issues them in that order from
    # one thread.  The second must wait for the first (the C communicator runs
    # its collectives one at a time), so both ranks pair them alike.
    g = _world._require(None)
    a = np.full(100_000, rank + 1, np.float32)
    b = np.full(10, 10 * (rank + 1), np.float64)
    if rank == 1:
        assert go.wait(60), "rank 0 never released rank 1"
        g.all_reduce(a)
        g.all_reduce(b)
    else:
        first = threading.Thread(target=g.all_reduce, args=(a,), kwargs=dict(timeout=60))
        first.start()
        assert wait_until_blocked(first.native_id), "the first op never blocked"
        second = threading.Thread(target=g.all_reduce, args=(b,), kwargs=dict(timeout=60))
        second.start()
        deadline = time.monotonic() + 30
        while not _waiting(second.native_id) and time.monotonic() < deadline:
            time.sleep(0.001)
        go.set()
        first.join(60)
        second.join(60)
    return bool(np.all(a == 3)) and bool(np.all(b == 30))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_collectives_from_two_threads_on_one_group_run_one_at_a_time(monkeypatch, transport):
    monkeypatch.setenv("RINGLET_TRANSPORT", transport)
    go = threading.Event()
    assert run_world(_two_threads_one_group, 2, mode="thread", timeout=120,
                     args=(go,)) == [True, True]


def _lock_deadline(rank, P, go):
    g = _world._require(None)
    a = np.ones(1000, np.float32)
    if rank == 1:
        assert go.wait(60), "rank 0 never released rank 1"
        try:
            # The all_reduce may still complete (rank 0's first op had
            # published its input before the abort); the barrier cannot.
            g.all_reduce(a, timeout=30)
            g.barrier(timeout=30)
        except RingletError as exc:
            return type(exc).__name__
        return "completed"
    first = threading.Thread(target=lambda: pytest.raises(RingletError, g.all_reduce, a,
                                                          timeout=60))
    first.start()
    assert wait_until_blocked(first.native_id), "the first op never blocked"
    t0 = time.monotonic()
    try:
        g.barrier(timeout=0.5)
        out = ("completed", 0.0, "")
    except RingletError as exc:
        out = (type(exc).__name__, time.monotonic() - t0, str(exc))
    go.set()
    first.join(60)
    return out


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_collective_waiting_for_another_threads_op_gets_its_deadline(monkeypatch, transport):
    monkeypatch.setenv("RINGLET_TRANSPORT", transport)
    go = threading.Event()
    res = run_world(_lock_deadline, 2, mode="thread", timeout=120, args=(go,))
    kind, took, msg = res[0]
    assert kind == "CollectiveTimeout", res[0]
    assert took >= 0.5 and "still running in another thread" in msg, res[0]
    assert "barrier" in msg, msg
    # The comm is aborted: the peer fails instead of running rank 0's barrier alone.
    assert res[1] != "completed", res[1]


def _pending_irecv_at_shutdown(rank, P):
    # An irecv nobody will answer must not block shutdown for long or crash it.
    w = ringlet.irecv(np.empty(4, np.float32), (rank + 1) % P, tag=99, timeout=300)
    return w


def test_shutdown_with_unanswered_irecv_is_bounded_and_safe():
    import time

    t0 = time.monotonic()
    works = run_world(_pending_irecv_at_shutdown, 2, mode="thread", timeout=60)
    took = time.monotonic() - t0
    assert took < 30, took
    for w in works:
        assert w.is_completed() and w.exception() is not None


def _keeps(rank, P):
    from ringlet._world import _require

    g = _require(None)
    seen = []
    queued = g._run_queued

    def spy(op, fn, args, keep, async_op):
        seen.append((op, keep))
        return queued(op, fn, args, keep, async_op)

    g._run_queued = spy
    a = np.full(8, rank, np.float32)
    out, inp = np.empty(P * 2, np.float32), np.full(2, rank, np.float32)
    ringlet.all_reduce(a, async_op=True).wait(timeout=30)
    gout = out if rank == 0 else None
    ringlet.gather(gout, inp, dst=0, async_op=True).wait(timeout=30)
    ringlet.barrier(async_op=True).wait(timeout=30)
    del g._run_queued
    # The Work of an async op keeps exactly the op's arrays alive (None is no array).
    ids = [(op, [id(x) for x in keep]) for op, keep in seen]
    want = [("all_reduce", [id(a)]),
            ("gather", [id(out), id(inp)] if rank == 0 else [id(inp)]),
            ("barrier", [])]
    return ids == want and bool(np.all(a == sum(range(P))))


def test_async_work_keeps_exactly_the_ops_arrays():
    assert all(run_world(_keeps, 2, mode="thread", timeout=60))


# ---- stress: 1,000 mixed operations ----------------------------------------------
def _stress(rank, P, n_ops):
    # Every rank draws the same schedule; about a third of the ops are async
    # and are waited for in batches, so several are in flight at once.
    sched = np.random.default_rng(2024)
    kinds = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "all_to_all",
             "barrier", "ring"]
    checks, pending, bad = [], [], []
    for i in range(n_ops):
        kind = kinds[sched.integers(len(kinds))]
        n = int(sched.choice([0, 1, 7, 1000, 50_003]))
        dt = np.dtype([np.float32, np.int32, np.float64][sched.integers(3)])
        root = int(sched.integers(P))
        async_op = bool(sched.random() < 0.35)
        ins = [data(r, n, dt, salt=i) for r in range(P)]
        if kind == "all_reduce":
            x = ins[rank].copy()
            w = ringlet.all_reduce(x, async_op=async_op)
            checks.append((i, kind, x, reduce_np(ins, ReduceOp.SUM, dt)))
        elif kind == "broadcast":
            x = ins[rank].copy()
            w = ringlet.broadcast(x, src=root, async_op=async_op)
            checks.append((i, kind, x, ins[root]))
        elif kind == "reduce":
            x = ins[rank].copy()
            w = ringlet.reduce(x, dst=root, op=ReduceOp.MAX, async_op=async_op)
            checks.append((i, kind, x, reduce_np(ins, ReduceOp.MAX, dt) if rank == root
                           else ins[rank]))
        elif kind == "all_gather":
            out = np.empty(n * P, dt)
            w = ringlet.all_gather(out, ins[rank], async_op=async_op)
            checks.append((i, kind, out, np.concatenate(ins)))
        elif kind == "reduce_scatter":
            big = [data(r, n * P, dt, salt=i) for r in range(P)]
            out = np.empty(n, dt)
            w = ringlet.reduce_scatter(out, big[rank], async_op=async_op)
            checks.append((i, kind, out, reduce_np(big, ReduceOp.SUM, dt)[rank * n:(rank + 1) * n]))
        elif kind == "all_to_all":
            big = [data(r, n * P, dt, salt=i) for r in range(P)]
            out = np.empty(n * P, dt)
            w = ringlet.all_to_all(out, big[rank], async_op=async_op)
            checks.append((i, kind, out, np.concatenate([b[rank * n:(rank + 1) * n]
                                                         for b in big])))
        elif kind == "barrier":
            w = ringlet.barrier(async_op=async_op)
        else:  # point to point around the ring, tagged by op index
            got = np.empty(n, dt)
            ws = ringlet.isend(ins[rank], (rank + 1) % P, tag=i)
            wr = ringlet.irecv(got, (rank - 1) % P, tag=i)
            pending += [ws, wr]
            checks.append((i, kind, got, ins[(rank - 1) % P]))
            w = None
        if async_op and w is not None:
            pending.append(w)
        if len(pending) >= 6 or i == n_ops - 1:
            for p in pending:
                p.wait(timeout=60)
            pending = []
    for i, kind, got, want in checks:
        if not same(got, want):
            bad.append(f"rank {rank}: op {i} {kind} {got.dtype} n={got.size}")
    return bad


def test_a_thousand_mixed_ops_sync_and_async():
    results = run_world(_stress, 4, mode="thread", timeout=300, args=(1000,))
    assert results == [[]] * 4, [b for r in results for b in r][:20]


# ---- hierarchical groups: one op at a time, never waiting for itself ---------------
class _WrappedLock:
    """A group's lock with an instrumented ``acquire`` (subclasses); the rest is a Lock's."""

    def __init__(self):
        self._lock = threading.Lock()

    def release(self):
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


class _HookLock(_WrappedLock):
    """A group's lock that runs ``hook`` once, right after it is first taken."""

    def __init__(self, hook):
        super().__init__()
        self._hook = hook

    def acquire(self, blocking=True, timeout=-1):
        got = self._lock.acquire(blocking, timeout)
        if got and self._hook is not None:
            hook, self._hook = self._hook, None
            hook()
        return got


def _async_queued_under_a_sync_hier_op(rank, P):
    g = _world._require(None)
    assert g._hier is not None
    y = np.full(10, rank, np.float32)
    works = []
    # Async work queued (as another thread would) after the synchronous op checked the
    # executor and took the group's lock: its job needs that lock.
    g._lock = _HookLock(lambda: works.append(g.all_reduce(y, async_op=True, timeout=30)))
    x = np.full(64, rank + 1, np.float32)
    g.all_reduce(x, timeout=30)  # hierarchical
    works[0].wait(30)
    return bool(np.all(x == P * (P + 1) // 2)) and bool(np.all(y == P * (P - 1) // 2))


def test_a_sync_hier_op_never_queues_behind_work_that_needs_its_lock(monkeypatch):
    # It used to queue itself behind that work while holding the lock: a deadlock
    # with no deadline (run_world's timeout ends the test instead).
    monkeypatch.setenv("RINGLET_ALGO", "hier")
    assert run_world(_async_queued_under_a_sync_hier_op, 4, mode="thread", timeout=60,
                     host_ids=["a", "a", "b", "b"]) == [True] * 4


class _SpyLock(_WrappedLock):
    """A group's lock that tells whether some caller had to wait for it."""

    def __init__(self):
        super().__init__()
        self.waited = threading.Event()

    def acquire(self, blocking=True, timeout=-1):
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        self.waited.set()
        return self._lock.acquire(True, timeout)


def _flat_op(g, op, rank):
    if op == "barrier":
        g.barrier()
    elif op == "all_to_all":
        g.all_to_all(np.empty(4, np.float32), np.full(4, rank, np.float32), timeout=30)
    else:
        g.all_to_all_v(np.empty(4, np.float32), [2, 2], np.full(4, rank, np.float32), [2, 2],
                       timeout=30)


def _flat_behind_a_hier_op(rank, P, op, go):
    g = _world._require(None)
    assert g._hier is not None
    if rank == 1:
        assert go.wait(60), "rank 0 never released rank 1"
        _flat_op(g, op, rank)
        return None
    spy = g._lock = _SpyLock()
    spy._lock.acquire()  # held, as by a hierarchical op running in another thread
    started = g._coll.trace()[0]
    t = threading.Thread(target=_flat_op, args=(g, op, rank), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not spy.waited.is_set() and g._coll.trace()[0] == started \
            and time.monotonic() < deadline:
        time.sleep(0.001)
    waited, ran = spy.waited.is_set(), g._coll.trace()[0] != started
    spy._lock.release()
    go.set()
    t.join(30)
    return waited, ran, not t.is_alive()


@pytest.mark.parametrize("op", ["barrier", "all_to_all", "all_to_all_v"])
def test_flat_ops_of_a_hier_group_wait_for_its_running_op(monkeypatch, op):
    # A hierarchical op runs on the sub-groups' communicators, so the C lock of the
    # group's own communicator does not see it: a flat op of another thread must
    # wait for the group's lock instead of running beside it.
    monkeypatch.setenv("RINGLET_ALGO", "hier")
    res = run_world(_flat_behind_a_hier_op, 2, mode="thread", timeout=90,
                    args=(op, threading.Event()), host_ids=["a", "b"])
    assert res[0] == (True, False, True), res
