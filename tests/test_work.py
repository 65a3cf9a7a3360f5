"""Work handles and the serial executor behind every asynchronous operation, on their own.

No ranks: the calls submitted here are plain Python functions, held back by events so
each state (pending, running, finished, failed) is reached on purpose.  Every wait is
bounded.
"""

import threading

import pytest

from ringlet.errors import CollectiveTimeout
from ringlet.work import SerialExecutor, Work

T = 30.0  # generous bound for anything that should happen at once


def _gate():
    started, release = threading.Event(), threading.Event()

    def held():
        started.set()
        assert release.wait(T)
        return "held"

    return held, started, release


def test_calls_run_in_order_and_works_carry_results_and_errors():
    ex = SerialExecutor("t-order")
    seen = []
    held, started, release = _gate()
    first = ex.submit(held, Work("first"))
    works = [ex.submit(lambda i=i: seen.append(i) or i * 10, Work(f"op{i}")) for i in range(50)]

    def boom():
        raise ValueError("bad op")

    bad = ex.submit(boom, Work("bad"))
    assert started.wait(T)
    assert not first.is_completed() and first.exception() is None
    assert "pending" in repr(first)
    # Pending: a bounded wait times out and the operation goes on.
    with pytest.raises(CollectiveTimeout, match="first not finished"):
        first.wait(0)
    with pytest.raises(CollectiveTimeout):
        first.wait(0.01)
    release.set()
    assert first.wait(T) and first.result() == "held"
    assert [w.result() for w in works] == [i * 10 for i in range(50)]
    assert seen == list(range(50))
    with pytest.raises(ValueError, match="bad op"):
        bad.wait(T)
    assert bad.is_completed() and isinstance(bad.exception(), ValueError)
    assert "failed" in repr(bad) and "done" in repr(works[0])
    assert ex.drain(T)
    ex.close()


def test_every_waiter_returns_and_callbacks_run_once():
    ex = SerialExecutor("t-waiters")
    held, started, release = _gate()
    w = ex.submit(held, Work("held"))
    assert started.wait(T)
    calls = []
    w._add_done_callback(lambda x: calls.append(("before", x)))
    results = []
    waiters = [threading.Thread(target=lambda: results.append(w.wait(T))) for _ in range(4)]
    for t in waiters:
        t.start()
    release.set()
    for t in waiters:
        t.join(T)
    assert results == [True] * 4
    assert ex.drain(T)
    w._add_done_callback(lambda x: calls.append(("after", x)))  # finished: runs at once
    assert calls == [("before", w), ("after", w)]
    ex.close()


def test_drain_times_out_while_busy_and_the_thread_comes_and_goes():
    ex = SerialExecutor("t-idle")
    ex._IDLE_EXIT = 0.05  # the worker leaves after this long without work
    held, started, release = _gate()
    w = ex.submit(held, Work("held"))
    assert started.wait(T)
    assert ex.drain(0.01) is False
    release.set()
    assert ex.drain(T) and w.wait(T)
    first = ex._thread
    assert first is not None
    first.join(T)  # idle: it exits by itself
    assert not first.is_alive() and ex._thread is None
    assert ex.submit(lambda: 7, Work("again")).result() == 7  # a new worker starts
    assert ex._thread is not first
    ex.close()


def test_close_runs_what_was_queued_then_refuses():
    ex = SerialExecutor("t-close")
    held, started, release = _gate()
    works = [ex.submit(held, Work("held"))] + [ex.submit(lambda i=i: i, Work(f"q{i}"))
                                               for i in range(5)]
    assert started.wait(T)
    worker = ex._thread
    ex.close()
    with pytest.raises(RuntimeError, match="shut down"):
        ex.submit(lambda: None, Work("late"))
    release.set()
    assert [w.result() for w in works] == ["held", 0, 1, 2, 3, 4]
    worker.join(T)
    assert not worker.is_alive() and ex._thread is None


def test_a_callback_that_raises_is_logged_and_the_thread_goes_on(caplog):
    ex = SerialExecutor("t-raise")
    held, started, release = _gate()
    w = ex.submit(held, Work("held"))
    assert started.wait(T)
    calls = []

    def bad(x):
        raise RuntimeError("callback broke")

    w._add_done_callback(bad)
    w._add_done_callback(lambda x: calls.append(x))
    release.set()
    assert w.wait(T) and ex.drain(T)
    assert calls == [w]  # the next callback still ran
    assert ex.submit(lambda: 5, Work("after")).result() == 5  # the worker lives on
    logged = [r for r in caplog.records if "callback of held work" in r.getMessage()]
    assert len(logged) == 1 and str(logged[0].exc_info[1]) == "callback broke"
    ex.close()
