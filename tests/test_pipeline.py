"""Pipeline parallelism: schedules as data, the runtime, pipeline × data, failures.

Oracles: a plan is checked by the simulator against hand-derived facts
(bubble formula, per-rank activation bounds, exact small grids); a pipelined
step is checked against the same model run unsplit on one process.  All
parity tests run in float64 and compare with a stated tolerance of 1e-10
(relative, plus 1e-12 absolute): the pipelined step does the same arithmetic
per sample and only sums microbatch gradients in a different order.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from typing import Optional

import numpy as np
import pytest

import ringlet
from ringlet import nn
from ringlet.errors import RingletError
from ringlet.pipeline import (Action, ActionKind, PipelineError, PipelineStage, Plan,
                              Schedule1F1B, ScheduleError, ScheduleGPipe,
                              ScheduleInterleaved1F1B, all_reduce_gradients, bubble_fraction,
                              pipeline_data_groups, plan_1f1b, plan_gpipe,
                              plan_interleaved_1f1b, simulate, split_model)
from ringlet.parallel.pipeline import _wire as wire
from ringlet.testing import WorldError, run_world

from _blocked import wait_until_blocked
from _launchers import clean_env

RTOL, ATOL = 1e-10, 1e-12
F, B = ActionKind.FORWARD, ActionKind.BACKWARD
SA, RA, SG, RG = (ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD,
                  ActionKind.RECV_GRAD)
D_IN, D_H, D_OUT = 5, 7, 3


# ---- schedules as data ------------------------------------------------------------------
@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 12, 16])
def test_gpipe_and_1f1b_plans_valid_with_bubble_and_memory(p, m):
    theory = (p - 1) / (m + p - 1)
    g = simulate(plan_gpipe(p, m))
    assert g.bubble_fraction == pytest.approx(theory, abs=1e-12)
    assert g.peak_alive == [m] * p
    o = simulate(plan_1f1b(p, m))
    assert o.bubble_fraction == pytest.approx(theory, abs=1e-12)
    # Stage i keeps at most p - i microbatches alive (and exactly that many
    # once m is large enough); never more than the number of stages.
    assert o.peak_alive == [min(p - r, m) for r in range(p)]
    assert max(o.peak_alive) <= p
    # Unequal costs: same makespan for both, (m + p - 1)(tf + tb).
    for plan in (plan_gpipe(p, m), plan_1f1b(p, m)):
        assert simulate(plan, forward_time=1, backward_time=2).makespan == (m + p - 1) * 3


@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3, 4])
def test_interleaved_plans_valid_with_smaller_bubble(p, v, rounds):
    m = rounds * p
    plan = plan_interleaved_1f1b(p, v, m)
    assert plan.num_stages == p * v
    assert [plan.stages_of(r) for r in range(p)] == [list(range(r, p * v, p)) for r in range(p)]
    sim = simulate(plan)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert sim.bubble_fraction <= bubble_fraction(p, m) + 1e-12
    if v == 1:
        assert plan.actions == plan_1f1b(p, m).actions
    else:  # warm-up forwards plus the one in flight, in chunk-microbatches
        assert sim.peak_alive == [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)
                                  for r in range(p)]


def test_interleaved_needs_multiple_of_ranks():
    with pytest.raises(ValueError, match=r"multiple of the number of pipeline ranks \(4\); "
                                         r"got 6 \(try 8\)"):
        plan_interleaved_1f1b(4, 2, 6)
    with pytest.raises(ValueError, match=r"got 65535 \(try 65534\)"):  # 65541 is over the limit
        plan_interleaved_1f1b(7, 2, 65535)


def test_bubble_fraction_formula_and_arguments():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 5) == 0.0
    with pytest.raises(ValueError):
        bubble_fraction(0, 4)
    with pytest.raises(TypeError):
        plan_gpipe(2.0, 4)
    with pytest.raises(TypeError):
        plan_1f1b(2, True)


def test_table_grid_exact_for_small_1f1b():
    t = plan_1f1b(2, 3).table()
    cells = [[t.cell(a) for a in row] for row in t.grid]
    assert cells == [["F0", "F1", ".", "B0", "F2", "B1", ".", "B2"],
                     [".", "F0", "B0", "F1", "B1", "F2", "B2", "."]]
    text = str(t)
    assert "rank 0" in text and "rank 1" in text and "bubble 0.250 (theory 0.250)" in text
    assert "peak alive microbatch-stages per rank [2, 1]" in text
    # Interleaved cells name the stage; backward_time=2 widens backward cells.
    ti = plan_interleaved_1f1b(2, 2, 2).table(backward_time=2)
    assert "F0s2" in str(ti)
    assert sum(c is not None and c.kind is B for c in ti.grid[0]) == 2 * 2 * 2


def _swap(plan: Plan, rank: int, i: int, j: int) -> Plan:
    acts = [list(a) for a in plan.actions]
    acts[rank][i], acts[rank][j] = acts[rank][j], acts[rank][i]
    return Plan(plan.name, plan.num_ranks, plan.num_stages, plan.n_microbatches,
                tuple(tuple(a) for a in acts))


def _with(plan: Plan, rank: int, actions) -> Plan:
    acts = list(plan.actions)
    acts[rank] = tuple(actions)
    return Plan(plan.name, plan.num_ranks, plan.num_stages, plan.n_microbatches, tuple(acts))


def test_simulator_rejects_broken_plans():
    g = plan_gpipe(2, 2)
    # rank 1: RA(1,0) F(1,0) RA(1,1) F(1,1) B(1,0) SG(1,0) B(1,1) SG(1,1)
    r1 = list(g.actions[1])
    with pytest.raises(ScheduleError, match="before receiving its input"):
        simulate(_swap(g, 1, 0, 1))
    with pytest.raises(ScheduleError, match="out of forward order"):
        b0, b1 = r1.index(Action(B, 1, 0)), r1.index(Action(B, 1, 1))
        simulate(_swap(_swap(g, 1, b0, b1), 1, b0 + 1, b1 + 1))
    with pytest.raises(ScheduleError, match="before its own forward"):
        simulate(_with(g, 0, [Action(B, 0, 0)] + [a for a in g.actions[0]
                                                  if a != Action(B, 0, 0)]))
    with pytest.raises(ScheduleError, match="runs .* twice"):
        simulate(_with(g, 1, r1 + [r1[0]]))
    with pytest.raises(ScheduleError, match="never runs"):
        simulate(_with(g, 1, r1[:-1]))
    with pytest.raises(ScheduleError, match="does not belong"):
        simulate(_with(g, 1, r1 + [Action(F, 0, 0)]))
    with pytest.raises(ScheduleError, match="before the forward that produces it"):
        r0 = list(g.actions[0])
        simulate(_swap(g, 0, r0.index(Action(F, 0, 0)), r0.index(Action(SA, 0, 0))))
    # Rank 0 waits for a gradient before sending the activation that causes it.
    r0 = list(g.actions[0])
    i, j = r0.index(Action(SA, 0, 0)), r0.index(Action(RG, 0, 0))
    bad = r0[:i] + [r0[j]] + [a for a in r0[i:] if a != r0[j]]
    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits at RG"):
        simulate(_with(g, 0, bad))


def test_simulator_finds_every_deadlock_of_random_orders():
    """Random per-rank orders: the simulator accepts exactly the ones a brute-force run finishes."""
    rng = np.random.default_rng(0)
    base = plan_1f1b(3, 3)
    accepted = rejected = 0
    for _ in range(300):
        acts = [list(a) for a in base.actions]
        r = int(rng.integers(3))
        i, j = rng.integers(len(acts[r]), size=2)
        acts[r][i], acts[r][j] = acts[r][j], acts[r][i]
        plan = Plan("x", 3, 3, 3, tuple(tuple(a) for a in acts))
        try:
            simulate(plan)
            ok = True
        except ScheduleError:
            ok = False
        assert ok == _brute_force_runs(plan)
        accepted += ok
        rejected += not ok
    assert accepted > 10 and rejected > 10


def _brute_force_runs(plan: Plan) -> bool:
    """Independent oracle: execute with explicit data (values, not bookkeeping)."""
    p, S = plan.num_ranks, plan.num_stages
    mailbox = set()
    have = {r: set() for r in range(p)}  # ("x"|"y"|"gy"|"gx", s, m) held by rank r
    fwd_seq = {s: [] for s in range(S)}
    pos = [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(plan.actions[r]):
                a = plan.actions[r][pos[r]]
                s, m = a.stage, a.microbatch
                if a.kind is RA:
                    if ("act", s - 1, m) not in mailbox:
                        break
                    have[r].add(("x", s, m))
                elif a.kind is RG:
                    if ("grad", s + 1, m) not in mailbox:
                        break
                    have[r].add(("gy", s, m))
                elif a.kind is SA:
                    if ("y", s, m) not in have[r]:
                        return False
                    mailbox.add(("act", s, m))
                elif a.kind is SG:
                    if ("gx", s, m) not in have[r]:
                        return False
                    mailbox.add(("grad", s, m))
                elif a.kind is F:
                    if s > 0 and ("x", s, m) not in have[r]:
                        return False
                    have[r].add(("y", s, m))
                    have[r].add(("ctx", s, m))
                    fwd_seq[s].append(m)
                    if s == S - 1:
                        have[r].add(("gy", s, m))
                else:
                    if ("ctx", s, m) not in have[r] or ("gy", s, m) not in have[r]:
                        return False
                    if fwd_seq[s][0] != m:  # FIFO contexts
                        return False
                    fwd_seq[s].pop(0)
                    have[r].add(("gx", s, m))
                pos[r] += 1
                progress = True
    return all(pos[r] == len(plan.actions[r]) for r in range(p))


# ---- wire format ---------------------------------------------------------------------------
def test_wire_format_round_trip_and_poison():
    a = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    d = wire._parse_declaration(wire._declaration(7, 2, a.shape, a.dtype), 7, 2, "x")
    assert (d.kind, d.shape, d.dtype, d.nbytes) == (wire._KIND_DATA, (3, 4, 5), np.float32, 240)
    assert wire._parse_declaration(wire._declaration(7, 2, a.shape, a.dtype), 8, 2,
                                 "x").error.startswith("x: declaration for step 7")
    p = wire._parse_declaration(wire._poison_declaration(7, 2, origin=3), 7, 2, "x")
    assert (p.kind, p.origin) == (wire._KIND_POISON, 3)
    bad = wire._declaration(7, 2, a.shape, a.dtype)
    bad[0] = 1
    assert "malformed" in wire._parse_declaration(bad, 7, 2, "x").error
    frame = wire._frame(7, 2, 9, a, a.nbytes)
    assert frame.size == 128 + 240
    assert wire._parse_frame(frame, 7, 2, 9, "x") == (wire._KIND_DATA, -1, None)
    np.testing.assert_array_equal(frame[128:].view(np.float32).reshape(a.shape), a)
    assert "microbatch 9 where step 7, stage 2, microbatch 8" in \
        wire._parse_frame(frame, 7, 2, 8, "x")[2]
    poison = wire._frame(7, 2, -1, None, 240, origin=1)
    assert poison.size == frame.size
    assert wire._parse_frame(poison, 7, 2, 4, "x")[:2] == (wire._KIND_POISON, 1)
    with pytest.raises(ValueError, match="at most 8 dimensions"):
        wire._declaration(1, 0, (1,) * 9, np.float64)
    with pytest.raises(TypeError, match="cannot carry dtype complex128"):
        wire._declaration(1, 0, (2,), np.dtype(np.complex128))
    # Tags of different message types, stages and microbatches never collide.
    tags = {wire._tag(c, s, m) for c in range(1, 5) for s in (0, 1, 4095) for m in (0, 1, 65535)}
    assert len(tags) == 4 * 3 * 3 and max(tags) < 2 ** 32


# ---- split_model -------------------------------------------------------------------------------
def test_split_model_balance_and_param_count():
    model = nn.Sequential(nn.Linear(4, 8, rng=0), nn.Tanh(), nn.Linear(8, 8, rng=1), nn.Tanh(),
                          nn.Linear(8, 2, rng=2))
    parts = split_model(model, 2, balance=[3, 2])
    assert [len(s) for s in parts] == [3, 2]
    assert parts[0][0] is model[0] and parts[1][1] is model[4]
    # By parameter count (40, 0, 72, 0, 18): best max is 72 alone... keep activations
    # with the layer before them.
    assert [len(s) for s in split_model(model, 2)] == [2, 3]
    assert [len(s) for s in split_model(model, 3)] == [2, 2, 1]
    assert [len(s) for s in split_model(model, 5)] == [1, 1, 1, 1, 1]
    x = np.ones((2, 4))
    y = model(x)
    z = x
    for part in split_model(model, 3):
        z = part(z)
    np.testing.assert_array_equal(y, z)
    model.clear_context()
    for part in split_model(model, 3):
        part.clear_context()
    with pytest.raises(ValueError, match="covers 4 layers, the model has 5"):
        split_model(model, 2, balance=[2, 2])
    with pytest.raises(ValueError, match="at least one layer"):
        split_model(model, 2, balance=[5, 0])
    with pytest.raises(ValueError, match=r"n_stages must be in \[1, 5\]"):
        split_model(model, 6)
    with pytest.raises(TypeError, match="Sequential"):
        split_model([model], 1)


# ---- the runtime: parity with the unsplit model -----------------------------------------------
def _model(n_layers_pairs: int, seed: int = 0) -> nn.Sequential:
    layers = [nn.Linear(D_IN, D_H, dtype=np.float64, rng=seed), nn.Tanh()]
    for i in range(n_layers_pairs - 1):
        layers += [nn.Linear(D_H, D_H, dtype=np.float64, rng=seed + 1 + i), nn.Tanh()]
    layers.append(nn.Linear(D_H, D_OUT, dtype=np.float64, rng=seed + 99))
    return nn.Sequential(*layers)


def _data(batch: int, seed: int = 5):
    g = np.random.default_rng(seed)
    return g.normal(size=(batch, D_IN)), g.normal(size=(batch, D_OUT))


def _reference(n_pairs: int, x, y, loss_fn=nn.mse_loss):
    model = _model(n_pairs)
    loss, g = loss_fn(model(x), y)
    model.backward(g)
    return loss, [p.grad.copy() for p in model.parameters()]


def _build(kind: str, rank: int, p: int, m: int, group=None, v: int = 2, **kw):
    n_stages = p * v if kind == "interleaved" else p
    model = _model(n_stages)
    chunks = split_model(model, n_stages)
    if kind == "interleaved":
        stages = [PipelineStage(chunks[s], s, n_stages, group=group)
                  for s in range(rank, n_stages, p)]
        return stages, ScheduleInterleaved1F1B(stages, m, loss_fn=nn.mse_loss, **kw)
    stage = PipelineStage(chunks[rank], rank, n_stages, group=group)
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    return [stage], cls(stage, m, loss_fn=nn.mse_loss, **kw)


def _grads(stages):
    return {st.stage_index: [p.grad.copy() for p in st.parameters()] for st in stages}


def _parity_rank(rank, p, kind, m, batch, steps=2):
    stages, sched = _build(kind, rank, p, m, timeout=30)
    x, y = _data(batch)
    losses = []
    for _ in range(steps):  # a second step accumulates: gradients double
        losses.append(sched.step(x if rank == 0 else None, y if rank == p - 1 else None))
    return losses, _grads(stages), sched.last_stats


def _check_parity(results, n_pairs, x, y, steps=2):
    ref_loss, ref_grads = _reference(n_pairs, x, y)
    got = {}
    for losses, grads, _ in results:
        got.update(grads)
    flat = [g for s in sorted(got) for g in got[s]]
    assert len(flat) == len(ref_grads)
    for g, r in zip(flat, ref_grads):
        np.testing.assert_allclose(g, steps * r, rtol=RTOL, atol=ATOL)
    last = results[-1][0]
    for loss in last:
        assert loss == pytest.approx(ref_loss, rel=RTOL, abs=ATOL)
    assert all(r[0] == [None] * steps for r in results[:-1])


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipelined_step_matches_unsplit_model(kind, p):
    m, batch = p + 2, 3 * (p + 2)  # more microbatches than stages, 3 samples each
    results = run_world(_parity_rank, p, args=(kind, m, batch), timeout=60)
    x, y = _data(batch)
    _check_parity(results, p, x, y)
    for rank, (_, _, stats) in enumerate(results):
        want = m if kind == "gpipe" else p - rank
        assert stats.peak_alive == want
        assert stats.peak_activation_bytes > 0
        assert 0 < stats.compute_time < stats.step_time


@pytest.mark.parametrize("p", [2, 3, 4])
def test_interleaved_two_virtual_stages_matches_unsplit_model(p):
    m, batch = 2 * p, 4 * p
    results = run_world(_parity_rank, p, args=("interleaved", m, batch), timeout=60)
    x, y = _data(batch)
    _check_parity(results, 2 * p, x, y)
    for rank, (_, grads, _) in enumerate(results):
        assert sorted(grads) == [rank, rank + p]


def test_fewer_microbatches_than_stages_and_single_rank():
    results = run_world(_parity_rank, 3, args=("1f1b", 1, 4), timeout=60)
    x, y = _data(4)
    _check_parity(results, 3, x, y)
    # One rank holding several stages: hand-offs stay local, no messages.
    results = run_world(_parity_rank, 1, args=("interleaved", 3, 6), timeout=60)
    x, y = _data(6)
    _check_parity(results, 2, x, y)


def _classify_rank(rank, p, m):
    model = nn.Sequential(nn.Linear(D_IN, D_H, dtype=np.float64, rng=3), nn.GELU(),
                          nn.Linear(D_H, 4, dtype=np.float64, rng=4))
    stage = PipelineStage(split_model(model, p, balance=[2, 1])[rank], rank, p,
                          input_shape=(None, D_IN) if rank == 0 else (None, D_H),
                          input_dtype=np.float64)
    sched = Schedule1F1B(stage, m)
    x = np.random.default_rng(1).normal(size=(8, D_IN))
    t = np.arange(8) % 4
    loss = sched.step(x if rank == 0 else None, t if rank == p - 1 else None,
                      loss_fn=nn.cross_entropy)
    return loss, [q.grad.copy() for q in stage.parameters()]


def test_cross_entropy_loss_passed_to_step():
    (l0, g0), (l1, g1) = run_world(_classify_rank, 2, args=(4,), timeout=60)
    model = nn.Sequential(nn.Linear(D_IN, D_H, dtype=np.float64, rng=3), nn.GELU(),
                          nn.Linear(D_H, 4, dtype=np.float64, rng=4))
    x = np.random.default_rng(1).normal(size=(8, D_IN))
    loss, g = nn.cross_entropy(model(x), np.arange(8) % 4)
    model.backward(g)
    assert l0 is None and l1 == pytest.approx(loss, rel=RTOL)
    for a, b in zip(g0 + g1, [q.grad for q in model.parameters()]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


# ---- pipeline × data ---------------------------------------------------------------------------
def _pp_dp_rank(rank, world, m):
    layout = pipeline_data_groups(2, 2)
    stages, sched = _build("1f1b", layout.stage, 2, m, group=layout.pp_group, timeout=30)
    x, y = _data(16)
    shard = slice(8 * layout.replica, 8 * layout.replica + 8)  # each replica: half the batch
    loss = sched.step(x[shard] if layout.stage == 0 else None,
                      y[shard] if layout.stage == 1 else None)
    before = _grads(stages)
    all_reduce_gradients(stages, layout.dp_group)
    return layout, loss, before, _grads(stages)


def test_pipeline_times_data_parallel_on_four_ranks():
    results = run_world(_pp_dp_rank, 4, args=(4,), timeout=60)
    assert [(r[0].stage, r[0].replica) for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [r[0].pp_group.ranks for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[0].dp_group.ranks for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    x, y = _data(16)
    ref_loss, ref_grads = _reference(2, x, y)
    # Each replica's own loss is its half's mean; their average is the global mean.
    shard_losses = [results[1][1], results[3][1]]
    assert np.mean(shard_losses) == pytest.approx(ref_loss, rel=RTOL)
    assert shard_losses[0] != pytest.approx(shard_losses[1])
    for replica in (0, 1):
        got = {}
        for r in (2 * replica, 2 * replica + 1):
            got.update(results[r][3])
        flat = [g for s in sorted(got) for g in got[s]]
        for g, ref in zip(flat, ref_grads):
            np.testing.assert_allclose(g, ref, rtol=RTOL, atol=ATOL)
    # Before the all-reduce the replicas really differed.
    assert not np.allclose(results[0][2][0][0], results[2][2][0][0])


# ---- errors ---------------------------------------------------------------------------
def _config_errors(rank, p):
    model = _model(2 * p)
    chunks = split_model(model, 2 * p)
    other = (rank + 1) % p
    with pytest.raises(ValueError, match=rf"stage {other} belongs on pipeline rank {other} "
                                         rf"\(looping placement, group size {p}\), but this "
                                         rf"is rank {rank}"):
        PipelineStage(chunks[other], other, 2 * p)
    mine = PipelineStage(chunks[rank], rank, 2 * p)
    with pytest.raises(ValueError, match=r"4 stages but the group has 2 ranks"):
        Schedule1F1B(mine, 4)
    with pytest.raises(ValueError, match=r"4 stages but the group has 2 ranks"):
        ScheduleGPipe(mine, 4)
    both = [mine, PipelineStage(chunks[rank + p], rank + p, 2 * p)]
    with pytest.raises(ValueError, match=r"multiple of the pipeline group size 2, got 3 "
                                         r"\(try 4\)"):
        ScheduleInterleaved1F1B(both, 3)
    with pytest.raises(ValueError, match=r"must hold stages \[\d, \d\]"):
        ScheduleInterleaved1F1B([mine], 4)
    with pytest.raises(ValueError, match="n_microbatches must be in"):
        ScheduleInterleaved1F1B(both, 0)
    with pytest.raises(TypeError, match="takes one PipelineStage"):
        ScheduleGPipe(both, 2)
    with pytest.raises(ValueError, match=r"num_stages \(3\) must be a multiple"):
        PipelineStage(chunks[rank], rank, 3)
    with pytest.raises(TypeError, match="forward"):
        PipelineStage(object(), rank, 2)


def test_configuration_errors_on_every_rank():
    assert issubclass(PipelineError, ringlet.RingletError)
    run_world(_config_errors, 2, timeout=60)


class _Boom(nn.Module):
    """Identity that raises on microbatch ``at`` of the first step (forward or backward)."""

    def __init__(self, where: str, at: int) -> None:
        super().__init__()
        self.where, self.at, self.calls = where, at, {"forward": 0, "backward": 0}

    def _count(self, what: str) -> None:
        k = self.calls[what]
        self.calls[what] += 1
        if self.where == what and k == self.at:  # later steps count past it
            raise RuntimeError(f"boom in {what} of microbatch {self.at}")

    def forward(self, x):
        self._count("forward")
        self._save(None)
        return x

    def backward(self, g):
        self._count("backward")
        self._pop()
        return g


def _failing_rank(rank, p, kind, bad_rank, where, at):
    m = 2 * p
    n_stages = 2 * p if kind == "interleaved" else p
    model = _model(n_stages)
    chunks = split_model(model, n_stages)
    for s in range(n_stages):
        chunks[s].append(_Boom(where if s == bad_rank else "none", at))
    if kind == "interleaved":
        stages = [PipelineStage(chunks[s], s, n_stages) for s in range(rank, n_stages, p)]
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=nn.mse_loss, timeout=30)
    else:
        stages = [PipelineStage(chunks[rank], rank, n_stages)]
        cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
        sched = cls(stages[0], m, loss_fn=nn.mse_loss, timeout=30)
    x, y = _data(2 * m)
    t0 = time.monotonic()
    err = None
    try:
        sched.step(x if rank == 0 else None, y if rank == p - 1 else None)
    except Exception as e:  # noqa: BLE001 - inspected by the test
        err = e
    took = time.monotonic() - t0
    # The group is still usable: a clean second step gives the reference result.
    for st in stages:
        st.module.zero_grad()
    loss = sched.step(x if rank == 0 else None, y if rank == p - 1 else None)
    return type(err).__name__, str(err), getattr(err, "failures", None), took, loss, \
        _grads(stages)


@pytest.mark.parametrize("kind,p,bad_rank,where,at", [
    ("gpipe", 3, 1, "forward", 2),
    ("1f1b", 4, 2, "backward", 0),
    ("1f1b", 3, 0, "backward", 5),      # first stage, last microbatch: peers are done
    ("1f1b", 2, 1, "forward", 0),       # last stage, very first forward
    ("interleaved", 2, 1, "forward", 3),
])
def test_stage_raising_mid_step_fails_every_rank_fast_then_recovers(kind, p, bad_rank,
                                                                     where, at):
    results = run_world(_failing_rank, p, args=(kind, bad_rank, where, at), timeout=60)
    for rank, (name, msg, failures, took, loss, grads) in enumerate(results):
        assert took < 10, f"rank {rank} took {took:.1f}s to fail (timeout is 30s)"
        if rank == bad_rank:
            assert name == "RuntimeError" and f"boom in {where} of microbatch {at}" in msg
        else:
            assert name == PipelineError.__name__, msg
            assert f"pipeline rank {bad_rank}: stage(s)" in msg and "boom" in msg
            assert list(failures) == [bad_rank]
    # Recovery: the second step matches the unsplit model (contexts were cleared).
    n_pairs = 2 * p if kind == "interleaved" else p
    x, y = _data(4 * p)
    _check_parity([([r[4]], r[5], None) for r in results], n_pairs, x, y, steps=1)


class _Misbehave(nn.Module):
    """Identity, except on some calls: a ragged output or a wrong-shaped input gradient."""

    def __init__(self, kind: str, calls: range) -> None:
        super().__init__()
        self.kind, self.calls, self.n = kind, calls, {"forward": 0, "backward": 0}
        self.active = True  # the test switches it off after the failing step

    def forward(self, x):
        k = self.n["forward"]
        self.n["forward"] += 1
        self._save(None)
        return x[:, :-1] if self.active and self.kind == "ragged" and k in self.calls else x

    def backward(self, g):
        k = self.n["backward"]
        self.n["backward"] += 1
        self._pop()
        if self.active and self.kind == "grad" and k in self.calls:
            return np.zeros((g.shape[0], g.shape[1] + 1))
        return g


def _bad_input_rank(rank, p, case):
    m = 4
    chunks = split_model(_model(p), p)
    odd = None
    if case == "ragged" and rank == 0:  # microbatch 1's output is narrower
        odd = _Misbehave("ragged", range(1, 2))
        chunks[0].append(odd)
    if case == "grad" and rank == 1:  # every input gradient is too wide
        odd = _Misbehave("grad", range(10 ** 6))
        chunks[1] = nn.Sequential(odd, *chunks[1])
    shape = (None, D_H + 1) if case == "shape" and rank == p - 1 else None
    stage = PipelineStage(chunks[rank], rank, p, input_shape=shape)
    sched = Schedule1F1B(stage, m, loss_fn=nn.mse_loss, timeout=30)
    x, y = _data(8)
    bad_x = {"indivisible": _data(9)[0], "missing": None}.get(case, x)
    try:
        sched.step(bad_x if rank == 0 else None, y if rank == p - 1 else None)
        err = (None, None)
    except Exception as e:  # noqa: BLE001
        err = (type(e).__name__, str(e))
    if case == "shape":
        return err, None
    if odd is not None:
        odd.active = False
    stage.module.zero_grad()  # the failed step may have accumulated some gradients
    loss = sched.step(x if rank == 0 else None, y if rank == p - 1 else None)
    return err, ([loss], _grads([stage]), None)


@pytest.mark.parametrize("case,bad_rank,pattern", [
    ("indivisible", 0, r"shape \(9, 5\): dimension 0 must split evenly into n_microbatches=4"),
    ("missing", 0, "holds stage 0 and must pass inputs"),
    ("shape", 2, r"stage 2: input from stage 1 has shape \(2, 7\) \(expected \(\*, 8\)\)"),
    ("ragged", 0, r"stage 0: output of microbatch 1 has shape \(2, 6\) float64, but this "
                  r"step's first was \(2, 7\) float64"),
    ("grad", 0, r"stage 0: the gradients from stage 1 have shape \(2, 8\) float64, but the "
                r"activations sent were \(2, 7\) float64"),
])
def test_bad_inputs_raise_there_and_peers_get_pipeline_error(case, bad_rank, pattern):
    p = 3
    results = run_world(_bad_input_rank, p, args=(case,), timeout=60)
    for rank, ((name, msg), _) in enumerate(results):
        if rank == bad_rank:
            assert name in ("ValueError", "TypeError")
            assert re.search(pattern, msg), msg
        else:
            assert name == PipelineError.__name__ and f"pipeline rank {bad_rank}" in msg
    if case != "shape":  # nothing stale is left: the next step is exact
        x, y = _data(8)
        _check_parity([r[1] for r in results], p, x, y, steps=1)


def test_run_world_error_is_reported_not_hung():
    """A rank that never calls step: its peers fail by the schedule's timeout, not hang."""
    def body(rank, p):
        stages, sched = _build("gpipe", rank, p, 2, timeout=2)
        if rank == 1:
            return "skipped"
        x, y = _data(4)
        sched.step(x, None)

    t0 = time.monotonic()
    with pytest.raises(WorldError) as info:
        run_world(body, 2, timeout=30)
    assert time.monotonic() - t0 < 20
    # rank 0 alone failed, with a ringlet error naming the absent peer: it has
    # left (closed, or reset during the handshake) or not answered within the
    # schedule's 2 s
    err = info.value
    assert sorted(err.failures) == [0] and err.results == {1: "skipped"}, str(err)
    exc = err.exceptions[0]
    assert isinstance(exc, RingletError) and "peer 1" in str(exc), repr(exc)


class _Crash(nn.Module):
    """Identity whose process dies (no exception, no cleanup) on forward number ``at``."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls > self.at:
            import os

            os._exit(3)
        self._save(None)
        return x

    def backward(self, g):
        self._pop()
        return g


def _crashing_rank(rank, p):
    chunks = split_model(_model(p), p)
    if rank == 1:
        chunks[1].append(_Crash(at=1))
    stage = PipelineStage(chunks[rank], rank, p)
    sched = Schedule1F1B(stage, 4, loss_fn=nn.mse_loss, timeout=60)
    x, y = _data(8)
    t0 = time.monotonic()
    try:
        sched.step(x if rank == 0 else None, y if rank == p - 1 else None)
    except ringlet.RingletError as e:
        return type(e).__name__, time.monotonic() - t0
    return None, time.monotonic() - t0


def test_crashed_stage_process_fails_peers_fast():
    """A stage's process dies mid-step: its peers get a ringlet error well before the timeout."""
    t0 = time.monotonic()
    with pytest.raises(WorldError) as e:
        run_world(_crashing_rank, 3, mode="process", timeout=90)
    assert list(e.value.failures) == [1] and "exited with code 3" in e.value.failures[1]
    for rank in (0, 2):
        name, took = e.value.results[rank]
        assert name is not None and took < 30, (rank, name, took)
    assert time.monotonic() - t0 < 60


# ---- a stage out of memory ---------------------------------------------------------------------
# The runtime's failure protocol sends every frame the failing rank still owes as a POISON frame
# of the declared size (a posted receive takes exactly that size).  It allocates those frames
# (and the buffers to drain what it still expects) anew, and only a ringlet error is caught
# around the protocol: a stage that runs out of memory then fails again building the first
# poison frame, its peers are never told and wait out their timeout, and the MemoryError they
# would see names the runtime instead of the stage.  The fix belongs in
# ringlet/parallel/pipeline/runtime.py (reuse the channel's last sent frame as its poison when
# no new one can be allocated), which this change does not own.
_OOM_WIDTH = 8 << 20  # float64 values per sample: one microbatch's frame is 64 MiB
_OOM_HEADROOM = 16 << 20  # bytes of address space left once memory "runs out"
_OOM_TIMEOUT = 10.0


def _run_out_of_address_space():
    """Cap this process's address space just above its use: only small allocations succeed."""
    import resource

    with open("/proc/self/status") as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (used + _OOM_HEADROOM, hard))


class _Widen(nn.Module):
    """(b, 1) -> (b, _OOM_WIDTH) copies; forward number ``fail_at`` runs out of memory."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at, self.calls = fail_at, 0

    def forward(self, x):
        k = self.calls
        self.calls += 1
        if k == self.fail_at:
            _run_out_of_address_space()
            raise MemoryError(f"stage 0 ran out of memory in forward {k}")
        self._save(None)
        return np.repeat(x, _OOM_WIDTH, axis=1)

    def backward(self, g):
        self._pop()
        return g.sum(axis=1, keepdims=True)


class _Narrow(nn.Module):
    """(b, w) -> its first column."""

    def forward(self, y):
        self._save(y.shape)
        return y[:, :1].copy()

    def backward(self, g):
        out = np.zeros(self._pop())
        out[:, :1] = g
        return out


def _oom_rank(rank, p):
    import resource

    stage = PipelineStage(_Widen(fail_at=1) if rank == 0 else _Narrow(), rank, p)
    sched = ScheduleGPipe(stage, 2, loss_fn=nn.mse_loss, timeout=_OOM_TIMEOUT)
    x, y = np.array([[1.0], [2.0]]), np.array([[0.5], [1.0]])
    limits = resource.getrlimit(resource.RLIMIT_AS)
    t0 = time.monotonic()
    err = None
    try:
        sched.step(x if rank == 0 else None, y if rank == 1 else None)
    except Exception as e:  # noqa: BLE001 - inspected by the test
        err = (type(e).__name__, str(e), getattr(e, "failures", None))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)  # memory is back
    took = time.monotonic() - t0
    loss = sched.step(x if rank == 0 else None, y if rank == 1 else None)
    return err, took, loss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS, /proc/self/status")
def test_stage_out_of_memory_fails_every_rank_fast_then_recovers():
    """Stage 0 sent microbatch 0's 64 MiB frame, then runs out of memory in the next forward:
    stage 1, waiting for microbatch 1's frame, must get a PipelineError naming the stage and
    the MemoryError well before the timeout, and the next step must run normally."""
    results = run_world(_oom_rank, 2, mode="process", timeout=120)
    (err0, took0, loss0), (err1, took1, loss1) = results
    assert err0[:2] == ("MemoryError", "stage 0 ran out of memory in forward 1"), err0
    assert err1[0] == PipelineError.__name__, err1
    assert ("pipeline rank 0: stage(s) [0] raised MemoryError: stage 0 ran out of memory in "
            "forward 1") in err1[1], err1
    assert list(err1[2]) == [0]
    assert max(took0, took1) < _OOM_TIMEOUT / 2, (took0, took1)
    assert loss0 is None and loss1 == pytest.approx(0.625)  # mean of 0.5^2 and 1^2


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("this exception cannot be printed")


class _RaiseUnprintable(nn.Module):
    def forward(self, x):
        raise _Unprintable()

    def backward(self, g):
        return g


def test_stage_raising_an_unprintable_exception_fails_every_rank_fast():
    """The failing rank's message for its peers is built after the failure flags were
    all-reduced: if str() of its exception raises, it must still join the all_gather_object
    its peers are waiting in."""
    def body(rank, p):
        chunks = split_model(_model(p), p)
        if rank == 1:
            chunks[1] = nn.Sequential(_RaiseUnprintable(), *chunks[1])
        stage = PipelineStage(chunks[rank], rank, p)
        sched = Schedule1F1B(stage, 2, loss_fn=nn.mse_loss, timeout=_OOM_TIMEOUT)
        x, y = _data(4)
        t0 = time.monotonic()
        try:
            sched.step(x if rank == 0 else None, y if rank == p - 1 else None)
        except _Unprintable:
            return "_Unprintable", None, time.monotonic() - t0
        except Exception as e:  # noqa: BLE001 - inspected by the test
            return type(e).__name__, str(e), time.monotonic() - t0
        return None, None, time.monotonic() - t0

    results = run_world(body, 3, timeout=60)
    for rank, (name, msg, took) in enumerate(results):
        assert took < _OOM_TIMEOUT / 2, (rank, took)
        if rank == 1:
            assert name == "_Unprintable"
        else:
            assert name == PipelineError.__name__ and "pipeline rank 1: stage(s) [1] raised " \
                "_Unprintable" in msg, (name, msg)


# ---- a stage interrupted: Ctrl-C, sys.exit() ----------------------------------------------------
# KeyboardInterrupt, SystemExit and GeneratorExit are BaseExceptions, not Exceptions: the failure
# protocol must run for them too, or the peers wait out the schedule's timeout.  That timeout is
# long here; the run_world deadline, well under it, is the bound the peers must beat.
_INTERRUPT_TIMEOUT = 60.0


class _Interrupt(nn.Module):
    """Identity whose forward number ``at`` raises ``exc`` (later calls count past it)."""

    def __init__(self, exc: BaseException, at: int) -> None:
        super().__init__()
        self.exc, self.at, self.calls = exc, at, 0

    def forward(self, x):
        k = self.calls
        self.calls += 1
        if k == self.at:
            raise self.exc
        self._save(None)
        return x

    def backward(self, g):
        self._pop()
        return g


def _interrupted_rank(rank, p, kind, bad_stage, at, exc_type):
    m = 2 * p
    n_stages = 2 * p if kind == "interleaved" else p
    chunks = split_model(_model(n_stages), n_stages)
    raised = exc_type(3) if exc_type is SystemExit else exc_type()
    chunks[bad_stage].append(_Interrupt(raised, at))
    if kind == "interleaved":
        stages = [PipelineStage(chunks[s], s, n_stages) for s in range(rank, n_stages, p)]
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=nn.mse_loss,
                                        timeout=_INTERRUPT_TIMEOUT)
    else:
        stages = [PipelineStage(chunks[rank], rank, n_stages)]
        cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
        sched = cls(stages[0], m, loss_fn=nn.mse_loss, timeout=_INTERRUPT_TIMEOUT)
    x, y = _data(2 * m)
    t0 = time.monotonic()
    err = None
    try:
        sched.step(x if rank == 0 else None, y if rank == p - 1 else None)
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt & co. inspected by the test
        err = e
    took = time.monotonic() - t0
    # The group is still usable, on the interrupted rank too.
    for st in stages:
        st.module.zero_grad()
    loss = sched.step(x if rank == 0 else None, y if rank == p - 1 else None)
    return (type(err).__name__, str(err), getattr(err, "failures", None), err is raised,
            getattr(err, "code", None), took, loss, _grads(stages))


@pytest.mark.parametrize("exc_type,kind,p,bad_stage,at", [
    (KeyboardInterrupt, "1f1b", 3, 1, 2),      # a middle stage, mid-step
    (SystemExit, "gpipe", 2, 1, 0),            # the last stage's very first forward
    (GeneratorExit, "interleaved", 2, 0, 3),   # the first stage, its last microbatch
])
def test_stage_interrupted_mid_step_fails_every_rank_fast_then_recovers(exc_type, kind, p,
                                                                        bad_stage, at):
    """A KeyboardInterrupt (Ctrl-C) or SystemExit from a stage's forward: that rank raises the
    very exception its module raised, the others a PipelineError saying the stage was
    interrupted, all well before the 60 s schedule timeout (run_world's 20 s deadline fails the
    test otherwise), and the next step is exact on every rank."""
    results = run_world(_interrupted_rank, p, args=(kind, bad_stage, at, exc_type), timeout=20)
    stages = list(range(bad_stage, 2 * p, p)) if kind == "interleaved" else [bad_stage]
    how = "SystemExit: 3" if exc_type is SystemExit else exc_type.__name__
    for rank, (name, msg, failures, same, code, took, _, _) in enumerate(results):
        assert took < 10, f"rank {rank} took {took:.1f}s to fail (timeout is 60s)"
        if rank == bad_stage:
            assert name == exc_type.__name__ and same, (name, msg)  # unchanged, not wrapped
            assert code == (3 if exc_type is SystemExit else None)
        else:
            assert name == PipelineError.__name__, (name, msg)
            assert f"pipeline rank {bad_stage}: stage(s) {stages} was interrupted ({how})" \
                in msg, msg
            assert list(failures) == [bad_stage]
    n_pairs = 2 * p if kind == "interleaved" else p
    x, y = _data(4 * p)
    _check_parity([([r[6]], r[7], None) for r in results], n_pairs, x, y, steps=1)


class _CtrlC(nn.Module):
    """Identity whose forward number ``at`` gets a real Ctrl-C: SIGINT to this process."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0
        self.first: Optional[BaseException] = None  # the KeyboardInterrupt it raised
        self.fired = threading.Event()

    def forward(self, x):
        k = self.calls
        self.calls += 1
        if k == self.at:
            try:
                signal.raise_signal(signal.SIGINT)  # Python's handler raises here
            except KeyboardInterrupt as e:
                self.first = e
                self.fired.set()
                raise
            raise AssertionError("SIGINT did not raise KeyboardInterrupt")
        self._save(None)
        return x

    def backward(self, g):
        self._pop()
        return g


def _second_ctrl_c(tid: int, sent: list) -> None:
    # The kernel says the main thread is blocked in a ringlet wait: no timer.
    if wait_until_blocked(tid, timeout=_INTERRUPT_TIMEOUT):
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)


def _ctrl_c_twice_rank(rank, p):
    """Step 1 is normal.  In step 2, rank 2 stays away; rank 0's forward gets a Ctrl-C, so its
    failure protocol ends in the all-reduce of failure flags, where it blocks (rank 2 never
    comes) until a second Ctrl-C, sent once the kernel shows it blocked, ends it."""
    chunks = split_model(_model(p), p)
    ctrl_c = None
    if rank == 0:
        # A job started in the background inherits SIGINT ignored: no KeyboardInterrupt then.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        ctrl_c = _CtrlC(at=4)  # step 2's first forward (4 microbatches a step)
        chunks[0].append(ctrl_c)
    stage = PipelineStage(chunks[rank], rank, p)
    sched = Schedule1F1B(stage, 4, loss_fn=nn.mse_loss, timeout=_INTERRUPT_TIMEOUT)
    x, y = _data(8)
    args = (x if rank == 0 else None, y if rank == p - 1 else None)
    sched.step(*args)
    t0 = time.monotonic()
    if rank == 2:  # alive but elsewhere, until the job's failure reaches it
        try:
            ringlet.recv(np.empty(1), 0, tag=99, timeout=_INTERRUPT_TIMEOUT)
        except ringlet.RingletError as e:
            return type(e).__name__, time.monotonic() - t0
        return "received", time.monotonic() - t0
    sent: list = []
    if rank == 0:
        def second():
            if ctrl_c.fired.wait(_INTERRUPT_TIMEOUT):
                _second_ctrl_c(threading.main_thread().native_id, sent)

        threading.Thread(target=second, daemon=True).start()
    try:
        sched.step(*args)
    except KeyboardInterrupt as e:
        return "KeyboardInterrupt", time.monotonic() - t0, e is ctrl_c.first, len(sent)
    except ringlet.RingletError as e:
        return type(e).__name__, time.monotonic() - t0
    return "completed", time.monotonic() - t0


def test_second_ctrl_c_ends_the_failure_protocol_at_once():
    """The protocol run for a Ctrl-C cannot swallow the next one: rank 0 gets a real SIGINT in
    its forward, runs the protocol, blocks in its final all-reduce (rank 2 stays away), and a
    second SIGINT ends that at once with a KeyboardInterrupt; ringlet then tells the peers.
    Without the protocol for the first Ctrl-C rank 0 never blocks and no second one is sent."""
    res = run_world(_ctrl_c_twice_rank, 3, mode="process", timeout=45)
    assert res[0][0] == "KeyboardInterrupt", res
    _, took, is_first, sent = res[0]
    assert sent == 1, res  # rank 0 blocked inside the step, after its first Ctrl-C
    assert not is_first, res  # the second Ctrl-C's, not swallowed by the protocol
    assert took < 10, res  # not the schedule's 60 s
    for rank in (1, 2):
        name, took = res[rank]
        assert name not in ("completed", "received") and took < 10, res


# ---- the example ------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [[], ["--schedule", "interleaved", "--dp", "2",
                                        "--microbatches", "4"]])
def test_example_trains_under_ringlet_run(extra):
    """``ringlet run -n 4 examples/train_pipeline.py``: the loss goes down (it checks)."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_pipeline.py"
    env = clean_env()
    out = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "4", str(script),
                          "--steps", "40"] + extra, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"loss \d\.\d+ -> \d\.\d+ in 40 steps", out.stdout), out.stdout


def _custom_plan_rank(rank, p):
    from ringlet.pipeline import PipelineSchedule

    chunks = split_model(_model(p), p)
    stage = PipelineStage(chunks[rank], rank, p)
    good = plan_1f1b(p, 4)
    broken = _swap(good, 1, 0, 1)  # rank 1 computes before receiving its input
    with pytest.raises(ScheduleError, match="before receiving its input"):
        PipelineSchedule([stage], 4, broken)
    with pytest.raises(ValueError, match="the plan has 4 microbatches, not 2"):
        PipelineSchedule([stage], 2, good)
    with pytest.raises(ValueError, match="the plan is for 3 ranks"):
        PipelineSchedule([stage], 4, plan_gpipe(3, 4))
    sched = PipelineSchedule([stage], 4, good, loss_fn=nn.mse_loss, timeout=30)
    x, y = _data(8)
    loss = sched.step(x if rank == 0 else None, y if rank == p - 1 else None)
    return [loss], _grads([stage]), None


def test_custom_plan_runs_through_the_generic_runtime_after_validation():
    results = run_world(_custom_plan_rank, 2, timeout=60)
    x, y = _data(8)
    _check_parity(results, 2, x, y, steps=1)


def _custom_plan_limits_rank(rank, p):
    from ringlet.pipeline import PipelineSchedule

    stage = PipelineStage(split_model(_model(p), p)[rank], rank, p)
    # A hand-made plan gets the named schedules' microbatch limits (tags hold
    # 16 bits of microbatch), in the constructor, before the simulator runs.
    huge = Plan("custom", p, p, 65537, ((),) * p)
    with pytest.raises(ValueError, match="n_microbatches must be in"):
        PipelineSchedule([stage], 65537, huge)
    with pytest.raises(ValueError, match="at most 65536 microbatches"):
        PipelineSchedule([stage], 4, huge)
    empty = Plan("custom", p, p, 0, ((),) * p)   # the simulator accepts it: nothing to run
    with pytest.raises(ValueError, match="n_microbatches must be in"):
        PipelineSchedule([stage], 0, empty)
    return True


def test_custom_plan_gets_the_microbatch_limits():
    assert all(run_world(_custom_plan_limits_rank, 2, timeout=60))


def _mismatched_schedules_rank(rank, p):
    stage = PipelineStage(split_model(_model(p), p)[rank], rank, p)
    m = 4 if rank == 0 else 8   # rank 0 disagrees
    sched = Schedule1F1B(stage, m, loss_fn=nn.mse_loss, timeout=30)
    x, y = _data(8)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        sched.step(x if rank == 0 else None, y if rank == p - 1 else None)
    took = time.monotonic() - t0
    # The group is still usable: the same schedule everywhere runs.
    good = Schedule1F1B(stage, 4, loss_fn=nn.mse_loss, timeout=30)
    stage.module.zero_grad()
    loss = good.step(x if rank == 0 else None, y if rank == p - 1 else None)
    return str(info.value), took, ([loss], _grads([stage]), None)


def test_ranks_with_different_schedules_raise_value_error_on_every_rank():
    p = 3
    results = run_world(_mismatched_schedules_rank, p, timeout=60)
    for rank, (msg, took, _) in enumerate(results):
        # Before, the ranks waited on each other until CollectiveTimeout (30 s).
        assert took < 10, (rank, took)
        assert "built different schedules" in msg, msg
        assert "pipeline rank 0: 1f1b p=3 stages=3 m=4" in msg, msg
        assert "pipeline rank 2: 1f1b p=3 stages=3 m=8" in msg, msg
    x, y = _data(8)
    _check_parity([r[2] for r in results], p, x, y, steps=1)


def _custom_layout_rank(rank, n):
    from ringlet.mesh import DeviceMesh

    # The pp line is [0, 2, 1] in coordinate order; the pipeline group orders
    # its members by world rank, and PipelineStage places stage s on group rank s.
    mesh = DeviceMesh((1, 3), ("dp", "pp"), ranks=[0, 2, 1])
    layout = pipeline_data_groups(mesh=mesh)
    assert layout.stage == ringlet.get_rank(layout.pp_group)
    stage = PipelineStage(split_model(_model(3), 3)[layout.stage], layout.stage, 3,
                          group=layout.pp_group)
    sched = Schedule1F1B(stage, 2, loss_fn=nn.mse_loss, timeout=30)
    x, y = _data(4)
    loss = sched.step(x if layout.stage == 0 else None, y if layout.stage == 2 else None)
    return (layout.stage, layout.replica, mesh.coordinate), ([loss], _grads([stage]), None)


def test_pipeline_data_groups_with_out_of_order_pp_line():
    results = run_world(_custom_layout_rank, 3, timeout=60)
    # World rank 2 sits at coordinate 1 but is pipeline (group) rank 2.
    assert [r[0] for r in results] == [(0, 0, (0, 0)), (1, 0, (0, 2)), (2, 0, (0, 1))]
    x, y = _data(4)
    _check_parity([r[1] for r in results], 3, x, y, steps=1)


class _ByteSwap(nn.Module):
    """Identity that returns its output (forward) or input gradient (backward) big-endian."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, x):
        self._save(None)
        return x.astype(">f8") if self.what == "forward" else x

    def backward(self, g):
        self._pop()
        return g.astype(">f8") if self.what == "backward" else g


def _byte_swapped_rank(rank, p):
    chunks = split_model(_model(p), p)
    chunks[0].append(_ByteSwap("forward"))  # stage 0 sends big-endian activations
    chunks[1] = nn.Sequential(_ByteSwap("backward"), *chunks[1])  # and stage 1 gradients
    stage = PipelineStage(chunks[rank], rank, p)
    sched = Schedule1F1B(stage, 2, loss_fn=nn.mse_loss, timeout=30)
    x, y = _data(4)
    loss = sched.step(x if rank == 0 else None, y if rank == p - 1 else None)
    return [loss], _grads([stage]), None


def test_byte_swapped_arrays_cross_the_pipeline_intact():
    if np.dtype(">f8").isnative:
        pytest.skip("big-endian host: '>f8' is native")
    # Before, frames carried '>f8' bytes declared as float64 and the receiver
    # read them as native: wrong values, no error.
    results = run_world(_byte_swapped_rank, 2, timeout=60)
    x, y = _data(4)
    _check_parity(results, 2, x, y, steps=1)
    with pytest.raises(TypeError, match="native byte order only"):
        wire._declaration(1, 0, (2,), np.dtype(">f4"))
