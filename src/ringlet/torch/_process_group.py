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
lists of tensors run on the callers' memory when the list's tensors lie back to
back in one storage (``list(t.chunk(P))``); otherwise through one flat
temporary, whose copies in or out happen on the progress thread, before the
future completes (``_span``).
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
_HOST_KEY = "ringlet/host0"  # rank 0's host identity, where torch's store names no host


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


def _span(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """One 1-D tensor over the memory of ``tensors`` when they are contiguous CPU
    tensors of ``dtype`` lying back to back, in list order, in one storage (as
    ``list(t.chunk(P))`` or ``t.split(sizes)`` give); None otherwise.

    A list form then runs on that span: no temporary, no copy in or out.  Tensors
    apart (``[torch.empty_like(x) for _ in range(P)]``) need one: ringlet's
    collectives take one array per side, and the per-tensor alternative (P
    broadcasts or P reduces) costs P operations' latency and the shared-memory
    all_gather's single copy.  Empty tensors are skipped: they hold no bytes.
    """
    first: Optional[torch.Tensor] = None
    base = size = n = 0
    for t in tensors:
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            return None
        k = t.numel()
        if not k:
            continue
        if first is None:
            first, base, size = t, t.data_ptr(), t.element_size()
        elif t.data_ptr() != base + n * size:
            return None
        n += k
    if first is None:
        return None
    start = first.storage_offset()
    if (start + n) * size > first.untyped_storage().nbytes():
        return None  # the next blocks lie in memory past the first one's storage
    return first.detach().as_strided((n,), (1,), start)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Whether two tensors' memory ranges share a byte (a non-contiguous one
    # counts from its first element over nbytes: the binding refuses it anyway).
    if not a.numel() or not b.numel():
        return False
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + b.nbytes and pb < pa + a.nbytes


def _apart(output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    # ``output``, or a temporary for it when it shares memory with ``input`` (the
    # in-place form output = input.chunk(P)[rank], which NCCL and gloo accept):
    # ringlet's reduce_scatter refuses overlap, so the result is copied in after.
    return torch.empty_like(output) if _overlaps(output, input) else output


def _check_list(op: str, what: str, tensors: Sequence[torch.Tensor], P: int, n: int,
                other: str) -> None:
    # A list form's P tensors must each hold n elements (what the flat buffer assumes).
    if len(tensors) != P:
        raise ValueError(f"{op}: {len(tensors)} {what} tensors for a group of {P} ranks")
    for i, x in enumerate(tensors):
        if x.numel() != n:
            raise ValueError(f"{op}: {what} tensor {i} has {x.numel()} elements but the "
                             f"{other} has {n}")


def _unflat_into(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    # Block i of flat starts right after block i - 1.
    off = 0
    for t in outs:
        n = t.numel()
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
        span = _span(tensors, tensors[0].dtype) if tensors else None
        if span is not None:  # back to back in one storage: reduced in place
            return self._work([self._g.all_reduce(span, op, async_op=a, timeout=t)], tensors)
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
            x = x.contiguous()
            even = sizes.count(sizes[0]) == P
            flat = _span(outs, x.dtype)
            if flat is None:  # tensors apart: gathered into a temporary, copied out after
                flat = torch.empty(sum(sizes), dtype=x.dtype)
                copies.append((flat, outs))
            elif not even and _overlaps(x, flat) and x.data_ptr() != outs[me].data_ptr():
                x = x.clone()  # all_gather_v's input may lie in its output only as its block
            if even:
                works.append(self._g.all_gather(flat, x, async_op=a, timeout=t))
            else:
                # Uneven outputs (as torch allows): every rank knows every size.
                works.append(self._g.all_gather_v(flat, sizes, x, async_op=a, timeout=t))
        after = (lambda: [_unflat_into(f, outs) for f, outs in copies]) if copies else None
        return self._work(works, [o for outs in output_lists for o in outs], after)

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
        # torch's layout: output_lists[q][i] receives rank q's inputs[i] (one list per
        # rank, the transpose of allgather's), so rank q's block of one all_gather of
        # the concatenated inputs is output_lists[q] back to back.
        opts = opts or AllgatherOptions()
        a = self._async(opts)
        t = self._t(opts)
        P = self.size()
        if len(output_lists) != P:
            raise ValueError(f"allgather_coalesced: {len(output_lists)} output lists for a "
                             f"group of {P} ranks (one per rank)")
        dtypes = {y.dtype for y in inputs}
        if len(dtypes) > 1:
            raise TypeError("allgather_coalesced: inputs must share one dtype, got "
                            f"{sorted(str(d) for d in dtypes)}")
        for q, outs in enumerate(output_lists):
            if len(outs) != len(inputs):
                raise ValueError(f"allgather_coalesced: output list {q} has {len(outs)} "
                                 f"tensors but there are {len(inputs)} inputs")
            for i, (o, y) in enumerate(zip(outs, inputs)):
                if o.dtype != y.dtype:
                    raise TypeError(f"allgather_coalesced: output_lists[{q}][{i}] is "
                                    f"{o.dtype} but input {i} is {y.dtype}")
                if o.numel() != y.numel():
                    raise ValueError(f"allgather_coalesced: output_lists[{q}][{i}] has "
                                     f"{o.numel()} elements but input {i} has {y.numel()}")
        x = _flat(inputs)
        outs = [o for outs in output_lists for o in outs]
        flat = _span(outs, x.dtype)
        after = None
        if flat is None:  # tensors apart: gathered into a temporary, copied out after
            flat = torch.empty(P * x.numel(), dtype=x.dtype)
            after = lambda: _unflat_into(flat, outs)  # noqa: E731
        w = self._g.all_gather(flat, x, async_op=a, timeout=t)
        return self._work([w], outs, after)

    def reduce_scatter(self, outputs: List[torch.Tensor],
                       input_lists: List[List[torch.Tensor]], opts: Any = None) -> Any:
        opts = opts or dist.ReduceScatterOptions()
        a = self._async(opts)
        op, t = _op(opts), self._t(opts)
        works = []
        for o, ins in zip(outputs, input_lists):
            _check_list("reduce_scatter", "input", ins, self.size(), o.numel(), "output")
            flat = _span(ins, o.dtype)
            if flat is None or _overlaps(flat, o):  # apart, or o among them: a temporary
                flat = _flat(ins)
            works.append(self._g.reduce_scatter(o, flat, op, async_op=a, timeout=t))
        return self._work(works, outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Any:
        opts = opts or dist.ReduceScatterOptions()
        a = self._async(opts)
        o = _apart(output, input)
        w = self._g.reduce_scatter(o, input, _op(opts), async_op=a, timeout=self._t(opts))
        return self._work([w], [output], None if o is output else lambda: output.copy_(o))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.ReduceScatterOptions()
        a = self._async(opts)
        op, t = _op(opts), self._t(opts)
        works, copies = [], []
        for o, i in zip(outputs, inputs):
            tmp = _apart(o, i)
            if tmp is not o:
                copies.append((o, tmp))
            works.append(self._g.reduce_scatter(tmp, i, op, async_op=a, timeout=t))
        after = (lambda: [o.copy_(tmp) for o, tmp in copies]) if copies else None
        return self._work(works, outputs, after)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Optional[List[int]],
                          input_split_sizes: Optional[List[int]], opts: Any = None) -> Any:
        opts = opts or dist.AllToAllOptions()
        a = self._async(opts)
        t = self._t(opts)
        P = self.size()
        if _overlaps(output, input):  # in place: ringlet's all_to_all refuses overlap
            input = input.clone()
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
        flat_in = _span(inputs, inputs[0].dtype) if inputs else None
        if flat_in is None:
            flat_in = _flat(inputs)
        flat_out = _span(outputs, flat_in.dtype)
        after = None
        if flat_out is None:
            flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=flat_in.dtype)
            after = lambda: _unflat_into(flat_out, outputs)  # noqa: E731
        elif _overlaps(flat_in, flat_out):  # all_to_all refuses overlap: copy the inputs
            flat_in = _flat(inputs)
        w = self._g.all_to_all_v(flat_out, [o.numel() for o in outputs], flat_in,
                                 [i.numel() for i in inputs], async_op=a, timeout=t)
        return self._work([w], outputs, after)

    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
               opts: Any = None) -> Any:
        opts = opts or dist.GatherOptions()
        a = self._async(opts)
        t, root = self._t(opts), opts.rootRank
        x = inputs[0].contiguous()
        if self.rank() == root:
            outs = output_lists[0]
            _check_list("gather", "output", outs, self.size(), x.numel(), "input")
            span = _span(outs, x.dtype)
            if span is not None:  # gather accepts an input anywhere inside its output
                return self._work([self._g.gather(span, x, root, async_op=a, timeout=t)], outs)
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
            ins, o = input_lists[0], outputs[0]
            _check_list("scatter", "input", ins, self.size(), o.numel(), "output")
            flat = _span(ins, o.dtype)
            # The root's output may be its own input block (in place), nothing else of it.
            if flat is None or (_overlaps(flat, o) and o.data_ptr() != ins[root].data_ptr()):
                flat = _flat(ins)
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
                         master_addr=_master_addr(opts.store, opts.group_rank, opts.group_size),
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


def _master_addr(store: Any, rank: int, size: int) -> str:
    """The rendezvous host ringlet's world routes to, so that every rank binds (and
    rank 0 serves ringlet's store) where the others reach it.

    The host of torch's TCPStore (``tcp://``, ``env://``, torchrun's agent store),
    as MASTER_ADDR is for env://; else MASTER_ADDR; else (``file://``, a store
    passed in) RINGLET_IFNAME's address; else loopback, which only ranks on
    rank 0's host can use: a rank elsewhere fails at once, naming the remedies.
    """
    from ringlet import environment

    s, inner = store, store
    while s is not None and not isinstance(s, dist.TCPStore):
        inner, s = s, getattr(s, "underlying_store", None)  # torch wraps it in PrefixStores
    host = s.host if s is not None else None
    if host and host not in ("0.0.0.0", "::"):
        return host
    host = os.environ.get("MASTER_ADDR")
    if host:
        return host
    ifname = os.environ.get("RINGLET_IFNAME")
    if ifname and ifname.strip():
        return environment.select_bind_address(None, ifname)
    if size > 1:
        from ringlet._topology import host_id

        mine = host_id()
        if rank == 0:
            store.set(_HOST_KEY, mine)
        elif store.get(_HOST_KEY).decode() != mine:
            from ringlet.errors import RendezvousError

            raise RendezvousError(
                f"rank {rank}: torch's store ({type(inner).__name__}) names no host and "
                f"this rank runs on another host than rank 0, so ringlet's rendezvous "
                f"would be on loopback; set RINGLET_IFNAME to the interface the hosts "
                f"share (or MASTER_ADDR to rank 0's host), or use init_method='tcp://...'",
                rank=rank, peer=0)
    return "127.0.0.1"


def _world_group_or_none() -> Optional["ringlet.ProcessGroup"]:
    return _world_group() if ringlet.is_initialized() else None


def _world_group() -> "ringlet.ProcessGroup":
    from ringlet import _world

    return _world._require(None)
