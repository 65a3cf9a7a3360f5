"""Node-aware (hierarchical) collectives on hosts simulated on loopback, the chooser
and the cost model's arithmetic.

Hosts are simulated with per-rank host ids (``run_world(host_ids=...)``, the
thread-mode form of ``RINGLET_HOST_ID``).  Every rank checks its own result
against the numpy oracle and returns a digest, so the tests also prove that
every rank ends with the same bits.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import time

import numpy as np
import pytest

import ringlet
from ringlet import ReduceOp, _core, _hier
from ringlet import _costmodel as cm
from ringlet.testing import run_world

from _oracle import DTYPES, close, data, ops_for, reduce_np, same

LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "2x2-interleaved": ["a", "b", "a", "b"],
    "3x1": ["a", "b", "c"],
    "2x3": ["a", "a", "a", "b", "b", "b"],
    "3+1": ["a", "a", "a", "b"],
    "2+1+2": ["a", "a", "b", "c", "c"],
}


@pytest.fixture
def small_segments():
    # Small thresholds: a few thousand elements take the pipelined algorithms
    # with several segments in every phase.
    # and all_reduce's hierarchical form runs pipelined over 4 KiB slices.
    saved = _core.get_tuning()
    _core.set_tuning(segment_bytes=4096, allreduce_small_bytes=256, bcast_small_bytes=256,
                     reduce_small_bytes=256)
    slice_bytes, share = _hier.SLICE_BYTES, _hier.SLICE_LATENCY_SHARE
    _hier.SLICE_BYTES, _hier.SLICE_LATENCY_SHARE = 4096, 0.0
    yield
    _hier.SLICE_BYTES, _hier.SLICE_LATENCY_SHARE = slice_bytes, share
    _core.set_tuning(**saved)


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _matrix(rank, P, all_dtypes, counts):
    """Every hierarchical op against the oracle; returns (failures, digest of results)."""
    bad, outs = [], []
    g = ringlet._world._require(None)

    def check(name, got, want, op=ReduceOp.SUM, shared=True):
        if not close(got, want, op):
            bad.append(f"rank {rank}: {name}: got {got[:6]} want {want[:6]}")
        if shared:  # a result every rank holds: its bits go into the digest
            outs.append(got)

    def moved(name, got, want):
        if not same(got, want):
            bad.append(f"rank {rank}: {name}: got {got[:6]} want {want[:6]}")
        outs.append(got)

    for dt in all_dtypes:
        dt = np.dtype(dt)
        for n in counts:
            for op in ops_for(dt):
                ins = [data(r, n, dt, op) for r in range(P)]
                x = ins[rank].copy()
                ringlet.all_reduce(x, op)
                check(f"all_reduce {dt} {op.name} n={n}", x, reduce_np(ins, op, dt), op)
    for dt in (np.float32, np.int64, np.float16):
        dt = np.dtype(dt)
        for n in counts:
            for op in (ReduceOp.SUM, ReduceOp.MAX) + ((ReduceOp.AVG,) if dt.kind == "f" else ()):
                ins = [data(r, n, dt, op, salt=1) for r in range(P)]
                want = reduce_np(ins, op, dt)
                for root in range(P):
                    x = ins[rank].copy()
                    ringlet.reduce(x, root, op)
                    if rank == root:
                        check(f"reduce {dt} {op.name} n={n} root={root}", x, want, op,
                              shared=False)
                    elif not same(x, ins[rank]):
                        bad.append(f"rank {rank}: reduce root={root} changed a non-root buffer")
                # reduce_scatter: block n per rank
                full = [data(r, n * P, dt, op, salt=2) for r in range(P)]
                out = np.empty(n, dt)
                inp = full[rank].copy()
                ringlet.reduce_scatter(out, inp, op)
                check(f"reduce_scatter {dt} {op.name} n={n}", out,
                      reduce_np(full, op, dt)[rank * n:(rank + 1) * n], op, shared=False)
                if not same(inp, full[rank]):
                    bad.append(f"rank {rank}: reduce_scatter changed its input")
            for root in range(P):
                src = data(root, n, dt, salt=3)
                x = src.copy() if rank == root else np.zeros(n, dt)
                ringlet.broadcast(x, root)
                moved(f"broadcast {dt} n={n} root={root}", x, src)
            blocks = [data(r, n, dt, salt=4) for r in range(P)]
            out = np.zeros(n * P, dt)
            ringlet.all_gather(out, blocks[rank])
            moved(f"all_gather {dt} n={n}", out, np.concatenate(blocks))
            # in place: the input is this rank's block of the output
            out = np.zeros(n * P, dt)
            out[rank * n:(rank + 1) * n] = blocks[rank]
            ringlet.all_gather(out, out[rank * n:(rank + 1) * n])
            moved(f"all_gather in place {dt} n={n}", out, np.concatenate(blocks))
    # A 2-d array and an asynchronous op take the same path.
    x = np.full((3, 5), rank + 1, np.float64)
    w = ringlet.all_reduce(x, async_op=True)
    w.wait()
    check("all_reduce 2-d async", x, np.full((3, 5), P * (P + 1) / 2))
    h = g._hier
    return bad, _digest(*outs), (h is not None and h.intra is not None)


def _run(layout, algo, monkeypatch, all_dtypes=DTYPES, counts=(1, 2, 7, 3001)):
    monkeypatch.setenv("RINGLET_ALGO", algo)
    ids = LAYOUTS[layout]
    res = run_world(_matrix, len(ids), timeout=120, args=(all_dtypes, counts), host_ids=ids)
    for bad, _d, _used in res:
        assert not bad, "\n".join(bad[:20])
    assert len({d for _b, d, _u in res}) == 1, "ranks ended with different bits"
    return [u for _b, _d, u in res]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_hier_op_matches_the_oracle_forced(layout, monkeypatch, small_segments):
    used = _run(layout, "hier", monkeypatch)
    assert all(used), "RINGLET_ALGO=hier did not create the intra/inter-host groups"


@pytest.mark.parametrize("layout", ["2x2", "2+1+2"])
def test_auto_matches_the_oracle_and_flat_is_flat(layout, monkeypatch, small_segments):
    _run(layout, "auto", monkeypatch, all_dtypes=[np.float32, np.int32], counts=(3, 5000))
    used = _run(layout, "flat", monkeypatch, all_dtypes=[np.float32], counts=(5,))
    assert not any(used)


def _flat_rooted(rank, P, sizes):
    # Every root and size over TCP between hosts; the comm knows the hosts.
    g = ringlet._world._require(None)
    bad = []
    for n in sizes:
        for root in range(P):
            src = data(root, n, np.int32, salt=7)
            x = src.copy() if rank == root else np.zeros(n, np.int32)
            ringlet.broadcast(x, root)
            if not same(x, src):
                bad.append(f"rank {rank}: broadcast n={n} root={root}: got {x[:4]}")
            for dt, op in ((np.int32, ReduceOp.SUM), (np.float64, ReduceOp.AVG),
                           (np.float32, ReduceOp.MAX)):
                ins = [data(r, n, dt, op, salt=8) for r in range(P)]
                x = ins[rank].copy()
                ringlet.reduce(x, root, op)
                if rank == root and not close(x, reduce_np(ins, op, np.dtype(dt)), op):
                    bad.append(f"rank {rank}: reduce {op.name} n={n} root={root}: got {x[:4]}")
                if rank != root and not same(x, ins[rank]):
                    bad.append(f"rank {rank}: reduce n={n} root={root} changed its input")
    hosts = g._coll.num_hosts
    for wrong in ([0] * (P + 1), [0] * (P - 1) + [P]):  # a length, a host number
        try:
            g._coll.set_hosts(wrong)
            bad.append(f"rank {rank}: set_hosts({wrong}) was accepted")
        except ValueError as exc:
            if "set_hosts" not in str(exc):
                bad.append(f"rank {rank}: set_hosts({wrong}): {exc}")
    if g._coll.num_hosts != hosts:
        bad.append(f"rank {rank}: a refused set_hosts changed the hosts to {g._coll.num_hosts}")
    return bad, g._coll.transport, hosts


@pytest.mark.parametrize("ids", [
    "aabb", "abab", "aaaaabbbb", "abcdef", "aabbbbbcd",
], ids=["2x2", "2x2-interleaved", "5+4", "6x1", "2+5+1+1"])
def test_flat_rooted_ops_across_hosts_run_the_hosts_tree(ids, monkeypatch):
    # bcast.c's tree across hosts, which reduce.c runs backwards (one copy per host
    # link; its shape is checked in tests/c/test_bcast_tree.c): 4 bytes take the flat
    # shape up to 4 ranks, 40 the hosts' tree, 400 the chain.
    monkeypatch.setenv("RINGLET_ALGO", "flat")
    monkeypatch.setenv("RINGLET_BCAST_FLAT_BYTES", "16")
    monkeypatch.setenv("RINGLET_BCAST_SMALL_BYTES", "256")
    monkeypatch.setenv("RINGLET_REDUCE_SMALL_BYTES", "256")
    saved = _core.get_tuning()  # the ranks are threads here: init() sets these knobs
    try:
        res = run_world(_flat_rooted, len(ids), timeout=120, args=((1, 10, 100),),
                        host_ids=list(ids))
    finally:
        _core.set_tuning(**saved)
    for bad, transport, hosts in res:
        assert not bad, "\n".join(bad[:20])
        assert (transport, hosts) == ("tcp", len(set(ids)))


def _hier_equals_flat(rank, P):
    # Same input, both algorithms on the same world: equal to the oracle's
    # tolerance, and AVG scaled once as the flat form does.
    g = ringlet._world._require(None)
    got = {}
    for algo in ("flat", "hier"):
        g._hier.algo = algo if algo == "hier" else "auto"
        g._hier._cache.clear()
        x = (np.arange(4099, dtype=np.float32) * 0.37 + rank).astype(np.float32)
        if algo == "flat":
            saved, g._hier = g._hier, None
            ringlet.all_reduce(x, ReduceOp.AVG)
            g._hier = saved
        else:
            ringlet.all_reduce(x, ReduceOp.AVG)
        got[algo] = x
    want = np.mean([(np.arange(4099) * 0.37 + r) for r in range(P)], axis=0)
    tol = 8 * 2.0 ** -24
    ok = all(np.all(np.abs(v - want) <= tol * np.abs(want) + 1e-6) for v in got.values())
    return ok, _digest(got["hier"])


def _pipelined_rank(rank, P):
    calls = []
    real = _hier._Hier._pipelined
    h = ringlet._world._require(None)._hier
    h._pipelined = lambda *a: (calls.append(len(a[1])), real(h, *a))[1]
    n = 3 * 1024 + 1  # 4 KiB slices of int64 over 2 local ranks: 256 per block, a tail
    x = (np.arange(n, dtype=np.int64) * 7 + rank) % 1000
    ringlet.all_reduce(x)
    want = sum((np.arange(n, dtype=np.int64) * 7 + r) % 1000 for r in range(P))
    y = np.full(100, rank + 1.5, np.float32)  # one slice: not pipelined
    ringlet.all_reduce(y)
    return calls, bool(np.array_equal(x, want)), float(y[0])


def test_pipelined_all_reduce_runs_its_slices_and_matches_numpy(monkeypatch, small_segments):
    monkeypatch.setenv("RINGLET_ALGO", "hier")
    res = run_world(_pipelined_rank, 4, timeout=60, host_ids=LAYOUTS["2x2"])
    for calls, exact, y in res:
        # 1536 elements per local rank in blocks of 256: 6 slices; the last element goes flat.
        assert calls == [6] and exact and y == 1.5 * 4 + 6


def test_hier_equals_flat_within_the_oracles_tolerance(monkeypatch):
    monkeypatch.setenv("RINGLET_ALGO", "hier")
    res = run_world(_hier_equals_flat, 4, timeout=60, host_ids=LAYOUTS["2x2"])
    assert all(ok for ok, _ in res)
    assert len({d for _, d in res}) == 1


def _subgroups(rank, P):
    bad = []
    # Ranks 0, 1 share host a, rank 3 is on b: an uneven group that spans hosts.
    sub = ringlet.new_group([0, 1, 3])
    cross = ringlet.new_group([1, 2])
    if rank in (0, 1, 3):
        t = sub.topology
        if (t.num_hosts, list(t.ranks_per_host)) != (2, [2, 1]):
            bad.append(f"rank {rank}: sub topology {t}")
        members = [0, 1, 3]
        for n in (1, 1000):
            x = data(rank, n, np.int32, salt=5)
            sub.all_reduce(x)
            want = reduce_np([data(r, n, np.int32, salt=5) for r in members], ReduceOp.SUM,
                             np.int32)
            if not close(x, want, ReduceOp.SUM):
                bad.append(f"rank {rank}: sub all_reduce n={n}")
            y = np.arange(n, dtype=np.float64) if sub.rank == 2 else np.zeros(n)
            sub.broadcast(y, 2)  # the root is the lone rank of host b
            if not same(y, np.arange(n, dtype=np.float64)):
                bad.append(f"rank {rank}: sub broadcast n={n}")
        if sub._hier is None or sub._hier.intra is None:
            bad.append(f"rank {rank}: the spanning sub-group ran flat")
    else:
        if sub.rank != -1 or sub.topology.host != -1:
            bad.append(f"rank {rank}: non-member handle {sub.topology}")
    if rank in (1, 2):
        x = np.full(64, rank, np.float32)
        cross.all_reduce(x)
        if not np.all(x == 3):
            bad.append(f"rank {rank}: one-rank-per-host group")
    return bad


def test_subgroups_spanning_hosts(monkeypatch):
    monkeypatch.setenv("RINGLET_ALGO", "hier")
    for bad in run_world(_subgroups, 4, timeout=60, host_ids=LAYOUTS["2x2"]):
        assert not bad, bad


def _decisions(rank, P):
    g = ringlet._world._require(None)
    t = ringlet.get_topology()
    picks = []
    for op in cm.OPS:
        for nbytes in [8 << k for k in range(0, 26, 3)]:
            for root in range(P):
                picks.append(g._hier.use(op, nbytes, max(1, nbytes // 4), root))
    return (t.num_hosts, t.ranks_per_host, t.host, t.local_rank, t.local_size), picks


def test_chooser_decides_alike_on_every_rank(monkeypatch):
    monkeypatch.setenv("RINGLET_ALGO", "auto")
    res = run_world(_decisions, 6, timeout=60, host_ids=LAYOUTS["2x3"])
    assert len({tuple(p) for _t, p in res}) == 1
    picks = res[0][1]
    assert any(picks) and not all(picks), "the model should pick each form somewhere"
    assert [t for t, _p in res] == [(2, (3, 3), h, j, 3) for h in (0, 1) for j in range(3)]


@pytest.mark.parametrize("layout", ["2x2", "2x2-interleaved", "2x3", "3+1", "2+1+2"])
def test_the_size_floor_never_hides_a_hierarchical_choice(layout):
    # Below a plan's per-op floor the group skips ``use`` and runs flat; every size
    # where ``use`` says hierarchical must lie at or above it, for any parameters.
    ids = LAYOUTS[layout]
    rng = np.random.default_rng(7)
    sizes = sorted({int(x) for x in np.geomspace(1, 1 << 31, 400)} | {8, 64, 4096})
    skipped = 0
    for trial in range(12):
        p = cm.ModelParams() if trial == 0 else cm.ModelParams(
            alpha_intra=10 ** rng.uniform(-7, -4), beta_intra=10 ** rng.uniform(-11, -9),
            alpha_inter=10 ** rng.uniform(-6, -3), beta_inter=10 ** rng.uniform(-10, -7),
            gamma=10 ** rng.uniform(-12, -9), phase=10 ** rng.uniform(-7, -5))
        h = _hier._Hier(None, _hier.Topology(ids, 0), "auto", p)
        for op in cm.OPS:
            floor = getattr(h, f"floor_{op}")
            for n in sizes + [max(0, int(floor) - 1) if math.isfinite(floor) else 0]:
                for count in (max(1, n // 4), n):
                    if h.use(op, n, count):
                        assert n >= floor, (layout, p, op, n, floor)
                    elif n < floor:
                        skipped += 1
        h.algo = "hier"  # forced: no floor where the form applies
        assert h.floor_all_reduce == 0 and h.use("all_reduce", 64, 16)
    assert skipped > 0, "the floor should spare the chooser somewhere"
    h = _hier._Hier(None, _hier.Topology(ids, 0), "auto", cm.ModelParams())
    assert h.floor_all_reduce > 64 and not h.use("all_reduce", 64, 16)


def test_ringlet_algo_is_checked_at_init(monkeypatch):
    monkeypatch.setenv("RINGLET_ALGO", "ring")
    with pytest.raises(ValueError, match=r"RINGLET_ALGO='ring'.*auto, flat, hier"):
        ringlet.init(rank=0, world_size=1)
    assert not ringlet.is_initialized()
    assert cm.algo_from_env({"RINGLET_ALGO": " HIER "}) == "hier"
    assert cm.algo_from_env({}) == "auto"


def test_ringlet_model_file_is_read_and_checked(tmp_path, monkeypatch):
    p = tmp_path / "m.json"
    p.write_text('{"params": {"alpha_inter": 1e-4}}')
    assert cm.params_from_env({"RINGLET_MODEL": str(p)}).alpha_inter == 1e-4
    p.write_text('{"alpha_iner": 1}')
    with pytest.raises(ValueError, match="unknown cost model parameter.*alpha_iner"):
        cm.params_from_env({"RINGLET_MODEL": str(p)})
    with pytest.raises(ValueError, match="RINGLET_MODEL"):
        cm.params_from_env({"RINGLET_MODEL": str(tmp_path / "missing.json")})
    with pytest.raises(ValueError, match="beta_inter"):
        cm.ModelParams(beta_inter=-1.0)


def test_topology_of_a_single_host_world():
    def fn(rank, P):
        t = ringlet.get_topology()
        return t.num_hosts, t.local_rank, ringlet._world._require(None)._hier is None
    assert run_world(fn, 2, timeout=30) == [(1, 0, True), (1, 1, True)]


# ---- the model's arithmetic, against hand-computed values ---------------------------
M = cm.ModelParams(alpha_intra=1.0, beta_intra=0.01, alpha_inter=10.0, beta_inter=0.1,
                   gamma=0.001)


def test_building_blocks():
    # Ring all_reduce, 4 ranks, 400 B: 2*3*a + 2*3/4*400*b + 3/4*400*g.
    assert cm.ring_all_reduce(4, 400, 1.0, 0.01, 0.001) == pytest.approx(6 + 6 + 0.3)
    # Recursive doubling, 4 ranks: 2 steps of a + N*b, 2 reductions of N.
    assert cm.rd_all_reduce(4, 400, 1.0, 0.01, 0.001) == pytest.approx(2 * 5 + 0.8)
    # 3 ranks: 1 step among 2 plus fold-in and hand-back: 3 steps, ceil(log2 3)=2 reductions.
    assert cm.rd_all_reduce(3, 400, 1.0, 0.01, 0.001) == pytest.approx(3 * 5 + 0.8)
    assert cm.reduce_scatter_1(4, 400, 1.0, 0.01, 0.001) == pytest.approx(3 + 300 * 0.011)
    assert cm.all_gather_1(4, 400, 1.0, 0.01) == pytest.approx(3 + 3.0)
    # Chain (3 + 4) against tree (2 * 5).
    assert cm.broadcast_1(4, 400, 1.0, 0.01) == pytest.approx(7.0)
    assert cm.reduce_1(4, 400, 1.0, 0.01, 0.001) == pytest.approx(3 + 400 * 0.011)
    for f in (cm.ring_all_reduce, cm.rd_all_reduce, cm.reduce_1):
        assert f(1, 400, 1.0, 0.01, 0.001) == 0.0


def test_flat_and_hier_all_reduce_on_two_hosts_of_two():
    n = 4000.0
    # Flat: ring over 4 at inter costs = 6*10 + 1.5*4000*0.1 + 0.75*4000*0.001 = 663;
    # RD: 1 intra step (1 + 40) + 1 inter step (10 + 4000*0.1*2) + 2*4 = 859.
    assert cm.flat_time("all_reduce", n, [2, 2], M) == pytest.approx(663.0)
    # Hier: intra RS (1 + 2000*0.011 = 23) + inter all_reduce of 2000 B over 2
    # hosts at 2*beta (ring: 2*10 + 2000*0.2 + 1 = 421; RD: 10 + 400 + 2 = 412)
    # + intra AG (1 + 20 = 21).
    assert cm.hier_time("all_reduce", n, [2, 2], M) == pytest.approx(23 + 412 + 21)
    # The ratio of inter-host bytes the issue names: 1.5x at 2 ranks per host.
    big = cm.ModelParams(alpha_intra=0, beta_intra=0, alpha_inter=0, beta_inter=1, gamma=0)
    assert (cm.flat_time("all_reduce", 1e6, [2, 2], big)
            / cm.hier_time("all_reduce", 1e6, [2, 2], big)) == pytest.approx(1.5)
    assert (cm.flat_time("all_reduce", 1e6, [4, 4], big)
            / cm.hier_time("all_reduce", 1e6, [4, 4], big)) == pytest.approx(1.75 / 1, rel=0.1)


def test_pipelined_hier_all_reduce_overlaps_the_host_with_the_link():
    # Slices of N/64 within [SLICE_MIN_BYTES, SLICE_BYTES]; one below two slices.
    lo, hi = cm.SLICE_MIN_BYTES, cm.SLICE_BYTES
    assert cm.slice_bytes(64 * hi) == hi and cm.slice_bytes(1 << 40) == hi
    assert cm.slice_bytes(64 * lo) == lo and cm.slice_bytes(2 * lo) == lo
    assert cm.slices(2 * lo - 1) == 1 and cm.slices(2 * lo) == 2 and cm.slices(2 * lo + 1) == 3
    assert cm.slices(128 * hi) == 128
    # With a layout and parameters, a slice is never so small that its ring latencies
    # outweigh a twentieth of its time on the link: 2x2 keeps N/64; 128 hosts of 8
    # (254 inter-host steps a slice) take slices of ~9 MB, above the 1 MiB cap.
    d = cm.ModelParams()
    assert cm.slice_bytes(64 * hi, [2, 2], d) == hi
    lat = 2 * 127 * d.alpha_inter + 2 * 7 * d.alpha_intra
    floor = int(lat / 0.05 / (2 * 127 / 128 * d.beta_inter))
    assert cm.slice_bytes(1 << 30, [8] * 128, d) == floor > 8 * hi
    assert cm.slices(1 << 30, [8] * 128, d) == math.ceil((1 << 30) / floor)
    assert cm.slice_bytes(64 * hi, [8] * 128, d, latency_share=0) == hi
    # k = 64 slices of m on 2x2: per slice RS m/2, inter m (m/2 at 2*beta), AG m/2;
    # pipelined: RS + (k-1) * max(inter, RS + AG) + inter + AG = (k+1)m, against
    # 2n = 2km for the phases one after the other.
    unit = cm.ModelParams(alpha_intra=0, beta_intra=1, alpha_inter=0, beta_inter=1, gamma=0)
    m, k = hi, 64
    n = k * m
    assert cm.slices(n) == k
    assert cm.hier_time("all_reduce", n, [2, 2], unit) == pytest.approx((k + 1) * m)
    assert cm.hier_time("all_reduce", lo, [2, 2], unit) == pytest.approx(2 * lo)
    # reduce_scatter / all_gather: intra m/2 and inter m/2 a slice: m/2 + (k-1) * m/2 +
    # m/2, against n/2 + n/2 = km unpipelined.
    for op in ("reduce_scatter", "all_gather"):
        assert cm.hier_time(op, n, [2, 2], unit) == pytest.approx((k + 1) * m / 2)
        assert cm.hier_time(op, lo, [2, 2], unit) == pytest.approx(lo)
    assert _hier.SLICE_BYTES == cm.SLICE_BYTES and _hier.SLICE_MIN_BYTES == cm.SLICE_MIN_BYTES


def test_the_phase_cost_counts_each_flat_collective_an_algorithm_runs():
    # Wire and reduction free: only the phases are left.  Flat is one collective,
    # the hierarchical all_reduce three (RS, AR, AG), pipelined 3 + 2(k-1) on the
    # critical path; reduce_scatter / all_gather two, pipelined k + 1.
    ph = cm.ModelParams(alpha_intra=0, beta_intra=0, alpha_inter=0, beta_inter=0, gamma=0,
                        phase=1.0)
    k = 64
    n = k * cm.SLICE_BYTES
    assert cm.flat_time("all_reduce", 8, [2, 2], ph) == 1.0
    assert cm.flat_time("all_reduce", 8, [4], ph) == 1.0
    assert cm.flat_time("all_reduce", 8, [1], ph) == 0.0
    assert cm.hier_time("all_reduce", 8, [2, 2], ph) == 3.0
    assert cm.hier_time("all_reduce", n, [2, 2], ph) == 3.0 + 2 * (k - 1)
    assert cm.hier_time("all_reduce", 8, [2, 1], ph) == 3.0  # leader form
    for op in ("reduce_scatter", "all_gather"):
        assert cm.hier_time(op, 8, [2, 2], ph) == 2.0
        assert cm.hier_time(op, n, [2, 2], ph) == k + 1.0
    for op in ("broadcast", "reduce"):  # two phases and the flat root check
        assert cm.hier_time(op, 8, [2, 2], ph) == 3.0
    # One rank per host: the intra phases are empty and cost nothing.
    assert cm.hier_time("all_reduce", 8, [1, 1], ph) == 1.0
    # Fitted from one measured flat all_reduce: it adds what the messages leave over.
    m = cm.ModelParams()
    wire = cm.flat_time("all_reduce", 8, [2, 2], m)
    fitted = cm.fit_phase(wire + 40e-6, [2, 2], m)
    assert fitted.phase == pytest.approx(40e-6)
    assert cm.flat_time("all_reduce", 8, [2, 2], fitted) == pytest.approx(wire + 40e-6)
    assert cm.fit_phase(wire / 2, [2, 2], m).phase == 0.0
    # With a large phase cost the small all_reduce stays flat: 3 phases against 1.
    assert (cm.hier_time("all_reduce", 4096, [2, 2], fitted)
            > cm.flat_time("all_reduce", 4096, [2, 2], fitted))
    assert (cm.hier_time("all_reduce", 4096, [2, 2], m)
            < cm.flat_time("all_reduce", 4096, [2, 2], m))
    assert cm.ModelParams.from_dict({"phase": 5e-5}).phase == 5e-5
    with pytest.raises(ValueError, match="phase"):
        cm.ModelParams(phase=-1.0)


def test_the_phase_cost_fitted_from_both_forms_prices_their_difference():
    # Measured: flat 80 us, hierarchical 150 us, with an alpha that overstates both
    # forms' messages alike.  The fit gives the hierarchical form's two further
    # phases what the messages leave of the 70 us between them.
    m = cm.ModelParams(alpha_intra=40e-6, alpha_inter=45e-6)
    wire_f = cm.flat_time("all_reduce", 8, [2, 2], m)
    wire_h = cm.hier_time("all_reduce", 8, [2, 2], m)
    assert wire_f > 80e-6  # the flat fit alone would give 0
    assert cm.fit_phase(80e-6, [2, 2], m).phase == 0.0
    fitted = cm.fit_phase(80e-6, [2, 2], m, hier_s=150e-6)
    assert fitted.phase == pytest.approx((70e-6 - (wire_h - wire_f)) / 2)
    gap = (cm.hier_time("all_reduce", 8, [2, 2], fitted)
           - cm.flat_time("all_reduce", 8, [2, 2], fitted))
    assert gap == pytest.approx(70e-6)
    # Then the small reduce_scatter stays flat too (two phases against one).
    assert (cm.hier_time("reduce_scatter", 64, [2, 2], fitted)
            > cm.flat_time("reduce_scatter", 64, [2, 2], fitted))
    # Hierarchical faster than its messages allow: no phase cost, never negative.
    assert cm.fit_phase(80e-6, [2, 2], m, hier_s=60e-6).phase == 0.0
    # One rank per host: both forms have one phase; the flat fit stands.
    wire1 = cm.flat_time("all_reduce", 4, [1, 1], m)
    assert cm.fit_phase(wire1 + 5e-6, [1, 1], m, nbytes=4, hier_s=1.0).phase == \
        pytest.approx(5e-6)


def test_flat_reduce_scatter_and_all_gather_take_log_steps_where_the_library_does():
    # Over TCP the library halves recursively (power of two P >= 4, input up to
    # 16 x 64 KiB) and gathers by Bruck (P >= 3, output up to 64 KiB): log2 P latencies.
    a = cm.ModelParams(alpha_intra=0, beta_intra=0, alpha_inter=1.0, beta_inter=0, gamma=0)
    assert cm.flat_time("reduce_scatter", 64, [2, 2], a) == 2.0
    assert cm.flat_time("reduce_scatter", 64, [2, 2, 2], a) == 5.0  # 6 ranks: the ring
    assert cm.flat_time("reduce_scatter", 17 * cm.SMALL_BYTES, [2, 2], a) == 3.0
    assert cm.flat_time("all_gather", 64, [2, 2, 2], a) == 3.0  # ceil(log2 6)
    assert cm.flat_time("all_gather", cm.SMALL_BYTES + 1, [2, 2], a) == 3.0
    assert cm.flat_time("all_gather", 64, [1, 1], a) == 1.0
    # The inter-host phase of the hierarchical forms runs the same code on H ranks.
    assert cm.hier_time("reduce_scatter", 64, [2, 2, 2, 2], a) == 2.0
    assert cm.hier_time("all_gather", 64, [2, 2, 2, 2], a) == 2.0
    assert cm.SMALL_BYTES == _core.get_tuning()["allreduce_small_bytes"]
    # Bytes: a step whose partner is on another host crosses with every rank of that
    # host at once (L * beta_inter); a nearer partner stays inside (beta_intra).
    b = cm.ModelParams(alpha_intra=0, beta_intra=0.001, alpha_inter=0, beta_inter=0.1,
                       gamma=0)
    # 4x2, 800 B: halving to partners 4 and 2 away across (400 + 200 B at 0.2), 1 away
    # inside (100 B at 0.001); Bruck the other way round.
    assert cm.flat_time("reduce_scatter", 800, [2, 2, 2, 2], b) == pytest.approx(120.1)
    assert cm.flat_time("all_gather", 800, [2, 2, 2, 2], b) == pytest.approx(120.1)
    assert cm.flat_time("reduce_scatter", 800, [2, 2], b) == pytest.approx(80.2)


def test_broadcast_over_tcp_is_priced_as_the_library_sends_it():
    # bcast.c up to 64 KiB: up to 4 ranks the root sends to every rank itself, else a
    # binomial tree; a rank's sends leave at once and share its link.
    a = cm.ModelParams(alpha_intra=1.0, beta_intra=0.001, alpha_inter=10.0, beta_inter=0.1,
                       gamma=0.0)
    # 2x2: the root's two sends to the other host share its link: 10 + 2*100*0.1.
    assert cm.flat_time("broadcast", 100, [2, 2], a) == pytest.approx(30.0)
    # Beyond 8 KiB across hosts the binomial tree: 0 -> 2 across (with 0 -> 1 inside at
    # once), then 2 -> 3 inside.
    n = 16384.0
    assert cm.flat_time("broadcast", n, [2, 2], a) == pytest.approx(
        10 + n * 0.1 + 1 + n * 0.001)
    assert cm.BCAST_FLAT_BYTES == {k["name"]: k["default"] for k in _core.knobs()}[
        "bcast_flat_bytes"]
    # 4x2 from rank 0: the hosts' tree, 0 -> {2, 4, 6} across (three sends on its link:
    # 40) and 1 inside, then each host's first rank to its second (+1.1).
    assert cm.flat_time("broadcast", 100, [2, 2, 2, 2], a) == pytest.approx(41.1)
    # 5 hosts of 2 beyond 8 KiB: a binomial tree over the hosts' first ranks (0 -> {8,
    # 4, 2} across, 10 + 3n*0.1; 4 -> 6 across, 10 + n*0.1), then 6 -> 7 inside.
    big8 = 16384.0
    assert cm.flat_time("broadcast", big8, [2] * 5, a) == pytest.approx(
        (10 + 3 * big8 * 0.1) + (10 + big8 * 0.1) + (1 + big8 * 0.001))
    # Beyond 64 KiB the pipelined chain over every rank.
    big = 2.0 * cm.SMALL_BYTES
    assert cm.flat_time("broadcast", big, [2, 2], a) == pytest.approx(3 * 10 + big * 0.1)
    # The inter-host phase of the hierarchical form is the same code over H ranks.
    assert cm.broadcast_tcp(4, 100, 10.0, 0.1) == pytest.approx(10 + 3 * 10)
    # 4 hosts beyond 8 KiB: 0 -> {2, 1} (two sends on its link), then 2 -> 3.
    assert cm.broadcast_tcp(4, n, 10.0, 0.1) == pytest.approx((10 + 2 * n * 0.1)
                                                              + (10 + n * 0.1))
    # 8 ranks: 0 -> {4, 2, 1} (40), 4 -> {6, 5} (+30), 6 -> 7 (+20).
    assert cm.broadcast_tcp(8, 100, 10.0, 0.1) == pytest.approx(90.0)
    # reduce runs the same tree backwards, each rank taking its children at once:
    # 3 -> 2 inside (1 + 0.1, then 100*0.01 to add), {2, 4, 6} -> 0 across sharing
    # the root's link (10 + 3*10) and 1 -> 0 inside; the root adds four blocks.
    ag = cm.ModelParams(alpha_intra=1.0, beta_intra=0.001, alpha_inter=10.0,
                        beta_inter=0.1, gamma=0.01)
    assert cm.flat_time("reduce", 100, [2, 2, 2, 2], ag) == pytest.approx(
        (1.1 + 1.0) + 40.0 + 4 * 1.0)
    assert cm.reduce_tcp(4, 100, 10.0, 0.1, 0.01) == pytest.approx(40.0 + 3 * 1.0)
    check = cm.flat_time("all_reduce", 16, [2, 2, 2, 2], a)
    assert cm.hier_time("broadcast", 100, [2, 2, 2, 2], a) == pytest.approx(
        cm.broadcast_tcp(4, 100, 10.0, 0.1) + cm.broadcast_1(2, 100, 1.0, 0.001) + check)
    # So on 2x2 both forms cross the host link once beyond 8 KiB, and the flat one,
    # without the root check and the phases, stays ahead.
    assert cm.flat_time("broadcast", 32768, [2, 2], a) < cm.hier_time(
        "broadcast", 32768, [2, 2], a)


def test_other_ops_and_where_hier_does_not_apply():
    n = 4000.0
    check = cm.flat_time("all_reduce", 16, [2, 2], M)  # the roots compared first
    assert check > 0
    assert cm.hier_time("broadcast", n, [2, 2], M) == pytest.approx(
        cm.broadcast_1(2, n, 10, 0.1) + cm.broadcast_1(2, n, 1, 0.01) + check)
    assert cm.hier_time("reduce_scatter", n, [2, 2], M) == pytest.approx(
        (1 + 2000 * 0.011) + (10 + 1000 * (0.2 + 0.001)))
    assert cm.hier_time("all_gather", n, [2, 2], M) == pytest.approx(
        (10 + 1000 * 0.2) + (1 + 2000 * 0.01))
    # Uneven hosts: the leader form for all_reduce, no hierarchical RS/AG.
    assert cm.hier_time("all_reduce", n, [2, 1], M) == pytest.approx(
        cm.reduce_1(2, n, 1, 0.01, 0.001) + cm.all_reduce_1(2, n, 10, 0.1, 0.001)
        + cm.broadcast_1(2, n, 1, 0.01))
    assert math.isinf(cm.hier_time("reduce_scatter", n, [2, 1], M))
    assert not cm.hier_applies("all_reduce", [4])
    assert not cm.hier_applies("broadcast", [2, 1], root_local=1)
    assert cm.hier_applies("broadcast", [2, 1], root_local=0)
    # One host: the flat form at intra costs.
    assert cm.flat_time("all_gather", n, [4], M) == pytest.approx(3 + 3000 * 0.01)
    # Ring edges leaving a host share its link (beyond Bruck's sizes).
    big = 4.0 * cm.SMALL_BYTES
    assert cm.flat_time("all_gather", big, [2, 2], M, crossing=2) == pytest.approx(
        3 * 10 + 0.75 * big * 0.2)


def test_fit_from_limits_figures():
    intra = {"rtt_us": {"blocking_1pair": 20.0}, "tcp_both_ways": 2.0,
             "add_f32_ringlet": {"256KiB": 10.0}}
    inter = {"rtt_us": {"blocking_1pair": 100.0}, "tcp_one_way": 0.125}
    m = cm.fit(intra, inter)
    assert m.alpha_intra == pytest.approx(10e-6) and m.beta_intra == pytest.approx(0.5e-9)
    assert m.gamma == pytest.approx(0.1e-9)
    assert m.alpha_inter == pytest.approx(50e-6) and m.beta_inter == pytest.approx(8e-9)
    assert cm.fit() == cm.ModelParams()


# ---- real processes, the environment variables, and the bench command ---------------
def _proc_rank(rank, P):
    import os

    g = ringlet._world._require(None)
    x = np.full(1 << 12, rank + 1, np.float32)
    ringlet.all_reduce(x)
    return (os.environ["RINGLET_HOST_ID"], ringlet.get_topology().ranks_per_host,
            g._hier is not None and g._hier.intra is not None, float(x[0]),
            g._world.algo, g._world.model.alpha_inter)


def test_processes_with_ringlet_host_id_and_rank_0s_model(tmp_path, monkeypatch):
    # RINGLET_HOST_ID set per process; RINGLET_MODEL read by rank 0 and used by all.
    from ringlet.bench import main

    p = tmp_path / "model.json"
    assert main(["model", "--params", "/dev/null"]) == 2  # not JSON: a usage error
    p.write_text('{"params": {"alpha_inter": 0.5, "beta_inter": 1e-6}}')
    monkeypatch.setenv("RINGLET_MODEL", str(p))
    monkeypatch.setenv("RINGLET_ALGO", "auto")
    res = run_world(_proc_rank, 4, mode="process", timeout=120, host_ids=LAYOUTS["2x2"])
    assert [r[0] for r in res] == LAYOUTS["2x2"]
    assert all(r[1] == (2, 2) and r[2] and r[3] == 10.0 and r[4] == "auto" and r[5] == 0.5
               for r in res), res


def test_bench_model_prints_the_grid_and_saves_params(tmp_path, capsys):
    from ringlet.bench import main

    intra = tmp_path / "limits.json"
    intra.write_text('{"limits": {"rtt_us": {"blocking_1pair": 40.0}, "tcp_both_ways": 2.0}}')
    saved, js = tmp_path / "m.json", tmp_path / "rows.json"
    assert main(["model", "--intra-limits", str(intra), "--save", str(saved),
                 "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "## all_reduce" in out and "## reduce" in out and "128 hosts" in out
    m = cm.params_from_env({"RINGLET_MODEL": str(saved)})
    assert m.alpha_intra == pytest.approx(20e-6) and m.beta_inter == cm.ModelParams().beta_inter
    import json

    rows = json.loads(js.read_text())["rows"]
    r = [x for x in rows if (x["op"], x["ranks"], x["hosts"]) == ("all_reduce", 8, 2)][0]
    # 2 hosts of 4 at the largest size: flat/hier near the 2(P-1)/P / (2(H-1)/H) = 1.75
    # ratio of link bytes, a little above it: the pipelined form hides the intra-host
    # phases, reduction included, behind the link, and the flat ring does not.
    assert 1.5 < r["speedup"] < 1.85
    assert r["crossovers"][-1][1] == "hier"
    # model's default range ends at 1 GiB; an explicit -e 64M is kept, not taken for it
    for args, hi in ((["-e", "64M"], 64 << 20), ([], 1 << 30)):
        assert main(["model", "--intra-limits", str(intra), "--json", str(js), *args]) == 0
        assert json.loads(js.read_text())["max_bytes"] == hi


def _one_rank_missing(rank, P):
    from ringlet.errors import GroupPoisonedError, RingletError

    if rank == 3:
        return "skipped"  # never joins: its host's intra phase cannot finish
    x = np.ones(4096, np.float32)
    try:
        ringlet.all_reduce(x, timeout=5.0)
    except RingletError as exc:
        msg = str(exc)
    else:
        return "no error"
    try:
        ringlet.all_reduce(x)
    except GroupPoisonedError:
        return msg
    return "not poisoned"


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_failed_phase_names_the_parent_group_and_poisons_it(monkeypatch, request, pipelined):
    if pipelined:  # 4 KiB slices: 4 slices, inter-host ops queued while one phase fails
        request.getfixturevalue("small_segments")
    monkeypatch.setenv("RINGLET_ALGO", "hier")
    res = run_world(_one_rank_missing, 4, timeout=60, host_ids=LAYOUTS["2x2"])
    assert res[3] == "skipped"
    for r in range(3):
        assert "hierarchical collective of group 0" in res[r], res[r]


def _algo_seen(rank, P):
    g = ringlet._world._require(None)
    x = np.full(4096, rank, np.float32)
    ringlet.all_reduce(x)
    return g._world.algo, g._hier is not None and g._hier.intra is not None, float(x[0])


def test_rank_0s_ringlet_algo_is_the_jobs(monkeypatch):
    # Each rank reads its own RINGLET_ALGO (here: rank 0 "hier", the others "flat");
    # rank 0's value reaches every rank with the endpoint table, so all run alike.
    import threading

    def per_rank(env=None):
        return "hier" if threading.current_thread().name == "ringlet-rank0" else "flat"

    monkeypatch.setattr(cm, "algo_from_env", per_rank)
    res = run_world(_algo_seen, 4, timeout=60, host_ids=LAYOUTS["2x2"])
    assert res == [("hier", True, 6.0)] * 4


# ---- all_gather's input anywhere inside its output ----------------------------------
def _all_gather_inside_the_output(rank, P):
    b = 1000  # 4 slices of 256 columns each (small_segments): the pipelined form
    blocks = [np.arange(b, dtype=np.float32) + 10000 * r for r in range(P)]
    want = np.concatenate(blocks)
    span = (P - 1) * b + 1  # where an input of b elements can start inside the output
    starts = [rank * b, 0, (rank * b + 3) % span, (rank * b + b // 2 + 7) % span,
              (rank * b + span - 3) % span]
    bad = []
    for s in starts:
        out = np.zeros(P * b, np.float32)
        out[s:s + b] = blocks[rank]
        ringlet.all_gather(out, out[s:s + b])
        if not same(out, want):
            wrong = np.flatnonzero(out != want)
            bad.append(f"rank {rank}: input at {s}: {wrong.size} wrong, first at {wrong[0]}")
    used = ringlet._world._require(None)._hier.intra is not None
    return bad, used


@pytest.mark.parametrize("layout", ["2x2", "2x2-interleaved"])
def test_all_gather_takes_its_input_anywhere_inside_the_output(layout, monkeypatch,
                                                               small_segments):
    # The pipelined form writes columns of every block while later slices still
    # read the input: an input that is not this rank's block is copied first.
    monkeypatch.setenv("RINGLET_ALGO", "hier")
    res = run_world(_all_gather_inside_the_output, 4, timeout=60, host_ids=LAYOUTS[layout])
    for bad, used in res:
        assert used and not bad, bad


# ---- the first hierarchical op keeps its deadline -----------------------------------
_T, _LATE = 3.0, 2.0


def _first_op_with_a_late_rank_0(rank, P):
    x = np.ones(64, np.float32)
    if rank == 0:
        # The fault injected, not a synchronisation: rank 0 comes late, so the others
        # spend _LATE of their deadline waiting for the sub-groups it records.
        time.sleep(_LATE)
        try:
            ringlet.all_reduce(x, timeout=_T)
        except ringlet.RingletError:
            pass
        return None
    t0 = time.monotonic()
    try:
        ringlet.all_reduce(x, timeout=_T)
        return "completed", time.monotonic() - t0
    except ringlet.RingletError as exc:
        return type(exc).__name__, time.monotonic() - t0


def test_the_first_hier_op_ends_within_its_timeout(monkeypatch):
    # Its sub-groups are made inside it; their set-up used to start the phases'
    # deadline only afterwards: up to twice the timeout.
    monkeypatch.setenv("RINGLET_ALGO", "hier")
    real = _hier._Hier._slice_rs

    def hangs_on_rank_0(self, *args):
        if threading.current_thread().name == "ringlet-rank0":
            # Rank 0 made the sub-groups, then hangs until the others' failure stops it.
            ringlet.recv(np.empty(1, np.float32), 1, tag=77, timeout=60)
        return real(self, *args)

    monkeypatch.setattr(_hier._Hier, "_slice_rs", hangs_on_rank_0)
    res = run_world(_first_op_with_a_late_rank_0, 4, timeout=60, host_ids=LAYOUTS["2x2"])
    for kind, took in res[1:]:
        assert kind != "completed", res
        assert 0.8 * _T < took < _T + 1.2, res  # not _LATE + _T


# ---- the root never decides the form -------------------------------------------------
def _rooted_from_every_root(rank, P):
    g = ringlet._world._require(None)
    bad = []
    for op in ("broadcast", "reduce"):
        for nbytes in [8 << k for k in range(0, 26, 3)]:
            picks = {g._hier.use(op, nbytes, max(1, nbytes // 4), root) for root in range(P)}
            if len(picks) != 1:
                bad.append(f"{op} of {nbytes} bytes: the form depends on the root")
    n = 37
    for root in range(P):
        src = data(root, n, np.float64, salt=6)
        x = src.copy() if rank == root else np.zeros(n)
        ringlet.broadcast(x, root)
        if not same(x, src):
            bad.append(f"rank {rank}: broadcast root={root}")
        ins = [data(r, n, np.float64, salt=7) for r in range(P)]
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
            x = ins[rank].copy()
            ringlet.reduce(x, root, op)
            if rank == root and not close(x, reduce_np(ins, op, np.float64), op):
                bad.append(f"rank {rank}: reduce {op.name} root={root}")
            if rank != root and not same(x, ins[rank]):
                bad.append(f"rank {rank}: reduce {op.name} root={root} changed a non-root")
    return bad


@pytest.mark.parametrize("layout", ["3+1", "2+1+2"])
@pytest.mark.parametrize("algo", ["hier", "auto"])
def test_the_root_does_not_decide_between_flat_and_hierarchical(layout, algo, monkeypatch):
    # Ranks that pass different roots used to split between the two forms (hosts of
    # different sizes) and wait in different communicators.  A root whose local
    # index some host lacks is now relayed through local rank 0.
    monkeypatch.setenv("RINGLET_ALGO", algo)
    ids = LAYOUTS[layout]
    for bad in run_world(_rooted_from_every_root, len(ids), timeout=90, host_ids=ids):
        assert not bad, "\n".join(bad)


# ---- ranks that pass different roots to a hierarchical rooted op -------------------
_ROOT_T = 10.0  # the op's deadline: a rank still waiting for a peer takes all of it

ROOTS = {
    # Per rank, the root it passes.  halves: host b's ranks take root 1, whose
    # phases run on the other inter-host group (they waited there to the deadline);
    # own: every rank a root, each only sends; one: a lone rank on host b disagrees.
    ("2x2", "halves"): [0, 0, 1, 1],
    ("2x2", "own"): [0, 1, 2, 3],
    ("2x2", "one"): [2, 2, 2, 3],
    ("3+1", "relayed"): [1, 1, 1, 3],  # local index 1 is missing on host b: relayed
}


def _two_roots(rank, P, op, roots):
    x = np.full(257, rank, np.float32)
    t0 = time.monotonic()
    try:
        if op == "broadcast":
            ringlet.broadcast(x, roots[rank], timeout=_ROOT_T)
        else:
            ringlet.reduce(x, roots[rank], timeout=_ROOT_T)
    except ringlet.RingletError as exc:
        took = time.monotonic() - t0
        try:
            ringlet.all_reduce(np.ones(4, np.float32), timeout=_ROOT_T)
            poisoned = False
        except ringlet.GroupPoisonedError:
            poisoned = True
        return type(exc).__name__, str(exc), exc.peer, exc.op, took, poisoned
    return "completed", "", None, None, time.monotonic() - t0, False


_NAMED = r"different roots to (\w+) seq=\d+: root (\d+) on this rank, root (\d+) on the peer"


@pytest.mark.parametrize("op", ["broadcast", "reduce"])
@pytest.mark.parametrize("layout,pattern", sorted(ROOTS))
def test_different_roots_to_a_hier_rooted_op_raise_desync_on_every_rank(
        op, layout, pattern, monkeypatch):
    # The flat path names both roots (docs/errors.md, "Ranks that pass different
    # roots"); the hierarchical phases of different roots run on different
    # sub-groups, where ranks waited for each other until the deadline.
    monkeypatch.setenv("RINGLET_ALGO", "hier")
    roots = ROOTS[(layout, pattern)]
    res = run_world(_two_roots, len(roots), timeout=60, args=(op, roots),
                    host_ids=LAYOUTS[layout])
    direct = 0
    for rank, (kind, msg, peer, what, took, poisoned) in enumerate(res):
        assert kind == "DesyncError", (rank, res)
        assert took < _ROOT_T / 2, (rank, took, msg)  # promptly, not at the deadline
        assert poisoned, f"rank {rank}: the group is still usable after the desync"
        m = re.search(_NAMED, msg)
        assert m and m.group(1) == op, msg
        mine, theirs = int(m.group(2)), int(m.group(3))
        assert mine != theirs and {mine, theirs} <= set(roots), msg
        assert isinstance(peer, int) and 0 <= peer < len(roots), (rank, peer, msg)
        if f"rank {peer} failed:" in msg:
            # Relayed: a rank whose check another rank's published failure cut short
            # quotes that rank's message (docs/errors.md, "How failures spread").
            continue
        direct += 1
        assert what == op and (mine, theirs) == (roots[rank], roots[peer]), (rank, peer, msg)
        assert f"the peer is group rank {peer}" in msg, msg
    assert direct, "no rank found the different roots itself"


# ---- close() releases the sub-groups -------------------------------------------------
def _fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def _mapped(job: str, comm_ids) -> int:
    # The shared-memory segments of these communicators still mapped in this
    # process (memfd "ringlet-<job>-comm<id>", _shm._create).
    with open("/proc/self/maps") as f:
        return sum(1 for line in f
                   for m in re.finditer(rf"ringlet-{job}-comm(\d+)\b", line)
                   if int(m.group(1)) in comm_ids)


def _close_releases_the_subgroups(rank, P):
    bad = []
    w = ringlet._world._require(None)._world
    x = np.ones(64, np.float32)
    ringlet.all_reduce(x)  # the world's own sub-groups, made before the count
    for _ in range(3):
        ringlet.barrier()
    # Thread mode: one process, so rank 0 counts while the others wait in a barrier.
    before = _fds() if rank == 0 else None
    ringlet.barrier()
    g = ringlet.new_group(list(range(P)))
    y = np.full(64, rank, np.float32)
    g.all_reduce(y)  # hierarchical: makes g's intra- and inter-host groups
    g.broadcast(y, 3)
    subs = [g._hier.intra, g._hier.inter]
    if any(s is None for s in subs) or subs[0].transport != "shm":
        return [f"rank {rank}: no sub-groups, or an intra-host group not over shm: {subs}"]
    ids = {i for s in subs for i in (s.comm_id, s.comm_id + 1)}  # collective and p2p comms
    job = w.job_id.hex()[:8]
    g.barrier()
    ringlet.barrier()
    during = _fds() if rank == 0 else None
    mapped = _mapped(job, ids)
    ringlet.barrier()
    g.close()
    g.close()  # idempotent
    ringlet.barrier()
    after = _fds() if rank == 0 else None
    ringlet.barrier()
    if _mapped(job, ids) or not mapped:
        bad.append(f"rank {rank}: segments of the sub-groups mapped: {mapped} before close, "
                   f"{_mapped(job, ids)} after")
    for s in subs:
        if not s._closed or s.transport is not None or s in w._groups:
            bad.append(f"rank {rank}: sub-group {s.ranks} still open after close()")
        try:
            s.all_reduce(np.ones(4, np.float32), timeout=5)
            bad.append(f"rank {rank}: an op on closed sub-group {s.ranks} ran")
        except ringlet.RingletError as exc:
            if "ProcessGroup.close() of group" not in str(exc):
                bad.append(f"rank {rank}: {exc}")
    if rank == 0 and not (before < during and after <= before):
        bad.append(f"descriptors: {before} before the group, {during} with it, {after} after "
                   f"close()")
    # Another group's sub-groups (the world's) are untouched.
    x = np.ones(64, np.float32)
    ringlet.all_reduce(x)
    if not np.all(x == P) or w.group._hier.intra._closed:
        bad.append(f"rank {rank}: the world's hierarchical all_reduce after close: {x[:3]}")
    return bad


def test_close_releases_the_hierarchical_subgroups(monkeypatch):
    monkeypatch.setenv("RINGLET_ALGO", "hier")
    for bad in run_world(_close_releases_the_subgroups, 4, timeout=60,
                         host_ids=LAYOUTS["2x2"]):
        assert not bad, bad
