"""Behaviour the docs promise that no other test pinned down.

docs/errors.md (error attributes and classes, Work.wait(timeout), the cap on
unmatched point-to-point messages), docs/algorithms.md (ranks with different
tuning fail with a desync at the first frame), docs/security.md (the
handshake refuses the right secret for another job or rank; the no-secret
rules), docs/launching.md (`ringlet run` forwards SIGTERM/SIGHUP, a second
signal kills at once) and examples/train_ddp.py.  Every wait here ends on an
explicit signal (an event, a file a rank writes) under a generous deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ringlet
from ringlet import _core, _world
from ringlet.errors import (CollectiveTimeout, DesyncError, PeerClosedError, ProtocolError,
                            RingletError)
from ringlet.testing import WorldError, run_world

ROOT = Path(__file__).resolve().parents[1]
SRC = str(Path(ringlet.__file__).resolve().parents[1])  # the ringlet under test, as installed


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RINGLET_SECRET", "RINGLET_SECRET_FILE", "RINGLET_ALLOW_INSECURE"):
        env.pop(k, None)
    env.update(extra)
    return env


def _wait_for(cond, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


# ---- error attributes ------------------------------------------------------------
def _desync_attrs(rank, P):
    ringlet.barrier()  # seq 1: the desync below is seq 2
    try:
        ringlet.all_reduce(np.ones(10 + 2 * rank, np.float32), timeout=30)
    except DesyncError as exc:
        return (exc.rank, exc.peer, exc.op, exc.seq, str(exc))
    return None


def test_errors_carry_rank_peer_op_seq_and_the_peers_address():
    res = run_world(_desync_attrs, 2, mode="thread", timeout=60)
    for rank, (r, peer, op, seq, msg) in enumerate(res):
        assert (r, peer, op, seq) == (rank, 1 - rank, "all_reduce", 2), res
        # A rank finds the desync itself, or (when the peer found it first and its
        # published failure stopped this rank before it read the peer's frame) quotes
        # the peer's finding: the peer, whose peer is this rank, is then the one named.
        own = f"rank {rank}: all_reduce seq=2 peer {1 - rank} (127.0.0.1:"
        relayed = f"rank {rank}: rank {1 - rank} failed: rank {1 - rank}: all_reduce seq=2 peer {rank} (127.0.0.1:"
        assert msg.startswith(own) or msg.startswith(relayed), msg
        assert "desync: this rank expects all_reduce(seq=2" in msg, msg
        port = int(msg.split("(127.0.0.1:", 1)[1].split(")", 1)[0])
        assert 0 < port < 65536


def _timeout_attrs(rank, P, done):
    if rank == 1:
        assert done.wait(60), "rank 0 never timed out"
        return None
    t0 = time.monotonic()
    try:
        ringlet.recv(np.empty(4, np.float32), 1, tag=9, timeout=0.5)  # nobody sends
    except CollectiveTimeout as exc:
        took = time.monotonic() - t0
        return (isinstance(exc, TimeoutError), isinstance(exc, RingletError), exc.peer,
                exc.rank, took)
    finally:
        done.set()
    return None


def test_collective_timeout_is_a_timeout_error():
    done = threading.Event()
    res = run_world(_timeout_attrs, 2, mode="thread", timeout=60, args=(done,))
    is_timeout, is_ringlet, peer, rank, took = res[0]
    assert is_timeout and is_ringlet and peer == 1 and rank == 0, res
    assert took >= 0.5, took  # not before its deadline


def _peer_dies(rank, P):
    x = np.zeros(1)
    if rank == 0:  # a first exchange sets up the point-to-point connection
        ringlet.send(x, 1)
    else:
        ringlet.recv(x, 0)
    if rank == 1:
        os._exit(3)  # no goodbye: the socket closes under rank 0
    try:
        ringlet.recv(np.empty(4, np.float32), 1, timeout=60)
    except PeerClosedError as exc:
        return (isinstance(exc, ConnectionError), exc.peer, str(exc))
    return None


def test_peer_closed_is_a_connection_error():
    with pytest.raises(WorldError) as info:
        run_world(_peer_dies, 2, mode="process", timeout=90)
    assert sorted(info.value.failures) == [1]
    is_conn, peer, msg = info.value.results[0]
    assert is_conn and peer == 1 and "peer 1 (127.0.0.1:" in msg, msg


# ---- Work.wait(timeout) ----------------------------------------------------------
def _wait_timeout(rank, P, go):
    if rank == 1:
        assert go.wait(60), "rank 0 never released rank 1"
        ringlet.send(np.arange(6, dtype=np.float64), 0, tag=4)
        return None
    got = np.zeros(6)
    w = ringlet.irecv(got, 1, tag=4, timeout=60)
    try:
        w.wait(timeout=0.2)
        raised = None
    except CollectiveTimeout as exc:
        raised = exc
    carrying_on = not w.is_completed()
    go.set()  # only now may rank 1 send: the op must still be there to take it
    w.wait(timeout=60)
    return (type(raised).__name__, carrying_on, w.exception() is None,
            bool(np.array_equal(got, np.arange(6))))


def test_work_wait_timeout_raises_while_the_op_carries_on():
    go = threading.Event()
    res = run_world(_wait_timeout, 2, mode="thread", timeout=90, args=(go,))
    assert res[0] == ("CollectiveTimeout", True, True, True), res


# ---- the cap on unmatched point-to-point messages --------------------------------
def _unmatched(rank, P):
    if rank == 0:
        for _ in range(8):  # 8 x 4 KiB on tag 1, which nobody receives
            ringlet.send(np.zeros(1024, np.float32), 1, tag=1, timeout=30)
        return None
    try:
        ringlet.recv(np.empty(4, np.float32), 0, tag=2, timeout=30)
    except ProtocolError as exc:
        return str(exc)
    return "received"


def test_unmatched_messages_beyond_the_cap_are_a_protocol_error():
    saved = _core.get_tuning()
    _core.set_tuning(p2p_unexpected_bytes=16 << 10)
    try:
        try:
            res = run_world(_unmatched, 2, mode="thread", timeout=60)
            msg = res[1]
        except WorldError as err:  # rank 0 may see rank 1's abort in its last sends
            assert sorted(err.failures) == [0], str(err)
            msg = err.results[1]
    finally:
        _core.set_tuning(**saved)
    assert "unmatched messages from this peer exceed the 16384-byte buffer" in msg, msg
    assert "waiting for tag 2, got tag 1" in msg, msg


# ---- tuning must agree across ranks ----------------------------------------------
def _different_segments(rank, P):
    _core.set_tuning(segment_bytes=4096 if rank == 0 else 8192,
                     allreduce_small_bytes=256)
    try:
        ringlet.all_reduce(np.ones(100_000, np.float32), timeout=30)
    except DesyncError as exc:
        return str(exc)
    return "no error"


def test_ranks_with_different_tuning_fail_with_a_desync_at_the_first_frame(monkeypatch):
    # TCP's segments (over shared memory, every rank takes rank 0's layout)
    monkeypatch.setenv("RINGLET_TRANSPORT", "tcp")
    res = run_world(_different_segments, 2, mode="process", timeout=90)
    for msg in res:
        assert "desync" in msg and "frame 0 of 4096 bytes" in msg and \
            "frame 0 of 8192 bytes" in msg, msg


def test_tuning_variables_are_read_by_init(monkeypatch):
    saved = _core.get_tuning()
    want = dict(segment_bytes=12288, allreduce_small_bytes=1024, bcast_small_bytes=2048,
                reduce_small_bytes=4096, spin_us=7, bulk_recv_bytes=0)
    for k, v in want.items():
        monkeypatch.setenv(f"RINGLET_{k.upper()}", str(v))
    try:
        _world._apply_tuning_env()
        got = _core.get_tuning()
    finally:
        _core.set_tuning(**saved)
    assert {k: got[k] for k in want} == want
    monkeypatch.setenv("RINGLET_SEGMENT_BYTES", "lots")
    with pytest.raises(ValueError, match="RINGLET_SEGMENT_BYTES"):
        _world._apply_tuning_env()
    assert _core.get_tuning() == saved


# ---- the handshake binds the job and the destination rank ------------------------
def _handshakes(rank, P):
    w = _world._current()
    out = {}
    if rank == 0:
        ep1 = json.loads(w.store.get(w.prefix + "ep/1", timeout=30).decode())["ep"]
        port1 = int(ep1.rsplit(":", 1)[1])
        # the right secret, another job's id
        other = _core.Context(0, 2, "127.0.0.1", w.secret, os.urandom(16))
        other.set_peer(1, "127.0.0.1", port1)
        comm = _core.Comm(other, 0, 0, [0, 1])
        try:
            comm.connect(1, 5000)
            out["job"] = "connected"
        except RingletError as exc:
            out["job"] = type(exc).__name__
        comm.close()
        other.close()
        # the right secret and job, but addressed to rank 2 of a 3-rank job at rank 1's port
        wrong = _core.Context(0, 3, "127.0.0.1", w.secret, w.job_id)
        wrong.set_peer(2, "127.0.0.1", port1)
        comm = _core.Comm(wrong, 0, 0, [0, 1, 2])
        try:
            comm.connect(2, 5000)
            out["dst"] = "connected"
        except RingletError as exc:
            out["dst"] = type(exc).__name__
        comm.close()
        wrong.close()
    ringlet.barrier()
    if rank == 1:
        out["rejected"] = w.ctx.rejected()
    x = np.full(3, rank + 1.0)
    ringlet.all_reduce(x)  # the job is unaffected
    out["ok"] = bool(np.all(x == 3.0))
    return out


def test_handshake_refuses_the_right_secret_for_another_job_or_rank():
    res = run_world(_handshakes, 2, mode="thread", timeout=60)
    assert all(r["ok"] for r in res), res
    assert res[0]["job"] != "connected" and res[0]["dst"] != "connected", res[0]
    # the connector sees the listener hang up (an AuthenticationError, or a
    # reset); the listener counts both refusals
    assert res[1]["rejected"] >= 2, res[1]


# ---- no secret -------------------------------------------------------------------
_INIT = textwrap.dedent("""
    import sys, warnings
    import numpy as np
    import ringlet
    rank, addr, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ringlet.init(rank=rank, world_size=2, master_addr=addr, master_port=port,
                         bind_addr=addr, timeout=30)
        except ringlet.RingletError as exc:
            print("refused:", type(exc).__name__, exc)
            sys.exit(0)
    x = np.full(2, rank + 1.0)
    ringlet.all_reduce(x)
    print("sum", x[0])
    print("warned:", " | ".join(str(w.message) for w in caught if "secret" in str(w.message)))
    ringlet.shutdown()
""")


def _own_address():
    import socket
    # the address the host routes to itself by; the probe sends nothing
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def _two_ranks(tmp_path, addr, env):
    from ringlet.store import StoreServer

    script = tmp_path / "init.py"
    script.write_text(_INIT)
    # rank 0 serves the store on a port the kernel picks: take it from a
    # first listener the test holds, never a guessed free port
    with StoreServer(addr, 0, secret=_world._INSECURE_KEY) as server:
        env = dict(env, RINGLET_EXTERNAL_STORE="1")
        procs = [subprocess.Popen([sys.executable, str(script), str(r), addr, str(server.port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for r in range(2)]
        outs = [p.communicate(timeout=90) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    return [o for o, _ in outs]


def test_loopback_without_a_secret_runs_with_a_warning(tmp_path):
    for out in _two_ranks(tmp_path, "127.0.0.1", _env()):
        assert "sum 3.0" in out, out
        assert "no job secret set; connections are not authenticated (loopback only)" in out, out


def test_off_loopback_without_a_secret_needs_allow_insecure(tmp_path):
    addr = _own_address()
    if addr is None:
        pytest.skip("this host has no non-loopback address")
    for out in _two_ranks(tmp_path, addr, _env()):
        assert "refused: AuthenticationError" in out and "RINGLET_ALLOW_INSECURE=1" in out, out
    for out in _two_ranks(tmp_path, addr, _env(RINGLET_ALLOW_INSECURE="1")):
        assert "sum 3.0" in out, out
        assert "not authenticated (RINGLET_ALLOW_INSECURE=1)" in out, out


# ---- `ringlet run` and signals ---------------------------------------------------
_SIGNALLED = textwrap.dedent("""
    import os, signal, sys, time
    import ringlet
    ringlet.init()
    out = sys.argv[1]
    rank = ringlet.get_rank()

    def note(signum, frame):
        with open(f"{out}/got-{rank}", "a") as f:
            f.write(f"{signum}\\n")
        # keep running: only the launcher's escalation may end this rank

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, note)
    open(f"{out}/ready-{rank}", "w").close()
    while True:
        time.sleep(0.05)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_ringlet_run_forwards_the_signal_and_a_second_one_kills_at_once(tmp_path, sig):
    script = tmp_path / "job.py"
    script.write_text(_SIGNALLED)
    proc = subprocess.Popen([sys.executable, "-m", "ringlet.run", "-n", "2", "--grace", "120",
                             "--timeout", "300", str(script), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _wait_for(lambda: all((tmp_path / f"ready-{r}").exists() for r in range(2)),
                  "both ranks to start")
        proc.send_signal(sig)
        got = [tmp_path / f"got-{r}" for r in range(2)]
        _wait_for(lambda: all(g.exists() and g.read_text() for g in got),
                  "both ranks to receive the forwarded signal")
        assert all(g.read_text().split() == [str(int(sig))] for g in got)
        assert proc.poll() is None  # the ranks ignore it; the grace is 120 s
        t0 = time.monotonic()
        proc.send_signal(sig)  # the second signal: no more grace
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + int(sig), (proc.returncode, err)
    assert took < 60, took  # far inside the 120 s grace
    assert f"received {sig.name}" in err, err


# ---- examples --------------------------------------------------------------------
def test_example_train_ddp_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "2", "--timeout", "240",
                           str(ROOT / "examples" / "train_ddp.py"), "--epochs", "1",
                           "--batch", "256"],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accs = [float(a) for a in re.findall(r"held-out accuracy ([0-9.]+\d)", proc.stdout)]
    assert len(accs) == 2, proc.stdout  # DDP and the one-process check
    assert accs[0] == accs[1] and accs[0] > 0.3, proc.stdout  # chance is 0.1


# ---- the interface: RINGLET_IFNAME through init(); a multi-host job never binds loopback ----
def _bind_and_sum(rank, P):
    x = np.full(3, rank + 1.0)
    ringlet.all_reduce(x, timeout=60)
    return ringlet.get_bind_address(), x.tolist()


def test_ifname_through_init_picks_the_listening_interface(monkeypatch):
    from ringlet.environment import list_interfaces

    monkeypatch.setenv("RINGLET_IFNAME", "=lo")
    assert run_world(_bind_and_sum, 2, mode="thread", timeout=60) == [("127.0.0.1", [3.0] * 3)] * 2
    # this host's own non-loopback address, where there is one: the bytes never leave the host
    other = [(name, addr) for name, addr in list_interfaces() if not addr.startswith("127.")]
    if other:
        name, addr = other[0]
        monkeypatch.setenv("RINGLET_IFNAME", "=" + name)
        assert run_world(_bind_and_sum, 2, mode="thread", timeout=60) == [(addr, [3.0] * 3)] * 2
    monkeypatch.setenv("RINGLET_IFNAME", "=no-such-interface")
    with pytest.raises(WorldError, match="matches no interface .*interfaces seen: lo=127.0.0.1"):
        run_world(_bind_and_sum, 2, mode="thread", timeout=60)


def test_a_multi_host_job_never_falls_back_to_loopback():
    # The master is another address than loopback while the interface chosen is lo: init
    # refuses at once instead of advertising an address the other hosts cannot reach.
    probe = textwrap.dedent("""
        import sys, ringlet
        try:
            ringlet.init(rank=1, world_size=2, master_addr=sys.argv[1], master_port=9, timeout=60)
        except ringlet.RendezvousError as exc:
            print("refused:", exc)
    """)
    out = subprocess.run([sys.executable, "-c", probe, "192.0.2.77"], capture_output=True,
                         text=True, timeout=60,
                         env=_env(RINGLET_IFNAME="=lo", RINGLET_SECRET="ab" * 16))
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "selects loopback interface lo" in out.stdout, out.stdout
    assert "the master 192.0.2.77 is another host" in out.stdout, out.stdout


# ---- the watcher: a rank that shares no connection with the failed one stops too ----------
def _watched(rank, P):
    pair = ringlet.new_group([1, 2])
    t0 = time.monotonic()
    try:
        if rank == 2:
            pair.all_reduce(np.ones(4), timeout=2)  # rank 1 never joins it
        else:  # ranks 0 and 1 wait on each other, with nothing to do with rank 2
            ringlet.recv(np.empty(1), src=1 - rank, timeout=120)
    except ringlet.RingletError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0, exc.peer
    return "no error", "", time.monotonic() - t0, None


def test_the_watcher_stops_ranks_not_connected_to_the_failed_one():
    res = run_world(_watched, 3, mode="thread", timeout=180)
    assert res[2][0] == "CollectiveTimeout", res
    # The store's abort record, not their own 120 s deadline, ended the waits: the first of
    # ranks 0 and 1 to read it names rank 2; the other may instead see that one close.
    assert any("rank 2 failed" in res[r][1] and "timed out" in res[r][1] for r in (0, 1)), res
    for rank in (0, 1):
        kind, msg, took, peer = res[rank]
        assert "rank 2 failed" in msg or (kind == "PeerClosedError" and f"peer {1 - rank}" in msg), res
        assert took < 100, res
        # The error's peer is the rank whose failure stopped this one.
        assert peer == (2 if msg.startswith(f"rank {rank}: rank 2 failed") else 1 - rank), res
