"""``RingletProcessGroup``: torch's ProcessGroup interface over a ringlet group.

torch's C++ ``Backend`` cannot be subclassed from Python, but a Python
subclass of ``ProcessGroup`` returned by the backend's creator is used as the
group itself (DDP, comm hooks, FSDP2 and pipelining call its methods).

Every operation runs asynchronously on the ringlet group's progress thread
(its ``async_op=True`` path), or inline when torch's ``asyncOp`` is False (a
blocking call: no hand-off).  An asynchronous one returns a torch ``Work``
built from a ``torch.futures.Future`` whose value is the list of output
tensors, as DDP's comm hooks expect (``fut.value()[0]``); a blocking one, done
when it returns, one shared completed ``Work``.  Operations that torch hands over as
lists of tensors go through one flat buffer; the copies in or out happen on
the progress thread, before the future completes.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
# AllgatherOptions is not re-exported by torch.distributed.
from torch._C._distributed_c10d import AllgatherOptions, _create_work_from_future

import ringlet
from ringlet import ReduceOp

__all__ = ["RingletProcessGroup", "create_process_group"]

_T = dist.ReduceOp.RedOpType
_OPS = {_T.SUM: ReduceOp.SUM, _T.AVG: ReduceOp.AVG, _T.PRODUCT: ReduceOp.PROD,
        _T.MIN: ReduceOp.MIN, _T.MAX: ReduceOp.MAX, _T.BAND: ReduceOp.BAND,
        _T.BOR: ReduceOp.BOR, _T.BXOR: ReduceOp.BXOR}
_BY_VALUE = {int(k): v for k, v in _OPS.items()}  # pybind enums hash slowly
_COMM_KEY = "ringlet/comm_id"


def _op(opts: Any) -> ReduceOp:
    red = opts.reduceOp.op
    op = _BY_VALUE.get(int(red))
    if op is None:
        raise ValueError(f"the ringlet backend does not support ReduceOp {red.name}; supported: "
                         f"{', '.join(k.name for k in _OPS)}")
    return op


def _splits(what: str, sizes: Optional[List[int]], t: torch.Tensor, P: int,
            rank: int) -> List[int]:
    """all_to_all_single's rows per rank for one side, checked as torch documents
    them: P sizes summing to the first dimension, or none and an even split."""
    rows = t.shape[0] if t.dim() > 0 else 1
    if not sizes:
        if rows % P:
            raise ValueError(f"all_to_all_single on rank {rank}: {what} has {rows} rows, not "
                             f"divisible by the group size {P}; pass {what}_split_sizes")
        return [rows // P] * P
    sizes = [int(c) for c in sizes]
    if len(sizes) != P or any(c < 0 for c in sizes) or sum(sizes) != rows:
        raise ValueError(f"all_to_all_single on rank {rank}: {what}_split_sizes {sizes} must be "
                         f"{P} sizes >= 0 summing to the {what}'s {rows} rows")
    return sizes


def _done_work() -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result([])
    return _create_work_from_future(fut)


# What every blocking call returns: the op has finished when the call does, and
# torch only waits on its Work, so one completed Work serves them all (a future
# built per call cost more than the small op itself).
_DONE = _done_work()


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def _check_list(op: str, what: str, tensors: Sequence[torch.Tensor], P: int, n: int,
                other: str) -> None:
    # A list form's P tensors must each hold n elements (what the flat buffer assumes).
    if len(tensors) != P:
        raise ValueError(f"{op}: {len(tensors)} {what} tensors for a group of {P} ranks")
    for i, x in enumerate(tensors):
        if x.numel() != n:
            raise ValueError(f"{op}: {what} tensor {i} has {x.numel()} elements but the "
                             f"{other} has {n}")


def _unflat_into(flat: torch.Tensor, outs: Sequence[torch.Tensor], stride: int = -1,
                 sizes: Optional[Sequence[int]] = None) -> None:
    # Block i of flat starts at i * stride (stride -1: right after block i - 1).
    off = 0
    for i, t in enumerate(outs):
        n = t.numel() if sizes is None else sizes[i]
        if stride >= 0:
            off = i * stride
        t.copy_(flat[off:off + n].view_as(t))
        off += n


class RingletProcessGroup(dist.ProcessGroup):
    """A torch ``ProcessGroup`` whose collectives run on ringlet.

    Created by torch through the registered backend (``init_process_group("ringlet")``,
    ``new_group(..., backend="ringlet")``); not constructed by users.

    Args:
        group: the ringlet group of these ranks.
        timeout: seconds any operation may block (torch's group timeout).
    """

    def __init__(self, group: "ringlet.ProcessGroup", timeout: float) -> None:
        super().__init__(group.rank, group.size)
        self._g = group
        self._timeout = timeout
        # Passed per op only where torch's differs from the ringlet group's own.
        self._default_t = None if timeout == group.timeout else timeout
        self._name = ""

    # ---- identity ---------------------------------------------------------------
    def getBackendName(self) -> str:
        return "ringlet"

    @property
    def ringlet_group(self) -> "ringlet.ProcessGroup":
        """The ringlet group underneath (numpy collectives on the same ranks)."""
        return self._g

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name
        try:
            super()._set_group_name(name)
        except Exception:  # noqa: BLE001 - the C++ side may keep no name for Python groups
            pass

    def __repr__(self) -> str:
        return f"RingletProcessGroup(rank={self.rank()}, size={self.size()}, {self._g!r})"

    def shutdown(self) -> None:
        """torch's ``destroy_process_group(group)``: close a subgroup's ringlet group
        (its sockets, segment and threads); the world group stays until
        ``ringlet.shutdown()``."""
        if self._g is not _world_group_or_none():
            self._g.close()

    abort = shutdown

    # ---- plumbing -----------------------------------------------------------------
    def _t(self, opts: Any) -> Optional[float]:
        # None: the ringlet group's own deadline (equal to torch's), its fast path.
        t = getattr(opts, "timeout", None)
        if isinstance(t, timedelta) and t.days >= 0 and t.total_seconds() > 0:
            return t.total_seconds()
        return self._default_t

    @staticmethod
    def _async(opts: Any) -> bool:
        # torch sets asyncOp=False for a blocking call: run it inline on this thread
        # (ringlet's synchronous path), with no hand-off to the progress thread.
        return bool(getattr(opts, "asyncOp", True))

    def _work(self, works: List[Any], result: List[torch.Tensor],
              after: Optional[Callable[[], None]] = None) -> Any:
        """A torch Work that completes when the last ringlet work does.

        Works of one ringlet group run in issue order, so the last one done
        means all are; a failure poisons the group, so it reaches the last.
        No works (a blocking call, already done): ``after`` runs here and
        the shared completed Work is returned.
        """
        last = works[-1] if works else None
        if last is None:
            if after is not None:
                after()
            return _DONE
        fut: torch.futures.Future = torch.futures.Future()

        def done(w: Any) -> None:
            exc = w.exception()
            if exc is None and after is not None:
                try:
                    after()
                except BaseException as e:  # noqa: BLE001 - handed to the future
                    exc = e
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        last._add_done_callback(done)
        return _Work(fut, last)

    # ---- collectives -------------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.AllreduceOptions()
        a = self._async(opts)
        op, t = _op(opts), self._t(opts)
        works = [self._g.all_reduce(x, op, async_op=a, timeout=t) for x in tensors]
        return self._work(works, tensors)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.AllreduceCoalescedOptions()
        a = self._async(opts)
        op, t = _op(opts), self._t(opts)
        if len({x.dtype for x in tensors}) > 1:
            raise TypeError("allreduce_coalesced: tensors must share one dtype, got "
                            f"{sorted({str(x.dtype) for x in tensors})}")
        flat = _flat(tensors)
        w = self._g.all_reduce(flat, op, async_op=a, timeout=t)
        return self._work([w], tensors, lambda: _unflat_into(flat, tensors))

    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.BroadcastOptions()
        a = self._async(opts)
        t, root = self._t(opts), opts.rootRank
        works = [self._g.broadcast(x, root, async_op=a, timeout=t) for x in tensors]
        return self._work(works, tensors)

    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.ReduceOptions()
        a = self._async(opts)
        op, t, root = _op(opts), self._t(opts), opts.rootRank
        works = [self._g.reduce(x, root, op, async_op=a, timeout=t) for x in tensors]
        return self._work(works, tensors)

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                  opts: Any = None) -> Any:
        opts = opts or AllgatherOptions()
        a = self._async(opts)
        t = self._t(opts)
        works, copies = [], []
        P, me = self.size(), self.rank()
        for outs, x in zip(output_lists, inputs):
            if len(outs) != P:
                raise ValueError(f"allgather: {len(outs)} output tensors for a group of "
                                 f"{P} ranks")
            sizes = [o.numel() for o in outs]
            if sizes[me] != x.numel():
                raise ValueError(f"allgather: rank {me}'s output tensor (index {me}) has "
                                 f"{sizes[me]} elements but its input has {x.numel()}")
            # Uneven outputs (as torch allows): every rank sends a block of the
            # largest size, its own padded, and takes each rank's share of it.
            m = max(sizes)
            flat = torch.empty(m * P, dtype=x.dtype)
            x = x.contiguous()
            if x.numel() < m:
                x = torch.cat([x.reshape(-1), x.new_zeros(m - x.numel())])
            works.append(self._g.all_gather(flat, x, async_op=a, timeout=t))
            copies.append((flat, outs, m, sizes))
        return self._work(works, [o for outs in output_lists for o in outs],
                          lambda: [_unflat_into(f, outs, m, sizes)
                                   for f, outs, m, sizes in copies])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Any:
        opts = opts or AllgatherOptions()
        a = self._async(opts)
        t = self._t(opts)
        w = self._g.all_gather(output, input, async_op=a, timeout=t)
        return self._work([w], [output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or AllgatherOptions()
        a = self._async(opts)
        t = self._t(opts)
        works = [self._g.all_gather(o, i, async_op=a, timeout=t)
                 for o, i in zip(outputs, inputs)]
        return self._work(works, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]],
                            inputs: List[torch.Tensor], opts: Any = None) -> Any:
        return self.allgather(output_lists, inputs, opts)

    def reduce_scatter(self, outputs: List[torch.Tensor],
                       input_lists: List[List[torch.Tensor]], opts: Any = None) -> Any:
        opts = opts or dist.ReduceScatterOptions()
        a = self._async(opts)
        op, t = _op(opts), self._t(opts)
        works = []
        for o, ins in zip(outputs, input_lists):
            _check_list("reduce_scatter", "input", ins, self.size(), o.numel(), "output")
            works.append(self._g.reduce_scatter(o, _flat(ins), op, async_op=a, timeout=t))
        return self._work(works, outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Any:
        opts = opts or dist.ReduceScatterOptions()
        a = self._async(opts)
        w = self._g.reduce_scatter(output, input, _op(opts), async_op=a,
                                   timeout=self._t(opts))
        return self._work([w], [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.ReduceScatterOptions()
        a = self._async(opts)
        op, t = _op(opts), self._t(opts)
        works = [self._g.reduce_scatter(o, i, op, async_op=a, timeout=t)
                 for o, i in zip(outputs, inputs)]
        return self._work(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Optional[List[int]],
                          input_split_sizes: Optional[List[int]], opts: Any = None) -> Any:
        opts = opts or dist.AllToAllOptions()
        a = self._async(opts)
        t = self._t(opts)
        P = self.size()
        if not output_split_sizes and not input_split_sizes:
            w = self._g.all_to_all(output, input, async_op=a, timeout=t)
            return self._work([w], [output])
        # Splits count rows (the first dimension); ringlet counts elements.
        orow = output[0].numel() if output.dim() > 0 and output.shape[0] else 1
        irow = input[0].numel() if input.dim() > 0 and input.shape[0] else 1
        oc = _splits("output", output_split_sizes, output, P, self.rank())
        ic = _splits("input", input_split_sizes, input, P, self.rank())
        w = self._g.all_to_all_v(output, [c * orow for c in oc], input, [c * irow for c in ic],
                                 async_op=a, timeout=t)
        return self._work([w], [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                 opts: Any = None) -> Any:
        opts = opts or dist.AllToAllOptions()
        a = self._async(opts)
        t = self._t(opts)
        flat_in = _flat(inputs)
        flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=flat_in.dtype)
        w = self._g.all_to_all_v(flat_out, [o.numel() for o in outputs], flat_in,
                                 [i.numel() for i in inputs], async_op=a, timeout=t)
        return self._work([w], outputs, lambda: _unflat_into(flat_out, outputs))

    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
               opts: Any = None) -> Any:
        opts = opts or dist.GatherOptions()
        a = self._async(opts)
        t, root = self._t(opts), opts.rootRank
        x = inputs[0].contiguous()
        if self.rank() == root:
            outs = output_lists[0]
            _check_list("gather", "output", outs, self.size(), x.numel(), "input")
            flat = torch.empty(x.numel() * self.size(), dtype=x.dtype)
            w = self._g.gather(flat, x, root, async_op=a, timeout=t)
            return self._work([w], outs, lambda: _unflat_into(flat, outs))
        w = self._g.gather(None, x, root, async_op=a, timeout=t)
        return self._work([w], [])

    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]],
                opts: Any = None) -> Any:
        opts = opts or dist.ScatterOptions()
        a = self._async(opts)
        t, root = self._t(opts), opts.rootRank
        flat = None
        if self.rank() == root:
            _check_list("scatter", "input", input_lists[0], self.size(), outputs[0].numel(),
                        "output")
            flat = _flat(input_lists[0])
        w = self._g.scatter(outputs[0], flat, root, async_op=a, timeout=t)
        return self._work([w], outputs)

    def barrier(self, opts: Any = None) -> Any:
        opts = opts or dist.BarrierOptions()
        a = self._async(opts)
        w = self._g.barrier(async_op=a, timeout=self._t(opts))
        return self._work([w], [])

    # ---- point to point ------------------------------------------------------------
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> Any:
        works = [self._g.isend(x, dst, tag, timeout=self._timeout) for x in tensors]
        return self._work(works, tensors)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> Any:
        works = [self._g.irecv(x, src, tag, timeout=self._timeout) for x in tensors]
        return self._work(works, tensors)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> Any:
        if len(tensors) != 1:
            raise ValueError(f"recv from any source takes one tensor, got {len(tensors)}")
        w = self._g.irecv(tensors[0], None, tag, timeout=self._timeout)
        return _SourceWork(self._work([w], tensors), w)


class _Work(dist.Work):
    """The torch Work of an asynchronous op: its torch future, completed when the
    ringlet work ``w`` is; ``wait(timeout)`` honours a finite timeout (torch's
    future-wrapping Work refuses one)."""

    def __init__(self, fut: torch.futures.Future, w: ringlet.Work) -> None:
        super().__init__()
        self._fut, self._w = fut, w

    def wait(self, timeout: Any = None) -> bool:
        if timeout is not None:
            t = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
            if t > 0:
                self._w.wait(t)  # CollectiveTimeout (a RuntimeError) when it passes first
        self._fut.wait()  # set right after the ringlet work finishes
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and self.exception() is None

    def exception(self) -> Any:
        # The future's, not the ringlet work's: a copy-out after the op can fail too.
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return exc
        return None

    def result(self) -> List[torch.Tensor]:
        return self._fut.value()


class _SourceWork(_Work):
    """A receive from any source: torch asks its Work for the sender
    (``_source_rank``, in the group's numbering) once it is done."""

    def __init__(self, inner: _Work, work: ringlet.Work) -> None:
        super().__init__(inner._fut, inner._w)
        self._src = work

    def _source_rank(self) -> int:
        return self._src.result()

    source_rank = _source_rank


# ---- creation ----------------------------------------------------------------------
def create_process_group(opts: Any, backend_options: Any = None) -> RingletProcessGroup:
    """The backend's creator (torch calls it with the extended API).

    The default group (``global_ranks_in_group`` empty) joins ringlet's world,
    initialising it through torch's store when this process has not called
    ``ringlet.init()``.  Any other group is formed by its members alone: group
    rank 0 takes a fresh communicator id from ringlet's store and hands it to
    the others through the group's torch store.
    """
    timeout = opts.timeout.total_seconds() if opts.timeout.total_seconds() > 0 else 300.0
    ranks = list(opts.global_ranks_in_group)
    if not ranks:  # the default group
        if not ringlet.is_initialized():
            ringlet.init(rank=opts.group_rank, world_size=opts.group_size, timeout=timeout,
                         master_addr=os.environ.get("MASTER_ADDR") or "127.0.0.1",
                         _torch_store=opts.store)
        g = _world_group()
        if g.size != opts.group_size or g.rank != opts.group_rank:
            raise ValueError(f"torch's default group is rank {opts.group_rank} of "
                             f"{opts.group_size} but ringlet's world is rank {g.rank} of "
                             f"{g.size}: initialise both with the same ranks")
        return RingletProcessGroup(g, timeout)
    if not ringlet.is_initialized():
        raise RuntimeError("a ringlet subgroup needs ringlet's world: call "
                           "init_process_group('ringlet') (or ringlet.init()) first")
    from ringlet import _world

    world = _world._current()
    if world.size == 1:  # no store: ids from the world group's count, as ringlet.new_group
        wg = _world_group()
        wg._ngroups += 1
        comm_id = 2 * (wg._ngroups + 1)
    elif opts.group_rank == 0:
        comm_id = 2 * world.store.add(world.prefix + "next_comm", 1)
        opts.store.set(_COMM_KEY, str(comm_id))
    else:
        comm_id = int(opts.store.get(_COMM_KEY).decode())
    g = world.make_group(comm_id, ranks, timeout)  # torch's order: group rank = index
    return RingletProcessGroup(g, timeout)


def _world_group_or_none() -> Optional["ringlet.ProcessGroup"]:
    return _world_group() if ringlet.is_initialized() else None


def _world_group() -> "ringlet.ProcessGroup":
    from ringlet import _world

    return _world._require(None)
