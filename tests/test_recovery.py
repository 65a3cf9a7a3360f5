"""Recovery (shutdown() then init() after a failure) under every launcher; world-size
mismatches, missing ranks and port clashes at init (docs/errors.md, docs/launching.md)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import ringlet
from ringlet import _world
from ringlet.errors import RendezvousError
from _launchers import clean_env, openmpi_mpirun

ROUNDS = 20

# Every round: a fresh world must work (an all_reduce checked against its
# oracle), then fail in one of two ways, then shut down:
#  - even rounds, a desync (rank 0 reduces 4 elements, the others 8): every
#    rank raises and the generation's abort record is set;
#  - odd rounds, a straggler: rank 1 reduces alone while the others shut
#    down, so its failure (and abort record) lands in a generation the others
#    have already left, often while they are joining the next one.
# A new world that read an old world's endpoints or abort record fails the
# next round's all_reduce or init.
RECOVER = textwrap.dedent("""
    import json, sys, numpy as np, ringlet
    from ringlet import _world
    rounds = int(sys.argv[1])
    gens, errors = [], set()
    for i in range(rounds):
        ringlet.init(timeout=60)
        r, n = ringlet.get_rank(), ringlet.get_world_size()
        gens.append(_world._current().gen)
        x = np.full(5, r + i, np.float64)
        ringlet.all_reduce(x)
        assert np.all(x == n * (n - 1) / 2 + n * i), (i, x)
        # Everyone has its result before anyone fails: otherwise this round's
        # failure could legitimately cancel a slow rank's all_reduce above.
        w = _world._current()
        w.store.set(f"{w.prefix}test/done/{r}", b"")
        w.store.wait([f"{w.prefix}test/done/{q}" for q in range(n)], timeout=60)
        if i % 2 == 0:
            y = np.ones(4 if r == 0 else 8, np.float32)
            try:
                ringlet.all_reduce(y)
                raise SystemExit(f"round {i}: a desynced all_reduce did not fail")
            except ringlet.RingletError as exc:
                errors.add(type(exc).__name__)
        elif r == 1:
            try:
                ringlet.all_reduce(np.ones(3, np.float32))
                raise SystemExit(f"round {i}: an all_reduce without peers did not fail")
            except ringlet.RingletError as exc:
                errors.add(type(exc).__name__)
        ringlet.shutdown()
    print("RECOVERED", r, json.dumps(gens, separators=(",", ":")), ",".join(sorted(errors)),
          flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_recovered(stdout: str, n: int, gens) -> None:
    lines = sorted(l[l.index("RECOVERED"):] for l in stdout.splitlines() if "RECOVERED" in l)
    assert len(lines) == n, stdout
    for r, line in enumerate(lines):
        _tag, rank, got, errors = line.split(" ")
        assert int(rank) == r
        assert json.loads(got) == list(gens), line
        assert set(errors.split(",")) <= {"DesyncError", "PeerClosedError", "CollectiveTimeout"}, line


def test_recovery_loop_under_ringlet_run(tmp_path):
    script = tmp_path / "recover.py"
    script.write_text(RECOVER)
    out = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "3", "--timeout", "120",
                          str(script), str(ROUNDS)], env=clean_env(), capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    # The launcher's store outlives every world: generations 1..ROUNDS.
    _check_recovered(out.stdout, 3, range(1, ROUNDS + 1))


def test_recovery_loop_under_torchrun_variables(tmp_path):
    script = tmp_path / "recover.py"
    script.write_text(RECOVER)
    for _attempt in range(3):
        port = _free_port()
        procs = [subprocess.Popen(
            [sys.executable, str(script), str(ROUNDS)],
            env=clean_env(RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), RINGLET_SECRET="recovery-test-secret-0123456789"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
        outs = [p.communicate(timeout=180) for p in procs]
        if not any("Address already in use" in e for _, e in outs):
            break
    assert all(p.returncode == 0 for p in procs), outs
    # Rank 0 keeps its store across shutdown()/init(): generations 1..ROUNDS.
    _check_recovered("".join(o for o, _ in outs), 3, range(1, ROUNDS + 1))


def test_recovery_loop_under_mpirun(tmp_path):
    script = tmp_path / "recover.py"
    script.write_text(RECOVER)
    env = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    out = subprocess.run([openmpi_mpirun(), "-n", "3", "--oversubscribe", sys.executable, str(script),
                          str(ROUNDS)], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    # Every init bootstraps a fresh store over MPI: always generation 1.
    _check_recovered(out.stdout, 3, [1] * ROUNDS)


# ---- init-time checks, ranks as threads ------------------------------------------------------
SECRET = b"recovery-test-secret-0123456789"


def _init_threads(specs, after=None, timeout=60.0, prepare=None):
    """Run ``init(**spec)`` (then ``after()``) on one thread per spec against one store
    (``prepare(store_client)`` first).

    Returns ({index: exception or result}, {index: seconds until it returned}).
    """
    from ringlet.store import Store, StoreServer

    out, took = {}, {}
    with StoreServer("127.0.0.1", 0, secret=SECRET) as srv:
        if prepare is not None:
            with Store("127.0.0.1", srv.port, secret=SECRET, timeout=10) as st:
                prepare(st)
        def body(i, spec):
            _world._scope_thread()
            t0 = time.monotonic()
            try:
                _world.init(master_addr="127.0.0.1", master_port=srv.port, secret=SECRET,
                            timeout=timeout, _external_store=True, **spec)
                out[i] = after() if after else None
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                out[i] = exc
            finally:
                took[i] = time.monotonic() - t0
                _world.shutdown()

        threads = [threading.Thread(target=body, args=(i, s), daemon=True)
                   for i, s in enumerate(specs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 30)
        assert not any(t.is_alive() for t in threads), "a rank is still in init"
    return out, took


@pytest.mark.parametrize("sizes", [(2, 3), (3, 2)])
def test_world_size_mismatch_fails_every_rank_at_init(sizes):
    out, took = _init_threads([dict(rank=r, world_size=n) for r, n in enumerate(sizes)])
    for r in range(2):
        exc = out[r]
        assert isinstance(exc, RendezvousError), (r, exc)
        assert "world size mismatch" in str(exc) and "world size 2" in str(exc) \
            and "world size 3" in str(exc), exc
        assert took[r] < 20, took  # not the 60 s init timeout


def test_a_rank_beyond_rank_0s_world_fails_at_init_and_stops_that_world():
    def until_failure():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ringlet.barrier()
            except ringlet.RingletError as exc:
                return exc
        return None

    out, took = _init_threads([dict(rank=0, world_size=2), dict(rank=1, world_size=2),
                               dict(rank=2, world_size=3)], after=until_failure)
    assert isinstance(out[2], RendezvousError), out[2]
    assert "rank 2 has world size 3 but rank 0 has world size 2" in str(out[2])
    assert took[2] < 20, took
    # Their world formed, then rank 2's abort record stopped it.  Each of ranks 0
    # and 1 reads the record, or first sees the other close its sockets (having
    # read it): either way its error names the first failure.
    for r in (0, 1):
        assert isinstance(out[r], ringlet.RingletError), (r, out[r])
        assert "world size mismatch" in str(out[r]), (r, out[r])
        if isinstance(out[r], ringlet.PeerClosedError):
            assert f"peer {1 - r}" in str(out[r]) and "rank 2 failed" in str(out[r]), out[r]


def test_init_world_size_against_the_launchers_fails_at_once(monkeypatch):
    monkeypatch.setenv("RINGLET_RANK", "0")
    monkeypatch.setenv("RINGLET_WORLD_SIZE", "2")
    monkeypatch.setenv("RINGLET_MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RINGLET_MASTER_PORT", "1")
    with pytest.raises(ValueError, match=r"init\(world_size=3\) but the launcher \(ringlet\) "
                                         r"started 2 ranks"):
        ringlet.init(world_size=3, timeout=60)
    assert not ringlet.is_initialized()


def test_missing_ranks_are_named_while_waiting(monkeypatch, caplog):
    monkeypatch.setenv("RINGLET_JOIN_WARN_S", "0.2")
    caplog.set_level(logging.WARNING, logger="ringlet")
    out, took = _init_threads([dict(rank=0, world_size=3), dict(rank=1, world_size=3)],
                              timeout=3.0)
    for r in (0, 1):
        assert isinstance(out[r], RendezvousError), out[r]
        assert "ranks [2] (rank 2 has not called init() yet) never joined" in str(out[r])
    warned = {rec.getMessage() for rec in caplog.records if rec.name == "ringlet"}
    for r in (0, 1):
        mine = [m for m in warned if m.startswith(f"ringlet: rank {r} waited")]
        assert mine, warned
        assert all("for ranks [2] (rank 2 has not called init() yet) to join (world size 3, "
                   "generation 1)" in m for m in mine), mine


def test_a_rank_in_another_generation_is_named(monkeypatch, caplog):
    # Rank 1 has called init() twice against this store (its first try failed,
    # say) while rank 0 calls it for the first time: they can never meet.
    monkeypatch.setenv("RINGLET_JOIN_WARN_S", "0.2")
    caplog.set_level(logging.WARNING, logger="ringlet")
    out, _ = _init_threads([dict(rank=0, world_size=2)], timeout=2.0,
                           prepare=lambda st: st.add(_world.GEN_KEY.format(1), 2))
    why = "rank 1 is already in generation 2: ranks called init() a different number of times"
    assert isinstance(out[0], RendezvousError) and why in str(out[0]), out[0]
    assert any(why in rec.getMessage() for rec in caplog.records), caplog.records


def test_join_warning_interval_must_be_a_positive_number(monkeypatch):
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv("RINGLET_JOIN_WARN_S", bad)
        with pytest.raises(ValueError, match="RINGLET_JOIN_WARN_S"):
            _world._join_warn_interval()


# ---- a foreign program on MASTER_PORT ----------------------------------------------------------
@pytest.fixture
def foreign_listener():
    """A listener that accepts connections (the kernel completes them) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


def test_rank_1_reports_a_foreign_listener_as_not_a_store(foreign_listener, monkeypatch):
    from ringlet.store import client as storemod

    monkeypatch.setattr(storemod, "_SILENT_S", 0.5)  # the real window is 5 s
    out, took = [], []

    def rank1():
        _world._scope_thread()
        t0 = time.monotonic()
        try:
            _world.init(rank=1, world_size=2, master_addr="127.0.0.1",
                        master_port=foreign_listener, secret=SECRET, timeout=60)
        except BaseException as exc:  # noqa: BLE001
            out.append(exc)
        finally:
            took.append(time.monotonic() - t0)
            _world.shutdown()

    t = threading.Thread(target=rank1, daemon=True)
    t.start()
    t.join(90)
    assert not t.is_alive()
    exc = out[0]
    assert isinstance(exc, RendezvousError), exc
    assert f"127.0.0.1:{foreign_listener}" in str(exc) and "not a ringlet store" in str(exc)
    assert took[0] < 30, took  # well before the 60 s timeout


def test_rank_0_reports_that_another_process_holds_the_port(foreign_listener):
    with pytest.raises(RendezvousError, match=rf"cannot serve the store on 127.0.0.1:"
                                              rf"{foreign_listener}: .*another process holds"):
        ringlet.init(rank=0, world_size=2, master_addr="127.0.0.1",
                     master_port=foreign_listener, secret=SECRET, timeout=60)
    assert not ringlet.is_initialized()
