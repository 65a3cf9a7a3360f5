"""Receives from any source (``recv(array, None, tag)``), over TCP and shared memory."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import ringlet
from ringlet.errors import CollectiveTimeout, PeerClosedError
from ringlet.testing import WorldError, run_world

TRANSPORTS = ["tcp", "shm"]


def _fan_in(rank, P):
    # Every other rank sends 3 messages of its own values, sizes from one
    # element to beyond a shared-memory ring (a direct read), with a tag per
    # message; rank 0 takes them by tag from whoever sent first.
    sizes = [1, 4097, 300_001]
    if rank != 0:
        for k, n in enumerate(sizes):
            ringlet.send(np.full(n, rank * 10 + k, np.float64), 0, tag=k)
        ringlet.barrier()
        return True
    got = {}
    for k, n in enumerate(sizes):
        for _ in range(P - 1):
            a = np.empty(n, np.float64)
            src = ringlet.recv(a, None, tag=k)
            assert 1 <= src < P and (src, k) not in got, (src, k)
            assert np.all(a == src * 10 + k), (src, k, a[:3])
            got[(src, k)] = True
    ringlet.barrier()
    return len(got) == 3 * (P - 1)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_messages_from_every_rank_arrive_by_tag_with_their_sender(monkeypatch, transport):
    monkeypatch.setenv("RINGLET_TRANSPORT", transport)
    assert all(run_world(_fan_in, 4, mode="process", timeout=120))


def _order_and_buffering(rank, P):
    # Per sender, messages with the tag arrive in send order; messages with
    # other tags that arrive first are kept for the receives that name them.
    n = 20
    if rank != 0:
        ringlet.send(np.array([rank], np.int64), 0, tag=7)  # left for a named receive
        for k in range(n):
            ringlet.send(np.array([rank, k], np.int64), 0, tag=1)
        ringlet.barrier()
        return True
    seen = {q: 0 for q in range(1, P)}
    for _ in range(n * (P - 1)):
        a = np.empty(2, np.int64)
        src = ringlet.recv(a, tag=1)
        assert a[0] == src and a[1] == seen[src], (src, a, seen)
        seen[src] += 1
    for q in range(1, P):
        b = np.empty(1, np.int64)
        assert ringlet.recv(b, q, tag=7) == q and b[0] == q
    ringlet.barrier()
    return seen == {q: n for q in range(1, P)}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_per_sender_order_holds_and_other_tags_wait_for_their_receive(monkeypatch, transport):
    monkeypatch.setenv("RINGLET_TRANSPORT", transport)
    assert all(run_world(_order_and_buffering, 3, mode="process", timeout=120))


def _async_and_subgroup(rank, P):
    # irecv from any source: the Work's result is the sender.  In a subgroup
    # the sender comes in the group's numbering.
    ok = True
    if rank == 0:
        w = ringlet.irecv(np.empty(4, np.int32), tag=2)
        ok &= w.result() == P - 1
    elif rank == P - 1:
        ringlet.send(np.zeros(4, np.int32), 0, tag=2)
    odd = ringlet.new_group([r for r in range(P) if r % 2 == 1])  # world 1, 3 -> group 0, 1
    if rank == 1:
        a = np.empty(1, np.int32)
        ok &= odd.recv(a, tag=4) == 1 and a[0] == 3
    elif rank == 3:
        odd.send(np.array([3], np.int32), 0, tag=4)
    ringlet.barrier()
    return bool(ok)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_irecv_from_any_source_and_subgroup_numbering(monkeypatch, transport):
    monkeypatch.setenv("RINGLET_TRANSPORT", transport)
    assert all(run_world(_async_and_subgroup, 4, mode="process", timeout=120))


def _beside_a_named_receive(rank, P):
    # One thread receives from any source while another receives from rank 1
    # by name.  Rank 1 sends the any-source tag first, so the named receive may
    # buffer it; either way both receives get their message.
    if rank == 1:
        ringlet.barrier()
        ringlet.send(np.array([11], np.int32), 0, tag=1)
        ringlet.send(np.array([22], np.int32), 0, tag=2)
        ringlet.barrier()
        return True
    if rank != 0:
        ringlet.barrier()
        ringlet.barrier()
        return True
    out = {}

    def any_source():
        a = np.empty(1, np.int32)
        out["any"] = (ringlet.recv(a, tag=1, timeout=60), int(a[0]))

    t = threading.Thread(target=any_source)
    t.start()
    ringlet.barrier()
    b = np.empty(1, np.int32)
    ringlet.recv(b, 1, tag=2, timeout=60)
    t.join(90)
    ringlet.barrier()
    return out.get("any") == (1, 11) and b[0] == 22


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_named_receive_on_another_thread_leaves_the_message_to_it(monkeypatch, transport):
    monkeypatch.setenv("RINGLET_TRANSPORT", transport)
    for _ in range(5):  # the two threads meet in a different order each time
        assert all(run_world(_beside_a_named_receive, 3, mode="process", timeout=120))


def _nobody_sends(rank, P):
    # Rank 0 waits for a message nobody sends; the others wait in a barrier,
    # which rank 0's failure then aborts.
    if rank == 0:
        t0 = time.monotonic()
        try:
            ringlet.recv(np.empty(1), tag=9, timeout=0.5)
        except CollectiveTimeout as exc:
            return ("timeout", time.monotonic() - t0, str(exc))
        return ("received", 0.0, "")
    try:
        ringlet.barrier(timeout=30)
    except ringlet.errors.RingletError as exc:
        return ("aborted", 0.0, str(exc))
    return ("done", 0.0, "")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_message_times_out_naming_any_source(monkeypatch, transport):
    monkeypatch.setenv("RINGLET_TRANSPORT", transport)
    res = run_world(_nobody_sends, 3, mode="thread", timeout=60)
    kind, took, msg = res[0]
    assert kind == "timeout", res[0]
    assert "no message with tag 9 from any of the 2 peers" in msg, msg
    assert 0.4 < took < 10, took
    assert [r[0] for r in res[1:]] == ["aborted", "aborted"], res


def _killed_while_waiting(rank, P):
    if rank == 2:
        ringlet.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    ringlet.barrier()
    if rank == 0:
        t0 = time.monotonic()
        try:
            ringlet.recv(np.empty(1), tag=3, timeout=60)
        except PeerClosedError as exc:
            return ("closed", time.monotonic() - t0, str(exc))
        except Exception as exc:  # noqa: BLE001
            return (type(exc).__name__, time.monotonic() - t0, str(exc))
        return ("received", 0.0, "")
    try:
        ringlet.barrier(timeout=60)
    except ringlet.errors.RingletError as exc:
        return ("aborted", 0.0, str(exc))
    return ("done", 0.0, "")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_killed_peer_fails_a_receive_from_any_source_fast(monkeypatch, transport):
    monkeypatch.setenv("RINGLET_TRANSPORT", transport)
    with pytest.raises(WorldError) as ei:
        run_world(_killed_while_waiting, 3, mode="process", timeout=90)
    kind, took, msg = ei.value.results[0]
    assert kind == "closed" and "peer 2" in msg, (kind, msg)
    assert took < 5.0, f"rank 0 needed {took:.2f}s to notice a SIGKILL"


def _one_rank(rank, P):
    with pytest.raises(ValueError, match="at least 2 ranks"):
        ringlet.recv(np.empty(1))
    return True


def test_a_group_of_one_has_no_source():
    assert all(run_world(_one_rank, 1, mode="thread", timeout=30))
