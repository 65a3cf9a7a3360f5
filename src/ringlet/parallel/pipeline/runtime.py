"""The generic pipeline runtime: runs a ``Plan``'s actions on this rank.

One training step on one rank walks its action list in order:

* ``FORWARD(s, m)``: run stage s's module on microbatch m's input; on the last
  stage also compute the loss and the output gradient (scaled by 1/m so the
  accumulated parameter gradients equal the full-batch mean-loss gradients).
* ``BACKWARD(s, m)``: run the module's backward on the output gradient.
* ``SEND_*``: post an asynchronous ``isend`` and move on (compute overlaps it).
* ``RECV_*``: wait for a receive that was posted ahead of time (see below).

Wire format: ``_wire.py`` (declarations, frames and tags).  The receiver
allocates every frame from its channel's declaration, so it can post the
frame receives ahead of time.

Receives are posted ahead, in each peer's schedule order, up to ``prefetch``
frames per peer, so data lands while this rank computes.  Posting in schedule
order keeps the runtime exactly as deadlock-free as the plan's "asynchronous
send, blocking receive" simulation: each receive can only finish earlier
than it would have there.  One frame per microbatch (rather than a header and
a payload) costs the sender a copy into the frame but halves the messages and
saves a round trip through this rank's Python thread on every hop.

Failure protocol.  If anything raises on a rank mid-step (the module, the
loss, a bad input, a shape mismatch, a Ctrl-C: ``KeyboardInterrupt`` and
``SystemExit`` too), that rank does not leave its peers waiting:

1. it *poisons* every message it still owed this step: a channel not yet
   declared gets a POISON declaration (which stands for the whole channel),
   a declared channel gets a POISON frame of the declared size for each
   remaining microbatch, so every receive a peer posted or will post completes
   (out of memory, the channel's last data frame is reused for it once sent:
   a channel is declared only with its first frame);
2. it drains every message it still expected this step, so no sender is left
   blocked and no stale frame stays behind for the next step (out of memory,
   into the buffers of frames already received);
3. it waits for its own sends.

A peer that reads a poison stops computing and follows the same three steps.
Finally every rank takes part in a small all-reduce of failure flags (and, on
failure, an ``all_gather_object`` of the messages), so *every* rank of the
pipeline group raises: the failing rank its original exception, the others
``PipelineError`` naming the rank, stage and error.  Saved forward contexts
are cleared and the group stays usable; zero the gradients before retrying.
An interrupted rank (any ``BaseException`` that is not an ``Exception``:
``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``) raises its own
exception unchanged, even when the protocol fails (that error is logged); the
peers' ``PipelineError`` says the stage "was interrupted".  A second interrupt
during the protocol is not caught: it ends the protocol at once and propagates.
Communication errors (``RingletError`` from ringlet itself: timeouts, dead
peers) skip the protocol: ringlet has already aborted the job's groups, and
they re-raise.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import ringlet
from ringlet.errors import RingletError

from ..._timeout import seconds
from ._wire import (_HDR_BYTES, _HDR_LEN, _KIND_DATA, _KIND_POISON, _T_ACT, _T_ACT_DECL,
                    _T_GRAD, _T_GRAD_DECL, _Decl, _declaration, _frame, _parse_declaration,
                    _parse_frame, _poison_declaration, _poison_in_place, _tag)
from .schedules import (MAX_MICROBATCHES, Action, ActionKind, Plan, _check_limits, multiple_hint,
                        plan_1f1b, plan_gpipe, plan_interleaved_1f1b, simulate)
from .stage import PipelineStage

__all__ = ["PipelineError", "StepStats", "ScheduleGPipe", "Schedule1F1B",
           "ScheduleInterleaved1F1B", "PipelineSchedule"]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
SA, RA, SG, RG = (ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD,
                  ActionKind.RECV_GRAD)

_log = logging.getLogger(__name__)


class PipelineError(RingletError):
    """Another stage of the pipeline failed during this step.

    Raised on every rank of the pipeline group except the one that failed
    (which raises its own exception).

    Attributes:
        failures: ``{group rank: message}`` of the ranks whose stage raised.
        step: the schedule's step number.
    """

    def __init__(self, message: str, *, failures: Dict[int, str], step: int,
                 rank: Optional[int] = None) -> None:
        super().__init__(message, rank=rank, op="pipeline.step")
        self.failures = failures
        self.step = step


class _Poisoned(Exception):
    """A peer reported a failure instead of sending data (internal)."""

    def __init__(self, origin: int) -> None:
        super().__init__(f"pipeline rank {origin} failed")
        self.origin = origin


class _CommFailure(Exception):
    """Wraps a ringlet error raised by a send/receive (internal)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exc = exc


class _InChannel:
    """Receiving side of one channel: its declaration, once it arrived."""

    def __init__(self, peer: int, src_stage: int, decl_tag: int, what: str) -> None:
        self.peer = peer
        self.src_stage = src_stage
        self.decl_tag = decl_tag
        self.what = what
        self.hdr = np.zeros(_HDR_LEN, np.int64)
        self.work: Any = None
        self.decl: Optional[_Decl] = None
        self.checked = False


class _OutChannel:
    """Sending side of one channel: what it declared this step."""

    def __init__(self, peer: int, decl_tag: int) -> None:
        self.peer = peer
        self.decl_tag = decl_tag
        self.shape: Optional[Tuple[int, ...]] = None
        self.dtype: Optional[np.dtype] = None
        self.poisoned = False  # a POISON declaration went out
        # The last data frame sent and its Work: the poison frame of last resort
        # when a new frame cannot be allocated (out of memory).
        self.frame: Optional[np.ndarray] = None
        self.frame_work: Any = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # Python ints: no wrap-around


class _Recv:
    """One expected frame."""

    __slots__ = ("action", "ch", "tag", "buf", "work", "consumed")

    def __init__(self, action: Action, ch: _InChannel, tag: int) -> None:
        self.action = action
        self.ch = ch
        self.tag = tag
        self.buf: Optional[np.ndarray] = None
        self.work: Any = None
        self.consumed = False


@dataclass
class StepStats:
    """Measurements of the last ``step()`` on this rank.

    Attributes:
        step_time: wall seconds of the whole step (including the final agreement).
        compute_time: seconds in forward, backward and the loss.
        wait_time: seconds blocked on receives.
        idle_fraction: ``1 - compute_time/step_time``: the measured bubble,
            including communication and runtime overhead.
        peak_alive: most microbatch-stage activations alive at once.
        timeline: ``(start, end, Action)`` of every action this rank ran, in
            seconds from the start of the step (for debugging schedules).
        started_at: ``time.perf_counter()`` when the step started (the
            system-wide monotonic clock on Linux, so ranks on one machine can
            line their timelines up).
        peak_activation_bytes: most bytes held for backward at once: the sum
            over alive microbatches of what each forward saved, as reported by
            the module's ``saved_bytes()`` when it has one, else the stage's
            input plus output arrays (a lower bound).
    """

    step_time: float = 0.0
    compute_time: float = 0.0
    wait_time: float = 0.0
    peak_alive: int = 0
    peak_activation_bytes: int = 0
    timeline: List[Tuple[float, float, Action]] = field(default_factory=list)
    started_at: float = 0.0

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.compute_time / self.step_time if self.step_time > 0 else 0.0


def _describe(exc: BaseException) -> str:
    """``str(exc)``, or a stand-in when that raises: the peers wait for this message."""
    try:
        return str(exc)
    except Exception as e:  # noqa: BLE001 - any user __str__ may fail
        return f"<str() of the exception raised {type(e).__name__}>"


def _what_happened(exc: BaseException) -> str:
    """How a stage failed, for the peers' ``PipelineError``."""
    if isinstance(exc, Exception):
        return f"raised {type(exc).__name__}: {_describe(exc)}"
    # KeyboardInterrupt, SystemExit, GeneratorExit: often without a message.
    text = _describe(exc)
    return f"was interrupted ({type(exc).__name__}{': ' + text if text else ''})"


def _saved_bytes_fn(module: Any) -> Optional[Callable[[], int]]:
    fn = getattr(module, "saved_bytes", None)
    return fn if callable(fn) else None


class PipelineSchedule:
    """Runs this rank's part of any ``Plan``; the named schedules below build the plan.

    A custom plan (e.g. built by hand or by another planner) runs as is:
    ``PipelineSchedule(my_stages, m, plan)``.  The plan is validated with
    ``simulate`` first, so a plan that could deadlock or break a dependency is
    refused on every rank before any message is sent.

    Args:
        stages: this rank's ``PipelineStage`` s (the plan's ``stages_of(rank)``).
        n_microbatches: must equal ``plan.n_microbatches``.
        plan: the ``Plan``; ``plan.num_ranks`` must equal the group size.
        loss_fn, timeout, prefetch: as ``ScheduleGPipe``.
    Raises:
        ScheduleError: the plan is invalid.
        ValueError / TypeError: the stages, group or counts do not match the plan.

    Attributes:
        plan: the ``Plan`` (every rank's action lists).
        actions: this rank's action list.
        last_stats: ``StepStats`` of the last step on this rank.
    """

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, plan: Plan, *,
                 loss_fn: Optional[Callable] = None, timeout: Optional[float] = None,
                 prefetch: int = 2) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
        if timeout is not None:
            timeout = seconds(timeout)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a ringlet.pipeline.Plan, got {type(plan).__name__}")
        # The limits the named schedules check, for custom plans too: tags hold
        # the stage in 12 bits and the microbatch in 16.
        n_microbatches = _check_microbatches(n_microbatches)
        _check_limits(plan.num_stages, plan.n_microbatches)
        stages = list(stages)
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError("stages must be a non-empty list of PipelineStage")
        first = stages[0]
        if plan.num_ranks != first.group_size or plan.num_stages != first.num_stages:
            raise ValueError(f"the plan is for {plan.num_ranks} ranks and {plan.num_stages} "
                             f"stages; the pipeline group has {first.group_size} ranks and "
                             f"the stages say {first.num_stages} stages")
        if plan.n_microbatches != n_microbatches:
            raise ValueError(f"the plan has {plan.n_microbatches} microbatches, not "
                             f"{n_microbatches}")
        if sorted(s.stage_index for s in stages) != plan.stages_of(first.group_rank):
            raise ValueError(f"pipeline rank {first.group_rank} must hold stages "
                             f"{plan.stages_of(first.group_rank)}, got "
                             f"{sorted(s.stage_index for s in stages)}")
        simulate(plan)  # raises ScheduleError naming the broken rule
        self.stages = {s.stage_index: s for s in stages}
        self.group = first.group
        self.rank = first.group_rank
        self.size = first.group_size
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.timeout = timeout
        self.prefetch = prefetch
        self.plan = plan
        self.actions = plan.actions[self.rank]
        self.num_stages = plan.num_stages
        self.last_stats = StepStats()
        self._step = 0
        self._agreed = False  # the first step checks that every rank runs this schedule

    # ---- introspection -------------------------------------------------------
    def table(self, **kw):
        """The plan's grid of actions per rank and time step (``Plan.table``)."""
        return self.plan.table(**kw)

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stages

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stages

    # ---- one step -----------------------------------------------------------
    def step(self, inputs: Optional[np.ndarray] = None, targets: Optional[np.ndarray] = None,
             loss_fn: Optional[Callable] = None) -> Optional[float]:
        """Run one training step over ``n_microbatches`` microbatches.

        Every rank of the pipeline group calls it.  The rank holding stage 0
        passes ``inputs`` (split into microbatches along dimension 0); the rank
        holding the last stage passes ``targets`` (split the same way) and a
        loss function, here or in the constructor: ``loss_fn(output, target)
        -> (loss, grad_output)`` with the loss a mean over the microbatch.
        Other ranks' arguments are ignored.  Parameter gradients accumulate
        into the stages' ``param.grad`` (call ``zero_grad`` between steps), equal
        to the gradients of the mean loss over the whole batch.

        Returns:
            On the rank holding the last stage, the mean loss over the
            microbatches (a float); None elsewhere.
        Raises:
            ValueError / TypeError: missing or badly shaped inputs/targets (on
                the rank that has them; the others raise ``PipelineError``).
            ValueError: on the first step, on every rank, when the ranks of the
                group built different schedules.
            PipelineError: another rank's stage failed during this step.
            RingletError: communication failed (timeout, dead peer).
            Whatever a stage's module or the loss raised, on that rank; a
                ``KeyboardInterrupt`` or ``SystemExit`` too, unchanged, after
                the other ranks were told (they raise ``PipelineError``).

        Example::

            loss = schedule.step(x if rank == 0 else None,
                                 y if rank == last else None)
        """
        if not self._agreed:
            self._agree()
        self._step += 1
        run = _StepRun(self, inputs, targets, loss_fn or self.loss_fn)
        return run.execute()

    def _agree(self) -> None:
        """First step: every rank of the group must run the same schedule.

        One small ``all_gather_object`` of (plan name, ranks, stages,
        microbatches, stages per rank); ranks that built different schedules
        would otherwise wait on messages that never come until the timeout.
        """
        plan = self.plan
        mine = [plan.name, plan.num_ranks, plan.num_stages, plan.n_microbatches,
                plan.virtual_stages]
        if self.size > 1:
            every = [list(v) for v in ringlet.all_gather_object(mine, group=self.group,
                                                                timeout=self.timeout)]
            if any(v != every[0] for v in every):
                desc = "; ".join(f"pipeline rank {r}: {v[0]} p={v[1]} stages={v[2]} m={v[3]} "
                                 f"v={v[4]}" for r, v in enumerate(every))
                raise ValueError(f"the ranks of the pipeline group built different schedules "
                                 f"({desc}); every rank must build the same schedule (same "
                                 f"kind, stage count and n_microbatches)")
        self._agreed = True


class _StepRun:
    """State of one step on one rank."""

    def __init__(self, sched: PipelineSchedule, inputs, targets, loss_fn) -> None:
        self.s = sched
        self.step = sched._step
        self.inputs = inputs
        self.targets = targets
        self.loss_fn = loss_fn
        self.group = sched.group
        self.acts: Dict[Tuple[int, int], np.ndarray] = {}   # stage input, before forward
        self.outs: Dict[Tuple[int, int], np.ndarray] = {}   # stage output, before send
        self.gouts: Dict[Tuple[int, int], np.ndarray] = {}  # output gradient, before backward
        self.gins: Dict[Tuple[int, int], np.ndarray] = {}   # input gradient, before send
        self.out_ch: Dict[Tuple[ActionKind, int], _OutChannel] = {}
        self.in_ch: Dict[Tuple[ActionKind, int], _InChannel] = {}
        self.alive_bytes: Dict[Tuple[int, int], int] = {}
        self.loss_sum = 0.0
        self.sends: List[Any] = []
        self.sent: set = set()
        self.recvs: Dict[Action, _Recv] = {}
        self.queues: Dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.outstanding: Dict[int, int] = collections.defaultdict(int)
        self.broken_peers: set = set()
        self.pos = 0
        self.stats = StepStats()
        self.alive = 0
        self.cur_bytes = 0
        self.mb_inputs: Optional[List[np.ndarray]] = None
        self.mb_targets: Optional[List[np.ndarray]] = None
        self.draining = False  # the failure protocol runs: received frames are discarded

    # ---- communication ---------------------------------------------------------
    def _comm(self, fn: Callable, *args, **kw):
        try:
            return fn(*args, **kw)
        except RingletError as exc:
            raise _CommFailure(exc) from exc

    def _isend(self, arr: np.ndarray, peer: int, tag: int) -> Any:
        w = self._comm(ringlet.isend, arr, peer, tag, group=self.group, timeout=self.s.timeout)
        self.sends.append(w)
        return w

    def _irecv(self, arr: np.ndarray, peer: int, tag: int):
        return self._comm(ringlet.irecv, arr, peer, tag, group=self.group,
                          timeout=self.s.timeout)

    def _wait(self, work) -> None:
        # No extra Python-side deadline: every ringlet operation carries its
        # own (the schedule's timeout or the group's), after which it fails
        # with CollectiveTimeout and ringlet aborts the job's groups.
        self._comm(work.wait)

    def _plan_recvs(self) -> None:
        """One ``_Recv`` per receive action, queued per peer in schedule order.

        A channel's declaration is queued just before its first frame.
        """
        size = self.s.size
        for a in self.s.actions:
            if a.kind is RA:
                key, src, types = (RA, a.stage), a.stage - 1, (_T_ACT_DECL, _T_ACT)
                what = f"activation for stage {a.stage} from stage {src}"
            elif a.kind is RG:
                key, src, types = (RG, a.stage), a.stage + 1, (_T_GRAD_DECL, _T_GRAD)
                what = f"gradient for stage {a.stage} from stage {src}"
            else:
                continue
            peer = src % size
            ch = self.in_ch.get(key)
            if ch is None:
                ch = self.in_ch[key] = _InChannel(peer, src, _tag(types[0], src, 0), what)
                self.queues[peer].append(ch)
            r = _Recv(a, ch, _tag(types[1], src, a.microbatch))
            self.recvs[a] = r
            self.queues[peer].append(r)

    def _pump(self, peer: int) -> None:
        """Post this peer's next receives, in schedule order, within the prefetch window."""
        q = self.queues[peer]
        while q:
            item = q[0]
            if isinstance(item, _InChannel):
                item.work = self._irecv(item.hdr, peer, item.decl_tag)
            else:
                ch = item.ch
                if ch.decl is None:
                    if not ch.work.is_completed() or ch.work.exception() is not None:
                        break
                    ch.decl = _parse_declaration(ch.hdr, self.step, ch.src_stage, ch.what)
                if ch.decl.kind == _KIND_DATA:
                    if self.outstanding[peer] >= self.s.prefetch:
                        break
                    item.buf = self._frame_buffer(ch)
                    item.work = self._irecv(item.buf, peer, item.tag)
                    self.outstanding[peer] += 1
                elif ch.decl.kind == 0:
                    # Malformed: frame sizes are unknown, so nothing more from
                    # this peer can be matched reliably.
                    q.clear()
                    self.broken_peers.add(peer)
                    return
                # A POISON declaration stands for every frame of the channel.
            q.popleft()

    def _frame_buffer(self, ch: _InChannel) -> np.ndarray:
        """A buffer for one of ``ch``'s frames."""
        try:
            return np.empty(_HDR_BYTES + ch.decl.nbytes, np.uint8)
        except MemoryError:
            if not self.draining:
                raise
        # Draining after a failure (out of memory, perhaps): the frame is only
        # read for its header, so reuse the buffer of one already received.
        for r in self.recvs.values():
            if r.ch is ch and r.consumed and r.buf is not None:
                buf, r.buf = r.buf, None
                return buf
        raise MemoryError(f"pipeline rank {self.s.rank}: no memory to receive and discard a "
                          f"{ch.decl.nbytes}-byte {ch.what} after this step failed")

    def _pump_all(self) -> None:
        for peer in list(self.queues):
            self._pump(peer)

    def _declaration_of(self, ch: _InChannel) -> _Decl:
        self._pump(ch.peer)
        self._wait(ch.work)
        self._pump(ch.peer)
        return ch.decl

    def _take(self, r: _Recv) -> Tuple[int, int, Optional[str]]:
        """Wait for ``r``'s frame; (kind, origin, error).  Marks it consumed."""
        decl = self._declaration_of(r.ch)
        if decl.kind != _KIND_DATA:
            r.consumed = True
            return decl.kind, decl.origin, decl.error
        self._wait(r.work)
        r.consumed = True
        self.outstanding[r.ch.peer] -= 1
        self._pump(r.ch.peer)
        return _parse_frame(r.buf, self.step, r.ch.src_stage, r.action.microbatch, r.ch.what)

    def _recv(self, a: Action) -> np.ndarray:
        r = self.recvs[a]
        t0 = time.perf_counter()
        try:
            decl = self._declaration_of(r.ch)
            if decl.kind == _KIND_DATA and not r.ch.checked:
                self._check_declaration(a, decl)
                r.ch.checked = True
            kind, origin, error = self._take(r)
        finally:
            self.stats.wait_time += time.perf_counter() - t0
        if kind == _KIND_POISON:
            raise _Poisoned(origin)
        if error is not None:
            raise RuntimeError(error)
        return r.buf[_HDR_BYTES:].view(decl.dtype).reshape(decl.shape)

    def _check_declaration(self, a: Action, decl: _Decl) -> None:
        if a.kind is RA:
            self.s.stages[a.stage].check_input(_Meta(decl.shape, decl.dtype),
                                               f"stage {a.stage - 1}")
            return
        out = self.out_ch.get((SA, a.stage))
        if out is not None and out.shape is not None and \
                (tuple(decl.shape), decl.dtype) != (out.shape, out.dtype):
            raise ValueError(f"stage {a.stage}: the gradients from stage {a.stage + 1} have "
                             f"shape {decl.shape} {decl.dtype}, but the activations sent were "
                             f"{out.shape} {out.dtype}")

    def _out_channel(self, a: Action) -> Tuple[_OutChannel, int]:
        """The channel a send action uses, and its frame tag."""
        if a.kind is SA:
            peer, decl_t, frame_t = (a.stage + 1) % self.s.size, _T_ACT_DECL, _T_ACT
        else:
            peer, decl_t, frame_t = (a.stage - 1) % self.s.size, _T_GRAD_DECL, _T_GRAD
        ch = self.out_ch.get((a.kind, a.stage))
        if ch is None:
            ch = self.out_ch[(a.kind, a.stage)] = _OutChannel(peer, _tag(decl_t, a.stage, 0))
        return ch, _tag(frame_t, a.stage, a.microbatch)

    def _send(self, a: Action, arr: np.ndarray) -> None:
        ch, tag = self._out_channel(a)
        arr = np.ascontiguousarray(arr)
        if not arr.dtype.isnative:
            # Frames carry native byte order (the receiver views the bytes as
            # its dtype); a byte-swapped array is converted, a copy only then.
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if ch.shape is not None and (arr.shape, arr.dtype) != (ch.shape, ch.dtype):
            what = "output" if a.kind is SA else "input gradient"
            raise ValueError(f"stage {a.stage}: {what} of microbatch {a.microbatch} has shape "
                             f"{arr.shape} {arr.dtype}, but this step's first was {ch.shape} "
                             f"{ch.dtype}; every microbatch of a step must have the same shape")
        # The frame before the declaration: a channel is declared only with a
        # frame on its way, whose buffer can then carry the channel's poison.
        buf = _frame(self.step, a.stage, a.microbatch, arr, arr.nbytes)
        if ch.shape is None:
            decl = _declaration(self.step, a.stage, arr.shape, arr.dtype)
            ch.shape, ch.dtype = arr.shape, arr.dtype
            self._isend(decl, ch.peer, ch.decl_tag)
        ch.frame, ch.frame_work = buf, self._isend(buf, ch.peer, tag)
        self.sent.add(a)

    # ---- computation ------------------------------------------------------------
    def _split(self, arr, what: str) -> List[np.ndarray]:
        m = self.s.n_microbatches
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"{what} must be a numpy.ndarray, got {type(arr).__name__}")
        if arr.ndim == 0 or arr.shape[0] % m:
            raise ValueError(f"{what} of shape {arr.shape}: dimension 0 must split evenly into "
                             f"n_microbatches={m} (the loss is a mean over equal microbatches)")
        return np.split(arr, m, axis=0)

    def _prepare(self) -> None:
        s = self.s
        if s.has_first_stage:
            if self.inputs is None:
                raise ValueError("step(): this rank holds stage 0 and must pass inputs")
            self.mb_inputs = self._split(self.inputs, "inputs")
            for x in self.mb_inputs:
                s.stages[0].check_input(x, "step(inputs=...)")
        if s.has_last_stage:
            if self.targets is None:
                raise ValueError(f"step(): this rank holds the last stage "
                                 f"({s.num_stages - 1}) and must pass targets")
            if self.loss_fn is None:
                raise ValueError("step(): the last stage needs a loss_fn (in the schedule's "
                                 "constructor or in step())")
            self.mb_targets = self._split(self.targets, "targets")

    def _forward(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        stage = self.s.stages[s]
        x = self.mb_inputs[mb] if s == 0 else self.acts.pop((s, mb))
        measure = _saved_bytes_fn(stage.module)
        before = measure() if measure else 0
        t0 = time.perf_counter()
        # Call the module (not .forward) so it opens one forward pass per
        # microbatch: that is how ringlet.nn pairs each backward with its forward.
        y = stage.module(x) if callable(stage.module) else stage.module.forward(x)
        if not isinstance(y, np.ndarray):
            raise TypeError(f"stage {s}: forward returned {type(y).__name__}, not a "
                            f"numpy.ndarray")
        if stage.is_last:
            loss, grad = self.loss_fn(y, self.mb_targets[mb])
            if not isinstance(grad, np.ndarray) or grad.shape != y.shape:
                raise ValueError(f"loss_fn must return (loss, grad) with grad shaped like the "
                                 f"output {y.shape}, got {getattr(grad, 'shape', type(grad))}")
            self.loss_sum += float(loss)
            # Each microbatch loss is a mean over B/m samples; 1/m makes the sum
            # of microbatch gradients the gradient of the full-batch mean.
            self.gouts[(s, mb)] = grad * (1.0 / self.s.n_microbatches)
        elif (s + 1) in self.s.stages:
            self.acts[(s + 1, mb)] = y  # the next stage is local (one-rank pipeline)
        else:
            self.outs[(s, mb)] = y
        self.stats.compute_time += time.perf_counter() - t0
        self.alive += 1
        # What this microbatch keeps alive until its backward: the module's own
        # count when it reports one, else the stage's input and output arrays.
        nbytes = measure() - before if measure else x.nbytes + y.nbytes
        self.alive_bytes[(s, mb)] = nbytes
        self.cur_bytes += nbytes
        self.stats.peak_alive = max(self.stats.peak_alive, self.alive)
        self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, self.cur_bytes)

    def _backward(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        stage = self.s.stages[s]
        g = self.gouts.pop((s, mb))
        t0 = time.perf_counter()
        gin = stage.module.backward(g)
        self.stats.compute_time += time.perf_counter() - t0
        self.alive -= 1
        self.cur_bytes -= self.alive_bytes.pop((s, mb))
        if s == 0:
            return
        if not isinstance(gin, np.ndarray):
            raise TypeError(f"stage {s}: backward returned {type(gin).__name__}, not a "
                            f"numpy.ndarray gradient of its input")
        if (s - 1) in self.s.stages:
            self.gouts[(s - 1, mb)] = gin
        else:
            self.gins[(s, mb)] = gin

    def _run_actions(self) -> None:
        self._prepare()
        acts = self.s.actions
        timeline = self.stats.timeline
        clock = time.perf_counter
        while self.pos < len(acts):
            a = acts[self.pos]
            k = a.kind
            t0 = clock()
            if k is F:
                self._forward(a)
            elif k is B:
                self._backward(a)
            elif k is SA:
                self._send(a, self.outs.pop((a.stage, a.microbatch)))
            elif k is SG:
                self._send(a, self.gins.pop((a.stage, a.microbatch)))
            elif k is RA:
                x = self._recv(a)
                self.acts[(a.stage, a.microbatch)] = x
            else:  # RG
                self.gouts[(a.stage, a.microbatch)] = self._recv(a)
            timeline.append((t0 - self.t_start, clock() - self.t_start, a))
            self.pos += 1
            if k in (F, B):
                self._pump_all()  # post receives whose declarations arrived meanwhile

    # ---- failure protocol ----------------------------------------------------------
    def _poison_and_drain(self, origin: int) -> None:
        """Poison every message still owed this step; consume every one still expected."""
        self.draining = True
        # The step is void: free its arrays before the protocol needs memory.
        for pending in (self.acts, self.outs, self.gouts, self.gins):
            pending.clear()
        self.mb_inputs = self.mb_targets = None
        poison_frames: Dict[int, np.ndarray] = {}
        for a in self.s.actions:
            if a.kind not in (SA, SG) or a in self.sent:
                continue
            ch, tag = self._out_channel(a)
            if ch.shape is None:
                if not ch.poisoned:  # stands for the whole channel
                    self._isend(_poison_declaration(self.step, a.stage, origin), ch.peer,
                                ch.decl_tag)
                    ch.poisoned = True
            else:  # the peer expects frames of the declared size
                buf = poison_frames.get(id(ch))
                if buf is None:
                    buf = poison_frames[id(ch)] = self._poison_frame(ch, a.stage, origin)
                self._isend(buf, ch.peer, tag)
            self.sent.add(a)
        for r in self.recvs.values():  # insertion order = schedule order
            if not r.consumed and r.ch.peer not in self.broken_peers:
                self._take(r)

    def _poison_frame(self, ch: _OutChannel, stage: int, origin: int) -> np.ndarray:
        """A POISON frame of ``ch``'s declared size."""
        try:
            return _frame(self.step, stage, -1, None, ch.nbytes, origin)
        except MemoryError:
            pass
        # Out of memory (perhaps the very failure being reported): reuse the
        # channel's last data frame once it has left; a declared channel has one.
        self._wait(ch.frame_work)
        return _poison_in_place(ch.frame, self.step, stage, origin)

    # ---- driver -----------------------------------------------------------------------
    def execute(self) -> Optional[float]:
        t_start = self.t_start = self.stats.started_at = time.perf_counter()
        s = self.s
        failure: Optional[BaseException] = None
        origin = -1  # group rank whose stage failed first, as far as this rank knows
        try:
            self._plan_recvs()
            self._pump_all()
            self._run_actions()
        except _CommFailure as exc:
            raise exc.exc from None
        except _Poisoned as exc:
            failure, origin = exc, exc.origin
        except BaseException as exc:  # noqa: BLE001 - reported to every rank, then re-raised
            # KeyboardInterrupt and SystemExit too: a Ctrl-C on one stage must not
            # leave the others waiting until their timeout.
            failure, origin = exc, s.rank
        # Interrupted here (Ctrl-C, sys.exit()): whatever the protocol meets, this
        # rank raises that exception, unchanged.
        interrupted = failure is not None and origin == s.rank and \
            not isinstance(failure, Exception)
        lost: Optional[BaseException] = None  # the protocol's own error, if interrupted
        # A second interrupt during the protocol is not caught: it ends the protocol
        # at once and propagates (every wait in it is bounded by the timeout anyway).
        try:
            if failure is not None:
                self._poison_and_drain(origin)
            for w in self.sends:
                self._wait(w)
            # Agreement: every rank learns whether any stage failed this step.
            any_failed = np.array([0 if failure is None else 1], np.int64)
            self._comm(ringlet.all_reduce, any_failed, ringlet.ReduceOp.MAX, group=self.group,
                       timeout=s.timeout)
            messages: List[Any] = []
            if any_failed[0]:
                mine = None
                if failure is not None and origin == s.rank:
                    mine = f"stage(s) {sorted(s.stages)} {_what_happened(failure)}"[:2000]
                messages = self._comm(ringlet.all_gather_object, mine, group=self.group,
                                      timeout=s.timeout)
        except _CommFailure as exc:
            if not interrupted:
                raise exc.exc from failure
            lost = exc.exc
        except Exception as exc:
            if failure is None:
                raise
            if not interrupted:
                # The protocol itself failed (no memory even for it): peers may wait
                # until their timeout; keep the original error as the cause.
                raise exc from failure
            lost = exc
        if lost is not None:
            _log.warning("pipeline rank %d: the failure protocol after %s failed: %s: %s",
                         s.rank, type(failure).__name__, type(lost).__name__, _describe(lost))
            raise failure  # outside the handler: its traceback and context stay its own
        self.stats.step_time = time.perf_counter() - t_start
        s.last_stats = self.stats
        if any_failed[0]:
            # The step is void: drop the forward contexts whose backward never ran
            # so the next step's backwards pair with their own forwards.
            for st in s.stages.values():
                clear = getattr(st.module, "clear_context", None)
                if callable(clear):
                    clear()
        if failure is not None and origin == s.rank:
            raise failure
        if any_failed[0]:
            failures = {r: m for r, m in enumerate(messages) if m is not None}
            desc = "; ".join(f"pipeline rank {r}: {m}" for r, m in failures.items())
            where = (f"stopped at {s.actions[self.pos]}" if self.pos < len(s.actions)
                     else "finished its own actions")
            raise PipelineError(
                f"pipeline step {self.step} failed on another rank ({desc}); this rank "
                f"(pipeline rank {s.rank}, stages {sorted(s.stages)}) {where}. Every rank's "
                f"messages were drained and saved contexts cleared, so the group is still "
                f"usable; zero the gradients before the next step",
                failures=failures, step=self.step, rank=s.rank)
        if s.has_last_stage:
            return self.loss_sum / s.n_microbatches
        return None


class _Meta:
    """Shape and dtype of an array not yet received (for ``PipelineStage.check_input``)."""

    def __init__(self, shape: tuple, dtype: np.dtype) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        self.ndim = len(self.shape)


# ---- the schedules ----------------------------------------------------------------------
def _check_microbatches(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n_microbatches must be an int, got {type(n).__name__}")
    n = int(n)
    if not 1 <= n <= MAX_MICROBATCHES:
        raise ValueError(f"n_microbatches must be in [1, {MAX_MICROBATCHES}], got {n}")
    return n


def _single_stage(stage: Any, name: str) -> PipelineStage:
    if not isinstance(stage, PipelineStage):
        raise TypeError(f"{name} takes one PipelineStage, got {type(stage).__name__}"
                        + (" (use ScheduleInterleaved1F1B for several stages per rank)"
                           if isinstance(stage, (list, tuple)) else ""))
    if stage.num_stages != stage.group_size:
        raise ValueError(f"{name}: the pipeline has {stage.num_stages} stages but the group "
                         f"has {stage.group_size} ranks; {name} runs one stage per rank (use "
                         f"ScheduleInterleaved1F1B for several)")
    return stage


class ScheduleGPipe(PipelineSchedule):
    """GPipe: all forwards, then all backwards.  Peak activations: every microbatch.

    Args:
        stage: this rank's ``PipelineStage`` (the group has one stage per rank).
        n_microbatches: microbatches per step (>= 1; the batch must split evenly).
        loss_fn: ``loss_fn(output, target) -> (loss, grad)`` used on the last stage.
        timeout: seconds each send/receive may take (default: the group's timeout).
        prefetch: receives posted ahead per peer (default 2).
    Raises:
        TypeError / ValueError: bad arguments; stage count != group size.

    Example::

        sched = ScheduleGPipe(stage, 8, loss_fn=ringlet.nn.mse_loss)
        loss = sched.step(x, y)   # on the last stage; None elsewhere
    """

    def __init__(self, stage: PipelineStage, n_microbatches: int, *,
                 loss_fn: Optional[Callable] = None, timeout: Optional[float] = None,
                 prefetch: int = 2) -> None:
        stage = _single_stage(stage, "ScheduleGPipe")
        m = _check_microbatches(n_microbatches)
        super().__init__([stage], m, plan_gpipe(stage.group_size, m), loss_fn=loss_fn,
                         timeout=timeout, prefetch=prefetch)


class Schedule1F1B(PipelineSchedule):
    """1F1B: warm-up forwards, then one forward / one backward, then drain.

    Same bubble as GPipe, but stage i keeps at most ``p - i`` microbatches'
    activations alive instead of all of them.  Arguments as ``ScheduleGPipe``.

    Example::

        sched = Schedule1F1B(stage, 8, loss_fn=ringlet.nn.mse_loss)
    """

    def __init__(self, stage: PipelineStage, n_microbatches: int, *,
                 loss_fn: Optional[Callable] = None, timeout: Optional[float] = None,
                 prefetch: int = 2) -> None:
        stage = _single_stage(stage, "Schedule1F1B")
        m = _check_microbatches(n_microbatches)
        super().__init__([stage], m, plan_1f1b(stage.group_size, m), loss_fn=loss_fn,
                         timeout=timeout, prefetch=prefetch)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B: v stages per rank (looping placement), smaller bubble.

    Args:
        stages: this rank's ``PipelineStage`` s: with group size p and
            ``num_stages = v·p``, exactly the stages r, r+p, ..., r+(v-1)p.
        n_microbatches: a multiple of p (the schedule works in rounds of p).
        loss_fn, timeout, prefetch: as ``ScheduleGPipe``.
    Raises:
        ValueError: n_microbatches not a multiple of p; stages missing, repeated,
            on another group, or not matching ``num_stages``.

    Example::

        chunks = split_model(model, 2 * p)
        stages = [PipelineStage(chunks[s], s, 2 * p) for s in (rank, rank + p)]
        sched = ScheduleInterleaved1F1B(stages, 2 * p, loss_fn=ringlet.nn.mse_loss)
    """

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, *,
                 loss_fn: Optional[Callable] = None, timeout: Optional[float] = None,
                 prefetch: int = 2) -> None:
        if isinstance(stages, PipelineStage):
            stages = [stages]
        stages = list(stages)
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError("ScheduleInterleaved1F1B takes a non-empty list of PipelineStage")
        first = stages[0]
        p, n = first.group_size, first.num_stages
        for s in stages[1:]:
            if s.num_stages != n or s.group is not first.group:
                raise ValueError("ScheduleInterleaved1F1B: all stages must share num_stages "
                                 "and the pipeline group")
        v = n // p
        want = list(range(first.group_rank, n, p))
        got = sorted(s.stage_index for s in stages)
        if got != want:
            raise ValueError(f"ScheduleInterleaved1F1B: with {n} stages on {p} ranks, pipeline "
                             f"rank {first.group_rank} must hold stages {want} (looping "
                             f"placement), got {got}")
        m = _check_microbatches(n_microbatches)
        if m % p:
            raise ValueError(f"ScheduleInterleaved1F1B needs n_microbatches to be a multiple of "
                             f"the pipeline group size {p}, got {m} ({multiple_hint(m, p)})")
        super().__init__(sorted(stages, key=lambda s: s.stage_index), m,
                         plan_interleaved_1f1b(p, v, m), loss_fn=loss_fn, timeout=timeout,
                         prefetch=prefetch)
