"""The flight recorder, its dumps, ``ringlet trace`` and RINGLET_DEBUG.

Real jobs: processes for timeouts, signals and exit paths, threads where one
process is enough.  Every wait is on an explicit signal (a file the rank
writes, a process exit) under a generous deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import ringlet
from ringlet import _core, trace
from ringlet.cli import main as cli_main
from ringlet.errors import DesyncError, RingletError
from ringlet.testing import run_world

SRC = str(Path(ringlet.__file__).resolve().parents[1])  # the ringlet under test, as installed


@pytest.fixture
def trace_dir(tmp_path, monkeypatch):
    d = tmp_path / "trace"
    monkeypatch.setenv("RINGLET_TRACE_DIR", str(d))
    return d


@pytest.fixture
def tuning():
    saved = _core.get_tuning()
    yield
    _core.set_tuning(**saved)


def _report(d) -> dict:
    return trace.analyze(trace.load(str(d)))


def _comm0(rep):
    return next(c for c in rep["communicators"] if c["comm_id"] == 0)


def test_a_failure_dump_under_way_holds_back_the_other_caller(monkeypatch):
    # The rank's own failure and the watcher's cancel race to dump; the one
    # that finds a dump under way must wait for its file, or the process may
    # exit (killing the watcher thread) before the record is written.
    import threading
    import types

    started, release, order = threading.Event(), threading.Event(), []

    def slow_dump(world, reason, directory=None):
        started.set()
        release.wait(60)
        order.append(("written", reason))

    monkeypatch.setattr(trace, "dump", slow_dump)
    world = types.SimpleNamespace()
    first = threading.Thread(target=trace.on_failure, args=(world, None, "cancelled by rank 0"))
    first.start()
    assert started.wait(60)
    second = threading.Thread(target=lambda: (trace.on_failure(world, DesyncError("x")),
                                              order.append(("returned", None))))
    second.start()
    second.join(0.5)  # room to return early, which it must not
    release.set()
    first.join(60)
    second.join(60)
    assert order == [("written", "cancelled by rank 0"), ("returned", None)], order


# ---- where and how a dump is written -------------------------------------------------
class _FakeWorld:
    """What dump() reads of a world: no communicators, a fixed job id."""

    def __init__(self, rank=3):
        self.rank, self.size, self._groups, self._closed = rank, 4, [], False
        self.job_id = bytes.fromhex("4f0c2a9e51b7d3c8a1b2c3d4e5f60718")


def test_dump_is_private_and_names_the_job_by_its_tag(tmp_path, monkeypatch):
    monkeypatch.delenv("RINGLET_TRACE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old_umask = os.umask(0o022)  # the usual one: 0755 directories, 0644 files unless asked
    try:
        path = trace.dump(_FakeWorld(), "test")
    finally:
        os.umask(old_umask)
    assert path == str(tmp_path / "ringlet-trace-4f0c2a9e" / "rank3.json"), path
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    assert os.stat(path).st_mode & 0o777 == 0o600
    text = Path(path).read_text()
    assert json.loads(text)["job_id"] == "4f0c2a9e"
    assert "51b7d3c8" not in text  # no more of the id than its tag
    assert os.listdir(os.path.dirname(path)) == ["rank3.json"]  # no temporary file left
    assert trace.analyze([json.loads(text)])["job_ids"] == ["4f0c2a9e"]


def test_a_dump_that_interrupts_another_writes_its_own_temporary_file(tmp_path, monkeypatch):
    # A SIGUSR1 dump can run inside a dump of the same thread (its handler runs
    # between bytecodes): the two must not share a temporary file.
    world, inner = _FakeWorld(rank=1), []
    real_json_dump = json.dump

    def interrupted(obj, f, **kw):
        if not inner:
            inner.append(None)  # once: the inner dump comes through here too
            inner[0] = trace.dump(world, "inner", str(tmp_path))
        return real_json_dump(obj, f, **kw)

    monkeypatch.setattr(trace.json, "dump", interrupted)
    outer = trace.dump(world, "outer", str(tmp_path))
    assert inner == [str(tmp_path / "rank1.json")] and outer == inner[0], (inner, outer)
    assert json.loads((tmp_path / "rank1.json").read_text())["reason"] == "outer"
    assert os.listdir(tmp_path) == ["rank1.json"]


_SIGUSR1_TWICE = textwrap.dedent(r"""
    import os, signal, time
    from ringlet import trace

    class World:
        _closed = False

    world = World()
    trace._worlds.add(world)
    trace._install_sigusr1()
    calls = []

    def dump(w, reason, directory=None):
        calls.append(reason)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # a second signal while this dump runs
            time.sleep(0.2)  # its handler runs here
        return "written"

    trace.dump = dump
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.2)
    print("dumps", len(calls), flush=True)
""")


def test_sigusr1_during_a_dump_is_skipped_not_waited_for():
    out = subprocess.run([sys.executable, "-c", _SIGUSR1_TWICE], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["dumps", "1"], out.stdout + out.stderr
    assert "SIGUSR1 while a flight record is being written" in out.stderr, out.stderr


# ---- one rank skips a collective: the others time out --------------------------
def _skip_one(rank, P):
    for _ in range(3):
        ringlet.all_reduce(np.ones(4, np.float32))
    try:
        if rank == 1:
            # Skips seq 4; waits where the job's failure reaches it (a cancel).
            ringlet.recv(np.empty(1, np.float32), src=0, timeout=120)
        else:
            ringlet.all_reduce(np.ones(1000, np.float32), timeout=2)
    except RingletError as exc:
        return type(exc).__name__
    return "no error"


def test_skipped_collective_is_named_by_ringlet_trace(trace_dir, capsys):
    res = run_world(_skip_one, 3, mode="process", timeout=120)
    assert res[0] == "CollectiveTimeout" and all(r != "no error" for r in res), res
    # (each rank's error in the message: a CI run once found rank 2's record missing)
    assert sorted(os.listdir(trace_dir)) == ["rank0.json", "rank1.json", "rank2.json"], res
    d0 = json.loads((trace_dir / "rank0.json").read_text())
    assert d0["rank"] == 0 and d0["world_size"] == 3 and d0["pid"] != os.getpid()
    assert "timed out" in d0["reason"] and d0["host"]  # its own timeout, or rank 2's first
    coll = next(c for c in d0["communicators"] if c["kind"] == "collective")
    assert coll["ranks"] == [0, 1, 2] and coll["seq"] == 4 and coll["capacity"] == 2000
    last = coll["entries"][-1]
    assert (last["seq"], last["op"], last["dtype"], last["bytes"], last["state"],
            last["status"]) == (4, "all_reduce", "float32", 4000, "failed", "TIMEOUT")
    assert [e["state"] for e in coll["entries"][:3]] == ["completed"] * 3
    assert last["end_ns"] >= last["start_ns"] + 1_900_000_000  # failed at its 2 s deadline

    assert cli_main(["trace", str(trace_dir), "--json"]) == 0
    c = _comm0(json.loads(capsys.readouterr().out))
    assert c["first_incomplete_seq"] == 4
    assert [n["rank"] for n in c["never_entered"]] == [1] and c["never_entered"][0]["last_seq"] == 3
    # rank 2 either timed out itself or was dumped while still blocked
    assert 0 in [f["rank"] for f in c["failed"]]
    assert sorted([f["rank"] for f in c["failed"]] + [s["rank"] for s in c["stuck"]]) == [0, 2]
    assert c["completed"] == [] and not c["mismatch"]

    # the real command line, human-readable
    out = subprocess.run([sys.executable, "-m", "ringlet.cli", "trace", str(trace_dir)],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    assert "first seq not completed by every rank: 4 (all_reduce float32 4000 bytes)" in out.stdout
    assert "never entered: rank 1 (last seq 3 all_reduce completed)" in out.stdout
    assert "p2p: rank 1 recv from rank 0 tag 0" in out.stdout


# ---- a receive from any source that nobody answers -----------------------------
def _any_source_unanswered(rank, P):
    try:
        if rank == 0:
            ringlet.recv(np.empty(3, np.float32), None, tag=9, timeout=1)
        else:
            ringlet.barrier(timeout=60)  # ended by rank 0's failure
    except RingletError as exc:
        return type(exc).__name__
    return "no error"


def test_an_unanswered_receive_from_any_source_is_reported_as_such(trace_dir):
    res = run_world(_any_source_unanswered, 2, mode="process", timeout=120)
    assert res[0] == "CollectiveTimeout" and res[1] != "no error", res
    d0 = json.loads((trace_dir / "rank0.json").read_text())
    p2p = next(c for c in d0["communicators"] if c["kind"] != "collective")
    last = p2p["entries"][-1]
    assert (last["peer"], last["tag"], last["recv"], last["state"]) == (-1, 9, True, "failed")
    rep = _report(trace_dir)
    assert [(p["rank"], p["peer"], p["tag"]) for p in rep["p2p_in_flight"]] == [(0, "any", 9)]
    assert "p2p: rank 0 recv from any rank tag 9 (12 bytes): failed" in trace.format_report(rep)


# ---- desync: the report shows both sides ---------------------------------------
def _desync(rank, P):
    ringlet.barrier()
    try:
        if rank == 0:
            ringlet.all_reduce(np.ones(8, np.float32), timeout=30)
        else:
            ringlet.broadcast(np.ones(8, np.float32), src=0, timeout=30)
    except DesyncError:
        return "desync"
    return "no error"


def test_desync_dump_shows_both_ops(trace_dir):
    assert run_world(_desync, 2, timeout=60) == ["desync", "desync"]
    c = _comm0(_report(trace_dir))
    assert c["first_incomplete_seq"] == 2 and c["mismatch"]
    assert c["ops"]["0"]["op"] == "all_reduce" and c["ops"]["1"]["op"] == "broadcast"
    assert c["ops"]["1"]["peer"] == 0  # the broadcast's root
    # Rank 1 finds the desync; rank 0 fails on its abort, which over shared
    # memory can reach rank 0's op after rank 0's store watcher has already
    # dumped it (on a busy host a spinning rank may wait for a core while the
    # watcher is woken): then its dump shows the op blocked, not failed.
    failed = sorted(f["rank"] for f in c["failed"])
    assert failed == [0, 1] or (failed == [1] and [x["rank"] for x in c["stuck"]] == [0]), c
    assert "DESYNC: ranks are in different ops" in trace.format_report(_report(trace_dir))


# ---- a killed peer: the survivor dumps ------------------------------------------
def _killed(rank, P):
    ringlet.all_reduce(np.ones(4, np.float32))
    if rank == 1:
        os._exit(3)
    try:
        ringlet.all_reduce(np.ones(4, np.float32), timeout=60)
    except RingletError as exc:
        return type(exc).__name__
    return "no error"


def test_peer_loss_dumps_the_survivor(trace_dir):
    with pytest.raises(ringlet.testing.WorldError) as ei:
        run_world(_killed, 2, mode="process", timeout=60)
    assert ei.value.results[0] != "no error" and 1 in ei.value.failures
    d0 = json.loads((trace_dir / "rank0.json").read_text())
    coll = next(c for c in d0["communicators"] if c["kind"] == "collective")
    assert coll["entries"][-1]["seq"] == 2 and coll["entries"][-1]["state"] == "failed"
    assert not (trace_dir / "rank1.json").exists()
    rep = _report(trace_dir)
    assert rep["missing_ranks"] == [1] and _comm0(rep)["missing_dumps"] == [1]


# ---- SIGUSR1 on a live, blocked process ------------------------------------------
def _sigusr1(rank, P, d):
    pids = ringlet.all_gather_object(os.getpid())
    ringlet.all_reduce(np.ones(4, np.float32))  # seq 3 (all_gather_object takes two)
    if rank == 1:
        x = np.full(4, 2.0, np.float32)
        ringlet.all_reduce(x, timeout=120)  # seq 4: blocked until rank 0 joins
        return x.tolist()
    os.kill(pids[1], signal.SIGUSR1)
    path = Path(d) / "rank1.json"
    deadline = time.monotonic() + 60
    while not path.exists():  # rank 1 writes it from its signal handler
        if time.monotonic() > deadline:
            raise AssertionError("no SIGUSR1 dump within 60 s")
        time.sleep(0.01)
    x = np.full(4, 1.0, np.float32)
    ringlet.all_reduce(x, timeout=120)
    return x.tolist()


def test_sigusr1_dumps_a_live_process_which_keeps_working(trace_dir):
    res = run_world(_sigusr1, 2, mode="process", timeout=120, args=(str(trace_dir),))
    assert res == [[3.0] * 4, [3.0] * 4]  # the handler did not disturb the op
    d1 = json.loads((trace_dir / "rank1.json").read_text())
    assert d1["reason"] == "SIGUSR1" and d1["rank"] == 1
    coll = next(c for c in d1["communicators"] if c["kind"] == "collective")
    by_seq = {e["seq"]: e for e in coll["entries"]}
    assert by_seq[3]["op"] == "all_reduce" and by_seq[3]["state"] == "completed"
    # seq 4 cannot have completed before rank 0 joined it; the signal lands
    # while rank 1 is blocked in it (or just before it starts it)
    assert 4 not in by_seq or by_seq[4]["state"] == "started"
    assert not (trace_dir / "rank0.json").exists()  # only the signalled process dumped


# ---- RINGLET_TRACE=1: a dump at shutdown ----------------------------------------
def _ops(rank, P):
    ringlet.broadcast(np.arange(100, dtype=np.float64), src=1)
    ringlet.all_reduce(np.ones(1 << 16, np.float32))  # 256 KiB: the ring
    if rank == 0:
        ringlet.send(np.ones(3, np.int32), dst=1, tag=7)
    else:
        ringlet.recv(np.empty(3, np.int32), src=0, tag=7)
    ringlet.barrier()


def test_trace_1_dumps_at_exit(trace_dir, monkeypatch):
    monkeypatch.setenv("RINGLET_TRACE", "1")
    run_world(_ops, 2, timeout=60)
    rep = _report(trace_dir)
    c = _comm0(rep)
    assert rep["ranks"] == [0, 1] and c["first_incomplete_seq"] is None
    assert c["last_seq"] == {"0": 3, "1": 3} and rep["p2p_in_flight"] == []
    d1 = json.loads((trace_dir / "rank1.json").read_text())
    assert d1["reason"].startswith("exit")
    coll, p2p = d1["communicators"][0], d1["communicators"][1]
    ents = [(e["op"], e["dtype"], e["bytes"], e["peer"], e["algorithm"], e["state"])
            for e in coll["entries"]]
    # (two ranks of one host: the collectives run over shared memory)
    assert ents == [("broadcast", "float64", 800, 1, "shm_slot", "completed"),
                    ("all_reduce", "float32", 1 << 18, -1, "shm_pair", "completed"),
                    ("barrier", None, 0, -1, "shm_flags", "completed")]
    assert [(e["recv"], e["peer"], e["tag"], e["bytes"], e["state"]) for e in p2p["entries"]] \
        == [(True, 0, 7, 12, "completed")]
    assert all(e["duration_us"] >= 0 for e in coll["entries"])


def test_no_dump_without_a_trigger(trace_dir, monkeypatch):
    monkeypatch.delenv("RINGLET_TRACE", raising=False)
    run_world(_ops, 2, timeout=60)
    assert not trace_dir.exists()


# ---- the ring keeps the last N ---------------------------------------------------
def test_ring_wraps_keeping_the_last_n(tuning):
    _core.set_tuning(trace_entries=5)  # not a power of two: the C ring holds 8
    g = ringlet.init()
    try:
        for i in range(12):
            ringlet.all_reduce(np.ones(i + 1, np.float32))
        total, cap, ents = g._coll.trace()
        assert (total, cap) == (12, 5)
        assert [e["seq"] for e in ents] == [8, 9, 10, 11, 12]
        assert [e["bytes"] for e in ents] == [4 * n for n in (8, 9, 10, 11, 12)]
        assert [e["id"] for e in ents] == [7, 8, 9, 10, 11]
        assert all(e["state"] == "completed" and e["algorithm"] == "local" for e in ents)
    finally:
        ringlet.shutdown()
    _core.set_tuning(trace_entries=0)
    g = ringlet.init()
    try:
        ringlet.all_reduce(np.ones(3, np.float32))
        assert g._coll.trace() == (0, 0, [])
    finally:
        ringlet.shutdown()


def test_trace_entries_knob_from_the_environment(tuning, monkeypatch):
    monkeypatch.setenv("RINGLET_TRACE_ENTRIES", "3")
    g = ringlet.init()
    try:
        for _ in range(4):
            ringlet.barrier()
        assert g._coll.trace()[:2] == (4, 3)
    finally:
        ringlet.shutdown()


# ---- RINGLET_DEBUG ---------------------------------------------------------------
def _two_ops(rank, P):
    ringlet.all_reduce(np.ones(4, np.float32))
    ringlet.broadcast(np.ones(1 << 15, np.float32), src=0)


def test_debug_info_and_detail_logs(monkeypatch, capfd):
    monkeypatch.setenv("RINGLET_TRANSPORT", "tcp")  # the connection lines below
    monkeypatch.setenv("RINGLET_DEBUG", "INFO")
    run_world(_two_ops, 2, timeout=60)
    err = capfd.readouterr().err
    for r in (0, 1):
        assert f"ringlet[rank {r}] INFO: init: rank {r} of 2, host " in err
        assert f"ringlet[rank {r}] INFO: transport: tcp" in err
        assert f"ringlet[rank {r}] INFO: algorithm all_reduce: recursive_doubling up to 65536 " \
               f"bytes, else ring" in err
    assert "ringlet[rank 0] INFO: comm 0: connected to peer 1 (world rank 1, 127.0.0.1:" in err
    assert "transport tcp, dialled" in err and "transport tcp, accepted" in err
    assert "DETAIL" not in err

    monkeypatch.setenv("RINGLET_DEBUG", "DETAIL")
    run_world(_two_ops, 2, timeout=60)
    err = capfd.readouterr().err
    for r in (0, 1):
        assert f"ringlet[rank {r}] DETAIL: comm 0: all_reduce seq=1 bytes=16 " \
               f"algorithm=recursive_doubling" in err
        assert f"ringlet[rank {r}] DETAIL: comm 0: broadcast seq=2 bytes=131072 " \
               f"algorithm=chain" in err

    # over shared memory: the choice per communicator, and each op's algorithm
    monkeypatch.delenv("RINGLET_TRANSPORT")
    run_world(_two_ops, 2, timeout=60)
    err = capfd.readouterr().err
    for r in (0, 1):
        assert f"ringlet[rank {r}] INFO: transport: auto (same-host Reno: " in err
        assert "; world group: shm" in err
        assert f"ringlet[rank {r}] INFO: communicator 0: transport shm (2 ranks, segment " in err
        assert f"ringlet[rank {r}] DETAIL: comm 0: all_reduce seq=1 bytes=16 " \
               f"algorithm=shm_slot" in err
        assert f"ringlet[rank {r}] DETAIL: comm 0: broadcast seq=2 bytes=131072 " \
               f"algorithm=shm_split_copy" in err
    assert "connected to peer" not in err

    monkeypatch.delenv("RINGLET_DEBUG")
    run_world(_two_ops, 2, timeout=60)
    assert "ringlet[rank" not in capfd.readouterr().err


def test_bad_debug_level_is_refused(monkeypatch):
    monkeypatch.setenv("RINGLET_DEBUG", "LOUD")
    with pytest.raises(ValueError, match="RINGLET_DEBUG must be INFO or DETAIL.*'LOUD'"):
        ringlet.init()
    assert not ringlet.is_initialized()


# ---- ringlet trace on bad input -----------------------------------------------------
def test_trace_command_rejects_empty_and_foreign_dirs(tmp_path, capsys):
    assert cli_main(["trace", str(tmp_path)]) == 2
    assert "no flight records" in capsys.readouterr().err
    (tmp_path / "rank0.json").write_text('{"hello": 1}')
    assert cli_main(["trace", str(tmp_path)]) == 2
    assert "rank0.json: not a ringlet flight record" in capsys.readouterr().err
    # the right format but missing fields: a clear error and exit 2, not a traceback
    (tmp_path / "rank0.json").write_text(json.dumps({"format": trace._FORMAT,
                                                     "rank": 0}))
    assert cli_main(["trace", str(tmp_path)]) == 2
    assert "a flight record is malformed (KeyError" in capsys.readouterr().err


def _record(rank, seq, entries):
    return {"format": trace._FORMAT, "rank": rank, "world_size": 2, "job_id": "ab" * 8,
            "reason": "test", "communicators": [
                {"kind": "collective", "comm_id": 0, "group_id": 0, "rank": rank,
                 "ranks": [0, 1], "seq": seq, "capacity": len(entries), "entries": entries}]}


def test_trace_without_entries_reports_unknown_not_completed(tmp_path, capsys):
    # RINGLET_TRACE_ENTRIES=0 on rank 1: its last op's state is unknown, not "completed"
    done = {"seq": 5, "op": "all_reduce", "dtype": "float32", "bytes": 8, "peer": -1,
            "algorithm": "ring", "state": "completed", "status": "", "running_for_s": 0}
    (tmp_path / "rank0.json").write_text(json.dumps(_record(0, 5, [done])))
    (tmp_path / "rank1.json").write_text(json.dumps(_record(1, 5, [])))
    assert cli_main(["trace", str(tmp_path), "--json"]) == 0
    c = _comm0(json.loads(capsys.readouterr().out))
    assert c["unknown_state"] == [{"rank": 1, "last_seq": 5}] and c["completed"] == [0]
    assert cli_main(["trace", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "state unknown" in out and "rank 1 (last seq 5)" in out
    assert "every rank completed every op" not in out


# ---- concurrent p2p threads share one ring -------------------------------------------
def _p2p_both_ways(rank, P, n):
    peer = 1 - rank
    outs = [np.full(2, i, np.int64) for i in range(n)]
    ins = [np.empty(2, np.int64) for _ in range(n)]
    works = []
    for i in range(n):  # a sender and a receiver thread run at once on the p2p comm
        works.append(ringlet.isend(outs[i], dst=peer, tag=i))
        works.append(ringlet.irecv(ins[i], src=peer, tag=i))
    for w in works:
        w.wait(timeout=60)
    assert all((ins[i] == i).all() for i in range(n))
    w = ringlet._world._current()
    total, cap, ents = w.group._p2pc.trace()
    return total, sorted(e["id"] for e in ents), sorted((e["recv"], e["tag"]) for e in ents), \
        {e["state"] for e in ents}


def test_concurrent_p2p_threads_record_every_op_once():
    n = 40
    for total, ids, kinds, states in run_world(_p2p_both_ways, 2, timeout=60, args=(n,)):
        assert total == 2 * n and ids == list(range(2 * n)) and states == {"completed"}
        assert kinds == sorted([(False, i) for i in range(n)] + [(True, i) for i in range(n)])


# ---- the C benchmark stays buildable ---------------------------------------------------
def test_flight_cost_bench_builds_and_runs(tmp_path):
    root = Path(__file__).resolve().parents[1]
    exe = tmp_path / "flight_cost"
    srcs = [str(p) for p in sorted((root / "csrc").glob("*.c"))]
    subprocess.run(["cc", "-O0", "-std=gnu11", "-pthread", "-Wall", "-Werror",
                    f"-I{root / 'csrc'}", str(root / "bench" / "c" / "flight_cost.c"), *srcs,
                    "-lm", "-o", str(exe)], check=True, timeout=300)
    out = subprocess.run([str(exe), "3", "2000"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert "rounds 3 x 2000 calls" in out
    off = float(out.split("recorder off (trace_entries=0):    median ")[1].split()[0])
    on = float(out.split("recorder on  (trace_entries=2000): median ")[1].split()[0])
    assert off > 0 and on > 0
