"""The tuning knobs are declared once (RL_TUNING_KNOBS in csrc/ringlet.h); the binding, the
RINGLET_* variables and docs/algorithms.md's table must all agree with that table."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringlet import _core, _world

DOCS = Path(__file__).resolve().parent.parent / "docs" / "algorithms.md"
MARK = "<!-- knobs: generated from RL_TUNING_KNOBS; tests/test_knobs.py checks it -->"


def _size(v):
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if v >= 1 << shift and v % (1 << shift) == 0:
            return f"{v >> shift} {unit}"
    return str(v)


def knob_table():
    """The Markdown table docs/algorithms.md must hold under MARK."""
    rows = ["| knob | environment variable | default | meaning |", "|---|---|---|---|"]
    for k in _core.knobs():
        env = f"`{k['env']}`" if k["env"] else "—"
        rows.append(f"| `{k['name']}` | {env} | {_size(k['default'])} | {k['doc']} |")
    return "\n".join(rows)


def test_docs_table_is_the_registry():
    text = DOCS.read_text()
    assert MARK in text, "docs/algorithms.md lost its knob table marker"
    lines = text.split(MARK, 1)[1].strip("\n").splitlines()
    got = "\n".join(lines[:len(_core.knobs()) + 2])
    want = knob_table()
    assert got == want, f"docs/algorithms.md's knob table differs from RL_TUNING_KNOBS; it should read:\n{want}"
    # No stray row after the table (a knob removed from the registry but not the docs).
    rest = lines[len(_core.knobs()) + 2:]
    assert not rest or not rest[0].startswith("|"), rest[0]


def test_registry_names_match_get_tuning():
    names = [k["name"] for k in _core.knobs()]
    assert len(set(names)) == len(names)
    assert list(_core.get_tuning()) == names
    envs = [k["env"] for k in _core.knobs() if k["env"]]
    assert len(set(envs)) == len(envs)
    assert all(e.startswith("RINGLET_") and e == "RINGLET_" + n.upper()
               for e, n in ((k["env"], k["name"]) for k in _core.knobs() if k["env"]))


def test_defaults_are_the_live_values_of_a_fresh_process():
    code = "import json; from ringlet import _core; print(json.dumps(_core.get_tuning()))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert json.loads(out) == {k["name"]: k["default"] for k in _core.knobs()}


def test_set_tuning_round_trips_every_knob_and_validates():
    saved = _core.get_tuning()
    try:
        want = {k["name"]: k["default"] + 4096 + i for i, k in enumerate(_core.knobs())}
        _core.set_tuning(**want)
        assert _core.get_tuning() == want
        _core.set_tuning(segment_bytes=1, handshake_ms=1)  # clamped by rl_set_tuning
        got = _core.get_tuning()
        assert (got["segment_bytes"], got["handshake_ms"]) == (4096, 100)
        with pytest.raises(TypeError, match="unknown tuning knob 'segmentbytes'"):
            _core.set_tuning(segmentbytes=1)
        with pytest.raises(ValueError, match="spin_us must be >= 0, got -1"):
            _core.set_tuning(spin_us=-1)
        assert _core.get_tuning()["spin_us"] == want["spin_us"]  # a refused call changes nothing
    finally:
        _core.set_tuning(**saved)


def test_every_env_variable_is_read(monkeypatch):
    with_env = [k for k in _core.knobs() if k["env"]]
    assert _world._TUNING_ENV == {k["env"]: k["name"] for k in with_env}
    for i, k in enumerate(with_env):
        monkeypatch.setenv(k["env"], str(100 + i))
    assert _world._tuning_from_env() == {k["name"]: 100 + i for i, k in enumerate(with_env)}
    monkeypatch.setenv("RINGLET_SPIN_US", "fast")
    with pytest.raises(ValueError, match="RINGLET_SPIN_US must be an integer, got 'fast'"):
        _world._tuning_from_env()


def test_host_busy_follows_other_processes_cpu_time():
    """busy_block's detector: other processes' CPU time while the cores are short reads
    as busy; the same load from the job's own ranks does not; off, never."""
    import time

    def spin(n):
        return [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]

    def wait_for(state, what):
        deadline = time.monotonic() + 60  # windows of 100 ms; the loops must get going
        while _core.host_busy() != state:
            assert time.monotonic() < deadline, what

    n = (os.cpu_count() or 1) + 2
    saved = _core.get_tuning()
    loops = []
    try:
        _core.set_tuning(host_ranks=1, busy_block=1)
        _core.set_host_pids([os.getpid()])
        loops = spin(n)
        wait_for(True, "busy loops beside us never read as a busy host")
        _core.set_tuning(busy_block=0)
        assert not _core.host_busy()
        _core.set_tuning(busy_block=1)
        for p in loops:
            p.kill()
            p.wait()
        loops = []
        wait_for(False, "the host still reads busy after the loops ended")
        # The same loops as this host's own ranks: their CPU time is the job's,
        # so what others used is far below the loops' (the host's background
        # load, if any, is all that is left).
        loops = spin(n)
        _core.set_tuning(host_ranks=n + 1)
        _core.set_host_pids([os.getpid()] + [p.pid for p in loops])
        deadline = time.monotonic() + 60
        while _core.host_others() < 0:  # the first whole window
            assert time.monotonic() < deadline
        cores = min(n, os.cpu_count() or 1)  # what the loops use between them
        assert _core.host_others() < cores / 2, (_core.host_others(), cores)
    finally:
        _core.set_tuning(**saved)
        _core.set_host_pids([])
        for p in loops:
            p.kill()
        for p in loops:
            p.wait()
