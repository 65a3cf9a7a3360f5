"""Pipeline schedules as data, and a simulator that checks them.

A schedule is a ``Plan``: for every rank, the ordered list of ``Action`` s it
runs in one training step.  Computation actions are ``FORWARD`` and
``BACKWARD`` of microbatch m on stage s; communication actions move the
activation a stage produced to the next stage (``SEND_ACT`` / ``RECV_ACT``)
and the gradient of a stage's input back to the previous one
(``SEND_GRAD`` / ``RECV_GRAD``).  The stage named in an action is always the
*local* stage it concerns:

==============  ==================================================  ===================
action          meaning                                             matched by
==============  ==================================================  ===================
RECV_ACT(s, m)  receive stage s's input for m (from stage s-1)      SEND_ACT(s-1, m)
SEND_ACT(s, m)  send stage s's output for m (to stage s+1)          RECV_ACT(s+1, m)
RECV_GRAD(s,m)  receive the gradient of stage s's output (from s+1) SEND_GRAD(s+1, m)
SEND_GRAD(s,m)  send the gradient of stage s's input (to s-1)       RECV_GRAD(s-1, m)
==============  ==================================================  ===================

Stages are placed by looping placement: stage s lives on rank ``s % p``, so
with ``v`` virtual stages per rank, rank r holds stages r, r+p, r+2p, ...
When two neighbouring stages share a rank (only with one rank), the hand-off
is local and the plan has no communication actions for it.

``simulate(plan)`` executes a plan under the runtime's semantics, sends
asynchronous and receives blocking, and raises ``ScheduleError`` for any
dependency violation, unmatched message or deadlock.  It also times the plan
under a simple cost model (every forward takes ``forward_time``, every
backward ``backward_time``, messages take ``comm_time``) and counts, per rank,
the peak number of microbatches whose activations are alive (forward done,
backward not yet).  ``Plan.table()`` renders that timeline as a grid.

Example::

    >>> from ringlet.pipeline import plan_1f1b
    >>> print(plan_1f1b(num_ranks=2, n_microbatches=3).table())  # doctest: +SKIP
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "ActionKind", "Action", "Plan", "ScheduleError", "SimResult", "ScheduleTable",
    "plan_gpipe", "plan_1f1b", "plan_interleaved_1f1b", "simulate", "bubble_fraction",
    "MAX_STAGES", "MAX_MICROBATCHES",
]

# The runtime encodes (stage, microbatch) in 32-bit message tags; see runtime.py.
MAX_STAGES = 4096
MAX_MICROBATCHES = 65536


class ScheduleError(ValueError):
    """A plan breaks a dependency, leaves a message unmatched or deadlocks."""


class ActionKind(enum.Enum):
    """What an ``Action`` does.  The value is the short label used in tables."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"


F, B = ActionKind.FORWARD, ActionKind.BACKWARD
SA, RA, SG, RG = (ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD,
                  ActionKind.RECV_GRAD)
COMPUTE = (F, B)


@dataclass(frozen=True)
class Action:
    """One step of a rank's plan: ``kind`` applied to ``stage`` for ``microbatch``."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}(s{self.stage},m{self.microbatch})"

    __repr__ = __str__


def _peer_action(a: Action) -> Action:
    """The action on the neighbouring stage's rank that matches communication ``a``."""
    if a.kind is SA:
        return Action(RA, a.stage + 1, a.microbatch)
    if a.kind is RA:
        return Action(SA, a.stage - 1, a.microbatch)
    if a.kind is SG:
        return Action(RG, a.stage - 1, a.microbatch)
    if a.kind is RG:
        return Action(SG, a.stage + 1, a.microbatch)
    raise ValueError(f"{a} is not a communication action")


def _check_count(value, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class Plan:
    """Per-rank action lists of one training step.

    Attributes:
        name: the schedule's name ("gpipe", "1f1b", "interleaved-1f1b").
        num_ranks: ranks in the pipeline group (p).
        num_stages: total stages (p × virtual stages per rank).
        n_microbatches: microbatches per step (m).
        actions: ``actions[r]`` is rank r's ordered tuple of ``Action``.
    """

    name: str
    num_ranks: int
    num_stages: int
    n_microbatches: int
    actions: Tuple[Tuple[Action, ...], ...]

    def stage_rank(self, stage: int) -> int:
        """The rank holding ``stage`` (looping placement)."""
        return stage % self.num_ranks

    def stages_of(self, rank: int) -> List[int]:
        """The stages rank ``rank`` holds, in increasing order."""
        return list(range(rank, self.num_stages, self.num_ranks))

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.num_ranks

    def simulate(self, **kw) -> "SimResult":
        """``simulate(self, **kw)``: validate and time this plan."""
        return simulate(self, **kw)

    def table(self, *, forward_time: int = 1, backward_time: int = 1) -> "ScheduleTable":
        """The grid of compute actions per rank and time step (validates the plan first).

        Args:
            forward_time, backward_time: integer time units of one forward and
                one backward of one stage (default 1 each).
        Returns:
            A ``ScheduleTable``; ``str()`` of it is the printable grid.
        Raises:
            ScheduleError: the plan is invalid (see ``simulate``).
        """
        for v, what in ((forward_time, "forward_time"), (backward_time, "backward_time")):
            _check_count(v, what)
        sim = simulate(self, forward_time=forward_time, backward_time=backward_time)
        return ScheduleTable(self, sim)

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.num_ranks} ranks, {self.num_stages} stages, "
                 f"{self.n_microbatches} microbatches"]
        for r, acts in enumerate(self.actions):
            lines.append(f"rank {r}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)


def _with_comms(name: str, p: int, n_stages: int, m: int,
                compute: Sequence[Sequence[Tuple[ActionKind, int, int]]]) -> Plan:
    """Insert the communication around each rank's compute order.

    A forward is preceded by the receive of its input and followed by the send
    of its output; a backward likewise for gradients.  Receives sit right
    before their use (blocking), sends right after their producer (they are
    asynchronous), which is the order the runtime executes.
    """
    def owner(s: int) -> int:
        return s % p

    per_rank: List[Tuple[Action, ...]] = []
    for r in range(p):
        out: List[Action] = []
        for kind, s, mb in compute[r]:
            remote_prev = s > 0 and owner(s - 1) != r
            remote_next = s < n_stages - 1 and owner(s + 1) != r
            if kind is F:
                if remote_prev:
                    out.append(Action(RA, s, mb))
                out.append(Action(F, s, mb))
                if remote_next:
                    out.append(Action(SA, s, mb))
            else:
                if remote_next:
                    out.append(Action(RG, s, mb))
                out.append(Action(B, s, mb))
                if remote_prev:
                    out.append(Action(SG, s, mb))
        per_rank.append(tuple(out))
    return Plan(name, p, n_stages, m, tuple(per_rank))


def _check_limits(n_stages: int, m: int) -> None:
    if n_stages > MAX_STAGES:
        raise ValueError(f"at most {MAX_STAGES} stages are supported, got {n_stages}")
    if m > MAX_MICROBATCHES:
        raise ValueError(f"at most {MAX_MICROBATCHES} microbatches are supported, got {m}")


def plan_gpipe(num_ranks: int, n_microbatches: int) -> Plan:
    """GPipe: every rank runs all forwards, then all backwards (same microbatch order).

    Backwards run in forward order (not reversed) because a stage's module
    consumes its saved contexts oldest first.  Peak alive activations: m per rank.

    Args:
        num_ranks: pipeline ranks p (one stage each).
        n_microbatches: m >= 1.
    Returns:
        The ``Plan``.
    Raises:
        TypeError / ValueError: counts that are not positive ints.

    Example::

        plan = plan_gpipe(4, 8)
    """
    p = _check_count(num_ranks, "num_ranks")
    m = _check_count(n_microbatches, "n_microbatches")
    _check_limits(p, m)
    compute = [[(F, r, i) for i in range(m)] + [(B, r, i) for i in range(m)] for r in range(p)]
    return _with_comms("gpipe", p, p, m, compute)


def plan_1f1b(num_ranks: int, n_microbatches: int) -> Plan:
    """1F1B (PipeDream-flush): warm up, then alternate one forward and one backward.

    Rank r first runs ``min(p - r - 1, m)`` forwards, then pairs "forward of the
    next microbatch, backward of the oldest", then drains the remaining
    backwards.  At most ``p - r`` microbatches are alive on rank r, against m
    for GPipe; the bubble is the same, (p-1)/(m+p-1).

    Args / Returns / Raises: as ``plan_gpipe``.

    Example::

        plan = plan_1f1b(4, 8)
    """
    p = _check_count(num_ranks, "num_ranks")
    m = _check_count(n_microbatches, "n_microbatches")
    _check_limits(p, m)
    compute = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [(F, r, i) for i in range(warm)]
        for i in range(m - warm):
            order += [(F, r, warm + i), (B, r, i)]
        order += [(B, r, i) for i in range(m - warm, m)]
        compute.append(order)
    return _with_comms("1f1b", p, p, m, compute)


def multiple_hint(m: int, p: int) -> str:
    """'try N': the next multiple of p, or the one below it when above the limit."""
    up, down = m + (-m) % p, m - m % p
    return f"try {up}" if up <= MAX_MICROBATCHES or not down else f"try {down}"


def plan_interleaved_1f1b(num_ranks: int, virtual_stages: int, n_microbatches: int) -> Plan:
    """Interleaved 1F1B (Megatron-LM): v model chunks per rank, looping placement.

    Rank r holds stages r, r+p, ..., r+(v-1)p.  Its work is m·v "virtual
    microbatches" k = 0 .. m·v-1, taken in rounds of p microbatches per chunk:
    forward k runs chunk ``(k mod p·v) // p`` on microbatch
    ``(k // p·v)·p + k mod p``; backward k walks the chunks in reverse.  Rank r
    warms up with ``2(p-r-1) + (v-1)p`` forwards (v = 1: ``p-r-1``, plain
    1F1B), then alternates forward and
    backward, then drains.  (Megatron runs all forwards first when m = p; with
    asynchronous sends that is not needed, and the common rule keeps fewer
    activations alive.)  The bubble shrinks to
    (p-1)/(v·m+p-1).

    Args:
        num_ranks: pipeline ranks p.
        virtual_stages: chunks per rank v (v = 1 is plain 1F1B).
        n_microbatches: m, a multiple of p (the rounds above need it).
    Returns:
        The ``Plan`` (num_stages = p·v).
    Raises:
        ValueError: m is not a multiple of p, or a count is not positive.

    Example::

        plan = plan_interleaved_1f1b(4, 2, 8)
    """
    p = _check_count(num_ranks, "num_ranks")
    v = _check_count(virtual_stages, "virtual_stages")
    m = _check_count(n_microbatches, "n_microbatches")
    if m % p:
        raise ValueError(f"interleaved 1F1B needs n_microbatches to be a multiple of the number "
                         f"of pipeline ranks ({p}); got {m} ({multiple_hint(m, p)})")
    _check_limits(p * v, m)
    total = m * v
    compute = []
    for r in range(p):
        def fwd(k: int) -> Tuple[ActionKind, int, int]:
            rnd, within = divmod(k, p * v)
            chunk = within // p
            return (F, chunk * p + r, rnd * p + within % p)

        def bwd(k: int) -> Tuple[ActionKind, int, int]:
            rnd, within = divmod(k, p * v)
            chunk = v - 1 - within // p
            return (B, chunk * p + r, rnd * p + within % p)

        # Megatron's warm-up: one round of the other chunks, plus 2 per downstream
        # rank (a slot for its forward and one for its backward), so the first
        # backward's gradient is already on its way when the steady state asks
        # for it; with 1 per rank the bubble is the same at zero latency but
        # message latency is no longer hidden.  v = 1 is plain 1F1B.
        per_rank = 2 if v > 1 else 1
        warm = min((p - r - 1) * per_rank + (v - 1) * p, total)
        order = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            order += [fwd(warm + k), bwd(k)]
        order += [bwd(k) for k in range(total - warm, total)]
        compute.append(order)
    return _with_comms("interleaved-1f1b", p, p * v, m, compute)


def bubble_fraction(num_ranks: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """Theoretical idle fraction of a synchronous pipeline step.

    GPipe and 1F1B: (p-1)/(m+p-1).  Interleaved with v chunks per rank:
    (p-1)/(v·m+p-1), since each warm-up/drain slot is 1/v of a stage.
    Assumes equal stage costs and free communication.

    Example::

        >>> bubble_fraction(4, 8)
        0.2727272727272727
    """
    p = _check_count(num_ranks, "num_ranks")
    m = _check_count(n_microbatches, "n_microbatches")
    v = _check_count(virtual_stages, "virtual_stages")
    return (p - 1) / (v * m + p - 1)


@dataclass
class SimResult:
    """What ``simulate`` found.

    Attributes:
        makespan: time the last action ends.
        busy: per rank, total compute time.
        bubble: per rank, idle fraction ``1 - busy/makespan``.
        peak_alive: per rank, the most microbatch-stage activations alive at once.
        timeline: per rank, ``(start, end, Action)`` of each compute action.
        order: the global order in which actions ran, as ``(rank, Action)``.
    """

    makespan: float
    busy: List[float]
    bubble: List[float]
    peak_alive: List[int]
    timeline: List[List[Tuple[float, float, Action]]]
    order: List[Tuple[int, Action]] = field(repr=False)

    @property
    def bubble_fraction(self) -> float:
        """Mean idle fraction over ranks."""
        return sum(self.bubble) / len(self.bubble)


def _check_structure(plan: Plan) -> None:
    """Every rank runs exactly the actions its stages need, each once."""
    p, S, m = plan.num_ranks, plan.num_stages, plan.n_microbatches
    if len(plan.actions) != p:
        raise ScheduleError(f"{plan.name}: {len(plan.actions)} action lists for {p} ranks")
    if S % p:
        raise ScheduleError(f"{plan.name}: {S} stages do not divide over {p} ranks")
    for r in range(p):
        want = set()
        for s in plan.stages_of(r):
            for mb in range(m):
                want.add(Action(F, s, mb))
                want.add(Action(B, s, mb))
                if s > 0 and plan.stage_rank(s - 1) != r:
                    want.add(Action(RA, s, mb))
                    want.add(Action(SG, s, mb))
                if s < S - 1 and plan.stage_rank(s + 1) != r:
                    want.add(Action(SA, s, mb))
                    want.add(Action(RG, s, mb))
        seen = set()
        for a in plan.actions[r]:
            if not isinstance(a, Action):
                raise ScheduleError(f"{plan.name}: rank {r} has a non-Action entry {a!r}")
            if a in seen:
                raise ScheduleError(f"{plan.name}: rank {r} runs {a} twice")
            if a not in want:
                raise ScheduleError(f"{plan.name}: rank {r} runs {a}, which does not belong to "
                                    f"its stages {plan.stages_of(r)} (or is a local hand-off)")
            seen.add(a)
        missing = want - seen
        if missing:
            first = sorted(missing, key=lambda a: (a.stage, a.microbatch, a.kind.value))[:4]
            raise ScheduleError(f"{plan.name}: rank {r} never runs {len(missing)} required "
                                f"action(s), e.g. {first}")


def simulate(plan: Plan, *, forward_time: float = 1.0, backward_time: float = 1.0,
             comm_time: float = 0.0) -> SimResult:
    """Execute ``plan`` under the runtime's rules; raise ``ScheduleError`` if it is wrong.

    Rules checked:
      * every stage runs forward and backward of every microbatch exactly once,
        on the rank holding it, with exactly the sends/receives its remote
        neighbours need;
      * forward of m on s runs after its input exists: forward of m on s-1
        (through a matched receive when s-1 is on another rank);
      * backward of m on s runs after its own forward and after backward of m
        on s+1 (for the last stage: after its forward, which computed the loss);
      * each stage runs its backwards in the order of its forwards (modules
        consume saved contexts oldest first);
      * sends are asynchronous and never block; a receive blocks its rank until
        the matching send has run; if every unfinished rank is blocked, the plan
        deadlocks and the error names what each rank waits for.

    Args:
        plan: the ``Plan``.
        forward_time, backward_time: cost of one stage forward / backward.
        comm_time: delay between a send and the matching receive's completion.
    Returns:
        ``SimResult`` with the timeline, bubble and peak alive activations.
    Raises:
        ScheduleError: the first rule broken.
    """
    _check_structure(plan)
    p, S = plan.num_ranks, plan.num_stages
    done: Dict[Tuple[int, Action], float] = {}  # (rank, action) -> time it finished
    fwd_done: Dict[Tuple[int, int], float] = {}  # (stage, mb) -> end time
    bwd_done: Dict[Tuple[int, int], float] = {}
    fwd_order: Dict[int, List[int]] = {s: [] for s in range(S)}
    bwd_count: Dict[int, int] = {s: 0 for s in range(S)}
    sent: Dict[Action, float] = {}  # matched receive -> time the message is available
    clock = [0.0] * p
    pos = [0] * p
    alive = [0] * p
    peak = [0] * p
    busy = [0.0] * p
    timeline: List[List[Tuple[float, float, Action]]] = [[] for _ in range(p)]
    order: List[Tuple[int, Action]] = []

    def fail(r: int, a: Action, why: str) -> None:
        raise ScheduleError(f"{plan.name}: rank {r} runs {a} (#{pos[r]} in its list) {why}")

    def step(r: int) -> bool:
        """Run rank r's next action if it can; False when blocked on a receive."""
        a = plan.actions[r][pos[r]]
        s, mb = a.stage, a.microbatch
        t = clock[r]
        if a.kind in (RA, RG):
            if a not in sent:
                return False
            t = max(t, sent.pop(a))
        elif a.kind is SA:
            if (s, mb) not in fwd_done or plan.stage_rank(s) != r:
                fail(r, a, "before the forward that produces it")
            sent[_peer_action(a)] = t + comm_time
        elif a.kind is SG:
            if (s, mb) not in bwd_done:
                fail(r, a, "before the backward that produces it")
            sent[_peer_action(a)] = t + comm_time
        elif a.kind is F:
            if s > 0:
                if plan.stage_rank(s - 1) == r:
                    if (s - 1, mb) not in fwd_done:
                        fail(r, a, f"before forward of m{mb} on stage {s - 1}")
                elif (r, Action(RA, s, mb)) not in done:
                    fail(r, a, "before receiving its input activation")
            t += forward_time
            fwd_done[(s, mb)] = t
            fwd_order[s].append(mb)
            alive[r] += 1
            peak[r] = max(peak[r], alive[r])
            busy[r] += forward_time
            timeline[r].append((t - forward_time, t, a))
        else:  # backward
            if (s, mb) not in fwd_done:
                fail(r, a, "before its own forward")
            k = bwd_count[s]
            # (s, mb) was forwarded and not yet backwarded, so k < len(fwd_order[s]).
            if fwd_order[s][k] != mb:
                fail(r, a, f"out of forward order: stage {s} ran forwards {fwd_order[s]}, "
                           f"so its next backward must be m{fwd_order[s][k]}")
            if s < S - 1:
                if plan.stage_rank(s + 1) == r:
                    if (s + 1, mb) not in bwd_done:
                        fail(r, a, f"before backward of m{mb} on stage {s + 1}")
                elif (r, Action(RG, s, mb)) not in done:
                    fail(r, a, "before receiving its output gradient")
            bwd_count[s] = k + 1
            t += backward_time
            bwd_done[(s, mb)] = t
            alive[r] -= 1
            busy[r] += backward_time
            timeline[r].append((t - backward_time, t, a))
        clock[r] = t
        done[(r, a)] = t
        order.append((r, a))
        pos[r] += 1
        return True

    remaining = sum(len(a) for a in plan.actions)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(plan.actions[r]) and step(r):
                progressed = True
                remaining -= 1
        if not progressed:
            waits = [f"rank {r} waits at {plan.actions[r][pos[r]]}"
                     for r in range(p) if pos[r] < len(plan.actions[r])]
            raise ScheduleError(f"{plan.name}: deadlock: " + "; ".join(waits))
    makespan = max(clock) if clock else 0.0
    bubble = [1.0 - b / makespan if makespan else 0.0 for b in busy]
    return SimResult(makespan, busy, bubble, peak, timeline, order)


class ScheduleTable:
    """The compute timeline of a plan: ranks × integer time steps.

    Attributes:
        plan: the ``Plan``.
        sim: its ``SimResult``.
        grid: ``grid[r][t]`` is the ``Action`` rank r computes at time step t, or None.

    ``str(table)`` prints one row per rank; a cell ``F3`` is the forward of
    microbatch 3, ``B3`` its backward, ``.`` idle.  With several stages per
    rank the cell also names the stage (``F3s5``).
    """

    def __init__(self, plan: Plan, sim: SimResult) -> None:
        self.plan = plan
        self.sim = sim
        width = int(round(sim.makespan))
        self.grid: List[List[Optional[Action]]] = [[None] * width for _ in range(plan.num_ranks)]
        for r, events in enumerate(sim.timeline):
            for start, end, a in events:
                for t in range(int(round(start)), int(round(end))):
                    self.grid[r][t] = a

    def cell(self, a: Optional[Action]) -> str:
        if a is None:
            return "."
        label = f"{a.kind.value}{a.microbatch}"
        return label + (f"s{a.stage}" if self.plan.num_stages > self.plan.num_ranks else "")

    def __str__(self) -> str:
        plan, sim = self.plan, self.sim
        cells = [[self.cell(a) for a in row] for row in self.grid]
        w = max([len(c) for row in cells for c in row] + [len(str(len(self.grid[0]) - 1))
                                                             if self.grid and self.grid[0] else 1])
        head = f"{plan.name}: p={plan.num_ranks} ranks, {plan.num_stages} stages, " \
               f"m={plan.n_microbatches} microbatches"
        lines = [head, "t      " + " ".join(str(t).rjust(w) for t in range(len(self.grid[0])))]
        for r, row in enumerate(cells):
            lines.append(f"rank {r:<2}" + " " + " ".join(c.rjust(w) for c in row))
        v = plan.virtual_stages
        lines.append(f"bubble {sim.bubble_fraction:.3f} (theory "
                     f"{bubble_fraction(plan.num_ranks, plan.n_microbatches, v):.3f}); "
                     f"peak alive microbatch-stages per rank {sim.peak_alive}")
        return "\n".join(lines)

    __repr__ = __str__
