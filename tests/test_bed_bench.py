"""bench/bed_bench.py's pieces that time nothing: arguments, the bound, verdicts, tables.

The measurement itself (a HostBed, real ranks, Open MPI) is a benchmark, run by
hand (docs/benchmarks.md, "Across hosts (test bed)"); these tests pin the
arithmetic its verdicts rest on and the job hook it starts ranks through.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from ringlet import _costmodel as cm
from ringlet.bench import launch
from ringlet.bench.sweep import ROW_PREFIX


def _bb():
    # bench/ is not installed: the repository's copy, next to tests/.
    path = Path(__file__).resolve().parents[1] / "bench" / "bed_bench.py"
    spec = importlib.util.spec_from_file_location("bed_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bb = _bb()


def test_layouts_and_systems_parse_and_reject_bad_items():
    assert bb.parse_layouts("2x1,2x2,4x1,4x2") == [(2, 1), (2, 2), (4, 1), (4, 2)]
    assert bb.parse_layouts(" 3x5 ") == [(3, 5)]
    for bad in ("2", "2x", "x2", "1x4", "2x0", "2x2,", "2*2"):
        with pytest.raises(ValueError, match="layout"):
            bb.parse_layouts(bad)
    assert bb.parse_systems("hier, flat,hier") == ["hier", "flat"]
    with pytest.raises(ValueError, match="choose from"):
        bb.parse_systems("flat,nccl")
    with pytest.raises(ValueError):
        bb.parse_systems(" , ")


def test_parse_args_defaults_ops_and_usage_errors(capsys):
    a = bb.parse_args([])
    assert a.layouts == [(2, 1), (2, 2), (4, 1), (4, 2)] and a.ops == ["all_reduce"]
    assert a.systems == ["flat", "hier", "auto", "mpi-tcp"] and a.rounds == 5
    assert a.sizes[0] == 8 and a.sizes[-1] == 64 << 20
    a = bb.parse_args(["--ops", "hier", "-b", "1K", "-e", "1M", "-f", "32"])
    assert a.ops == list(cm.OPS) and a.sizes == [1024, 32768, 1 << 20]
    assert a.ringlet_env == {}
    a = bb.parse_args(["--ringlet-env", "RINGLET_SPIN_US=200", "--ringlet-env",
                       "RINGLET_BCAST_FLAT_BYTES=1=2"])
    assert a.ringlet_env == {"RINGLET_SPIN_US": "200", "RINGLET_BCAST_FLAT_BYTES": "1=2"}
    for argv, what in ((["--ops", "all_reduce,allreduce"], "allreduce"),
                       (["--ringlet-env", "SPIN_US=1"], "RINGLET_NAME=VALUE"),
                       (["--ringlet-env", "RINGLET_SPIN_US"], "RINGLET_NAME=VALUE"),
                       (["--layouts", "1x2"], "layout"), (["--rounds", "0"], "rounds"),
                       (["--batch", "0"], "batch"),
                       (["-b", "1M", "-e", "1K"], "smaller")):
        with pytest.raises(SystemExit) as exc:
            bb.parse_args(argv)
        assert exc.value.code == 2
        assert what in capsys.readouterr().err


def test_every_system_gets_the_same_sweeps_with_the_batch():
    a = bb.parse_args(["--ops", "all_reduce,broadcast", "-b", "8", "-e", "64", "--batch", "20",
                       "-i", "7"])
    sweeps = json.loads(bb.sweep_payload(a, 4))["sweeps"]
    assert [s["op"] for s in sweeps] == ["all_reduce", "broadcast"]
    assert all(s["batch"] == 20 and s["iters"] == 7 and s["sizes"] == [8, 64] for s in sweeps)
    assert json.loads(bb.sweep_payload(bb.parse_args([]), 4))["sweeps"][0]["batch"] == 1


def test_hier_bound_is_the_issue_formula():
    R = 0.1175
    # 2x2: 2(P-1)/P = 1.5 over 2(H-1)/H = 1: 1.5 R; 4x2: 1.75 / 1.5.
    assert bb.hier_bound(R, 2, 4) == pytest.approx(1.5 * R)
    assert bb.hier_bound(R, 4, 8) == pytest.approx(R * 1.75 / 1.5)
    # One rank per host: the hierarchy is the flat ring, bound R.
    assert bb.hier_bound(R, 2, 2) == pytest.approx(R)
    assert bb.hier_bound(R, 4, 4) == pytest.approx(R)
    assert bb.flat_bound(R, 4, 8) == R
    with pytest.raises(ValueError):
        bb.hier_bound(R, 1, 4)


def _row(system, size, time_us, busbw, op="all_reduce"):
    return {"system": system, "op": op, "size": size, "time_us": time_us, "busbw": busbw}


def test_verdicts_judge_big_sizes_and_every_size_against_mpi():
    R, big = 0.12, 64 << 20
    bound = bb.hier_bound(R, 2, 4)  # 0.18
    rows = [_row("hier", big, 100.0, 0.86 * bound), _row("flat", big, 150.0, 0.10),
            _row("auto", big, 100.0, 0.86 * bound), _row("mpi-tcp", big, 99.0, 0.1),
            _row("hier", 8, 50.0, 0.0), _row("flat", 8, 40.0, 0.0),
            _row("auto", 8, 40.0, 0.0), _row("mpi-tcp", 8, 80.0, 0.0)]
    v = {(x["check"], x["size"]): x for x in bb.verdicts(rows, R, 2, 4)}
    assert set(v) == {("hier/bound", big), ("hier/flat", big), ("mpi/auto time", big),
                      ("mpi/auto time", 8)}  # bound and flat ratio only at >= 64 MiB
    assert v[("hier/bound", big)]["ok"] and v[("hier/bound", big)]["value"] == pytest.approx(0.86)
    assert v[("hier/flat", big)]["value"] == pytest.approx(0.86 * bound / 0.10)
    assert v[("hier/flat", big)]["ok"]  # 1.548 >= 1.4
    assert not v[("mpi/auto time", big)]["ok"]  # mpi 99 us < auto 100 us
    assert v[("mpi/auto time", 8)]["ok"] and v[("mpi/auto time", 8)]["value"] == 2.0
    rows[0]["busbw"], rows[1]["busbw"] = 0.84 * bound, 0.12  # 1.26x flat
    v = {(x["check"], x["size"]): x for x in bb.verdicts(rows, R, 2, 4)}
    assert not v[("hier/bound", big)]["ok"] and not v[("hier/flat", big)]["ok"]


def test_model_rows_compare_the_cost_model_with_measurements():
    m = cm.ModelParams()
    n = 4 << 20
    flat = cm.predict("all_reduce", n, [2, 2], m)["flat"]
    hier = cm.predict("all_reduce", n, [2, 2], m)["hier"]
    rows = [_row("flat", n, flat * 1e6 / 2, 0.1), _row("hier", n, hier * 1e6, 0.1),
            _row("auto", n, 1.0, 0.1), _row("mpi-tcp", n, 1.0, 0.1),
            _row("hier", 8, 10.0, 0.0), _row("flat", n, 1.0, 0.1, op="all_to_all")]
    out = bb.model_rows(rows, m, 2, 2)
    assert [(r["form"], r["size"]) for r in out] == [("flat", n), ("hier", n), ("hier", 8)]
    assert out[0]["err"] == pytest.approx(1.0) and out[1]["err"] == pytest.approx(0.0)
    assert [r["judged"] for r in out] == [True, True, False]
    # Hosts of one rank: the hierarchical broadcast applies (root local 0).
    assert len(bb.model_rows([_row("hier", n, 1.0, 0.1, op="broadcast")], m, 2, 1)) == 1
    text = bb.format_model(2, 2, out)
    assert "+100.0% MISS" in text and "+0.0% ok" in text


def test_format_layout_prints_systems_bound_and_verdicts():
    R = 0.12
    link = {"rate": "1gbit", "tcp_one_way": R, "tcp_both_ways": 0.11,
            "rtt_us": {"blocking_1pair": 40.0}}
    big = 64 << 20
    rows = []
    for s, t, bw in (("flat", 900e3, 0.112), ("hier", 600e3, 0.168), ("auto", 600e3, 0.168),
                     ("mpi-tcp", 1200e3, 0.08)):
        rows.append(dict(_row(s, big, t, bw), algbw=bw / 1.5))
    text = bb.format_layout(2, 2, rows, bb.SYSTEMS, link, 5, [1.0, 2.5])
    assert "2x2 (4 ranks)" in text and "R = 0.1200 GB/s" in text and "1.0-2.5" in text
    assert "= 0.1800 GB/s" in text  # 1.5 R
    assert "hier/bound at   64M: 0.933 (target >= 0.85) PASS" in text
    assert "hier/flat at   64M: 1.500 (target >= 1.4) PASS" in text
    assert "auto faster than mpi-tcp at 1 of 1 sizes (smallest margin 2.00x at 64M)" in text
    for s in bb.SYSTEMS:
        assert s in text


def test_run_commands_starts_each_process_through_the_callers_hook(tmp_path):
    # The hook bed_bench starts bed ranks with: here a local start function
    # that records what it was given; the first process reports the rows.
    rec = {"kind": "row", "op": "all_reduce", "size": 8, "time_us": 1.0}
    report_src = (f"print({ROW_PREFIX!r} + {json.dumps(json.dumps(rec))}); "
                  f"print({ROW_PREFIX!r} + {json.dumps(json.dumps({'kind': 'done'}))})")
    seen = []

    def start(argv, env, **kw):
        import subprocess

        from ringlet.run import own_process_group
        seen.append((argv[-1], env["MARK"]))
        return subprocess.Popen(argv, env=env, **kw, **own_process_group())

    cmds = [("rank 0", [sys.executable, "-c", report_src], {"MARK": "a"}, start),
            ("rank 1", [sys.executable, "-c", "pass"], {"MARK": "b"}, start)]
    res = launch.run_commands("demo", cmds, timeout=120)
    assert res.rows == [rec] and [m for _, m in seen] == ["a", "b"]
    cmds[1] = ("rank 1", [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); "
                          "sys.exit(3)"], {"MARK": "b"}, None)
    with pytest.raises(launch.LaunchError, match="boom"):
        launch.run_commands("demo", cmds, timeout=120)
    with pytest.raises(ValueError):
        launch.run_commands("demo", [], timeout=1)


def test_settle_waits_for_the_last_jobs_processes_within_its_limit(monkeypatch):
    # A process whose command line names an Open MPI daemon stands for the last
    # job's leftovers: settle waits for it, up to its limit, and not once it is gone.
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); "
                              "sys.stdin.read()", "prted"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"up\n"  # past exec: its command line is its own
        assert child.pid in bb.leftover_jobs()
        waited = bb.settle(limit_s=0.3, idle=0.0)
        assert 0.3 <= waited < 30
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert child.pid not in bb.leftover_jobs()
    # Nothing left (other tests' daemons aside) and any idle share will do: one window.
    monkeypatch.setattr(bb, "leftover_jobs", lambda: [])
    assert bb.settle(limit_s=30, idle=0.0) < 30
    assert 0.0 <= bb.cpu_idle(0.05) <= 1.0
