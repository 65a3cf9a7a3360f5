"""``DistributedDataParallel``: replicate a ``ringlet.nn`` model, average gradients.

Layout (after Megatron-LM's distributed optimizer buffers):

- One contiguous gradient buffer per dtype.  Parameters are laid out in it in
  *reverse* order, and every ``param.grad`` is a view of its slice
  (``gradient_as_bucket_view=True``), so layers accumulate straight into the
  buffer and nothing is copied in or out per step.
- Buckets are consecutive slices of a buffer, each at most ``bucket_cap_mb``
  (a parameter larger than the cap gets a bucket of its own).  Reverse order
  matches the order backward produces gradients, so the first bucket is ready
  first.
- Each parameter's gradient-ready hook counts its bucket down; when a bucket's
  last gradient is final its all-reduce is started with ``async_op=True`` and
  runs on the group's progress thread while backward continues.  Buckets are
  launched strictly in index order (a ready bucket waits for its
  predecessors), so every rank issues the same collectives in the same order
  whatever the order its hooks fire in.
- ``sync_gradients()`` launches what is left, waits, and leaves the mean over
  ranks in every gradient.  The default reduction is ``ReduceOp.AVG``, whose
  result the core computes once per chunk and distributes, so it is
  bit-identical on every rank.

Unused parameters
-----------------
A parameter that got no gradient in an iteration holds its bucket back.  At
``sync_gradients`` such parameters are marked ready with their current local
gradient (zero after ``zero_grad``), so every bucket is still reduced and no
rank waits forever.  With ``find_unused_parameters=True`` that is all.  With
False, every rank then contributes a 0/1 flag to one small all-reduce issued
right after the last bucket; when any rank had unused parameters, every rank
learns their names (``all_gather_object``) and raises the same
``RuntimeError`` naming them — no rank is left behind in a collective.

Late gradients
--------------
Once a parameter is ready its slice may be under reduction (its bucket
launched) or waiting for it, so a further gradient for it in the same
iteration (backward run twice over one forward, a forward/backward on the
module behind the wrapper's back, a layer that accumulates for a use it did
not count) cannot be added.  A pre-accumulate hook refuses it *before*
``.grad`` changes and raises on that rank, naming the parameter and its
bucket.  ``sync_gradients`` still completes every bucket (so the other ranks
are not left waiting), then raises on every rank (with the same flag as for
unused parameters; only on that rank with ``find_unused_parameters``) and
drops the module's saved contexts of the broken pass.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

import ringlet
from ringlet import nn

from . import comm_hooks
from ._buckets import GradBucket, start_bucket
from ._flat import FlatLayout
from ._replicas import broadcast_packed, gather_layouts, layout_digest

__all__ = ["DistributedDataParallel", "DDP", "GradBucket"]

_SMALL_BYTES = 1 << 20  # arrays below this are packed together for broadcasts


class DistributedDataParallel:
    """Data parallelism for a ``ringlet.nn.Module``: same model on every rank, averaged gradients.

    Every rank of ``group`` must construct it with the same model structure
    and the same options.  At construction the parameters and buffers are
    copied from rank 0 (``init_sync``), so all replicas start equal.

    Args:
        module: the model.
        group: process group (None: the default group).
        bucket_cap_mb: bucket size cap in MiB.
        broadcast_buffers: broadcast rank 0's buffers (e.g. batch-norm running
            statistics) at the start of every forward.  Then every rank must run
            every forward; evaluate on one rank with ``ddp.module(x)``.
        find_unused_parameters: allow parameters without a gradient in an
            iteration (they contribute their current local gradient, zero after
            ``zero_grad``).  False: such an iteration raises ``RuntimeError``
            naming them, on every rank.
        gradient_as_bucket_view: make every ``param.grad`` a view into the
            flat buffer (no copies).  False: keep separate gradient arrays and
            copy into and out of the buffer around the reduction.
        overlap: start each bucket's all-reduce from the backward pass (True) or
            do all reductions in ``sync_gradients`` (False, for comparison).
        init_sync: broadcast rank 0's parameters and buffers at construction.
    Raises:
        TypeError/ValueError: bad arguments, no trainable parameters, or
            replicas whose parameter layouts or options differ.

    Example::

        ringlet.init()
        ddp = DistributedDataParallel(model)
        opt = ringlet.optim.SGD(model.parameters(), lr=0.1)
        for x, y in local_batches:            # each rank its own shard of the data
            opt.zero_grad()
            loss, g = nn.cross_entropy(ddp(x), y)
            ddp.backward(g)                   # all-reduces overlap this
            ddp.sync_gradients()              # grads are now the mean over ranks
            opt.step()
    """

    def __init__(self, module: nn.Module, *, group: Any = None, bucket_cap_mb: float = 25,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = True, overlap: bool = True,
                 init_sync: bool = True) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel: module must be a ringlet.nn.Module, "
                            f"got {type(module).__name__}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not bucket_cap_mb > 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be a positive number, "
                             f"got {bucket_cap_mb!r}")
        self.module = module
        self.group = group
        self.world_size = ringlet.get_world_size(group)
        self.rank = ringlet.get_rank(group)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.overlap = bool(overlap)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DistributedDataParallel: the module has no trainable parameters")
        for n, p in named:
            # Two wrappers' hooks would both fire: the second copies a buffer the
            # first is still reducing.  (A copied parameter carries no hooks.)
            if any(isinstance(getattr(h, "__self__", None), DistributedDataParallel)
                   for h in p._hooks.values()):
                raise ValueError(f"DistributedDataParallel: parameter '{n}' is already wrapped "
                                 f"by another DistributedDataParallel; call its remove_hooks() "
                                 f"before wrapping the module again")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._build_buckets(int(self.bucket_cap_mb * (1 << 20)))
        self._verify_replicas(bool(init_sync))

        self._hook: Callable[[Any, GradBucket], Any] = comm_hooks.allreduce_hook
        self._hook_state: Any = None
        self._custom_hook = False
        self._no_sync_depth = 0
        self._require_sync = True
        self.last_sync_wait_s = 0.0  # seconds sync_gradients spent waiting (benchmarks)
        self._reset_iteration()
        self._handles = [p.register_grad_ready_hook(self._on_grad_ready) for p in self._params]
        self._handles += [p.register_grad_pre_accumulate_hook(self._on_grad_pre_accumulate)
                          for p in self._params]
        if init_sync and self.world_size > 1:
            self.broadcast_parameters(0)

    # ---- construction ----------------------------------------------------------------
    def _build_buckets(self, cap: int) -> None:
        order = list(range(len(self._params)))[::-1]  # backward produces grads in this order
        open_: Dict[np.dtype, List[int]] = {}
        open_bytes: Dict[np.dtype, int] = {}
        closed: List[Tuple[np.dtype, List[int]]] = []
        for i in order:
            p = self._params[i]
            dt = p.dtype
            cur = open_.setdefault(dt, [])
            if cur and open_bytes[dt] + p.nbytes > cap:
                closed.append((dt, cur))
                cur = open_[dt] = []
                open_bytes[dt] = 0
            cur.append(i)
            open_bytes[dt] = open_bytes.get(dt, 0) + p.nbytes
        closed.extend((dt, idx) for dt, idx in open_.items() if idx)

        # One flat buffer per dtype, parameters in reverse order: each bucket is
        # then one contiguous slice.  The layout is FSDP's with a single shard.
        in_buffer: Dict[np.dtype, List[int]] = {}
        for dt, idx in closed:
            in_buffer.setdefault(dt, []).extend(idx)
        layouts = {dt: FlatLayout([self._params[i].shape for i in idx], 1)
                   for dt, idx in in_buffer.items()}
        self.grad_buffers: Dict[np.dtype, np.ndarray] = {
            dt: np.zeros(lay.numel, dt) for dt, lay in layouts.items()}
        self._slots: List[Optional[np.ndarray]] = [None] * len(self._params)
        for dt, idx in in_buffer.items():
            for i, view in zip(idx, layouts[dt].views(self.grad_buffers[dt])):
                self._slots[i] = view
        fill = {dt: 0 for dt in layouts}
        self.buckets: List[GradBucket] = []
        self._bucket_of = [0] * len(self._params)
        for b, (dt, idx) in enumerate(closed):
            start = fill[dt]
            for i in idx:
                self._bucket_of[i] = b
                fill[dt] += self._params[i].size
            buf = self.grad_buffers[dt][start: fill[dt]]
            self.buckets.append(GradBucket(b, buf, [self._params[i] for i in idx],
                                           [self._names[i] for i in idx], self.group,
                                           self.world_size, self.rank, b == len(closed) - 1))
        self._bucket_sizes = [len(bk.parameters) for bk in self.buckets]
        if self.gradient_as_bucket_view:
            for p, slot in zip(self._params, self._slots):
                if p.grad is not None:
                    np.copyto(slot, p.grad, casting="unsafe")
                p.grad = slot

    def _verify_replicas(self, init_sync: bool) -> None:
        # Different layouts would make buckets of different sizes meet in one
        # all-reduce, and different buffers or broadcast options mismatched
        # broadcasts; compare a digest once, with names of what differs.
        if self.world_size == 1:
            return
        layout = [(n, p.shape, str(p.dtype)) for n, p in zip(self._names, self._params)]
        frozen = [(n, p.shape, str(p.dtype)) for n, p in self.module.named_parameters()
                  if not p.requires_grad]
        bufs = [(n, b.shape, str(b.dtype)) for n, b in self.module.named_buffers()]
        mine = layout_digest((layout, frozen, bufs, self.bucket_cap_mb,
                              self.find_unused_parameters, self.broadcast_buffers, init_sync))
        got = gather_layouts(mine, self.group)
        bad = [r for r, g in enumerate(got) if g[0] != got[0][0]]
        if bad:
            raise ValueError(f"DistributedDataParallel: ranks {bad} have a different parameter "
                             f"layout (names, shapes, dtypes, trainable or frozen), different "
                             f"buffers, or a different bucket_cap_mb, find_unused_parameters, "
                             f"broadcast_buffers or init_sync than rank 0; build the same model "
                             f"with the same options everywhere")

    # ---- per-iteration state -------------------------------------------------------------
    def _reset_iteration(self) -> None:
        self._ready = [False] * len(self._params)
        self._pending = list(self._bucket_sizes)
        self._next_launch = 0
        self._works: List[Any] = [None] * len(self.buckets)
        self._late: List[Tuple[int, int, bool]] = []  # refused (param, bucket, launched)

    def _dirty(self) -> bool:
        return self._next_launch > 0 or any(self._ready) or bool(self._late)

    def _mark_ready(self, i: int) -> None:
        self._ready[i] = True
        p = self._params[i]
        slot = self._slots[i]
        if self.gradient_as_bucket_view:
            if p.grad is not slot:  # something rebound .grad: fold it back into the buffer
                if p.grad is not None:
                    np.copyto(slot, p.grad, casting="unsafe")
                p.grad = slot
        elif p.grad is None:
            slot[...] = 0
        else:
            np.copyto(slot, p.grad, casting="unsafe")
        b = self._bucket_of[i]
        self._pending[b] -= 1

    def _on_grad_pre_accumulate(self, p: nn.Parameter) -> None:
        # Before the layer adds into .grad (a view of a bucket that may be
        # under reduction): refuse a gradient for a parameter already ready.
        if not self._require_sync:
            return
        i = self._index[id(p)]
        if not self._ready[i]:
            return
        b = self._bucket_of[i]
        launched = b < self._next_launch
        self._late.append((i, b, launched))
        state = ("was already launched (its all-reduce is in flight or done)" if launched
                 else "is ready and waiting to be launched")
        raise RuntimeError(
            f"DistributedDataParallel: rank {self.rank} got a second gradient for parameter "
            f"'{self._names[i]}' (index {i}) in one iteration, after it was marked ready; "
            f"its bucket {b} {state}. The gradient was refused (.grad is unchanged). Causes: "
            f"backward run twice over one forward, a forward/backward on the module outside "
            f"the wrapper (ddp.module or the model itself) before sync_gradients(), or a "
            f"layer accumulating a gradient for a use it did not pass to _save() "
            f"(find_unused_parameters does not change this). Run every forward through ddp, "
            f"call sync_gradients() after each backward (accumulate micro-batches inside "
            f"ddp.no_sync()). Call sync_gradients() on every rank now (it completes the "
            f"reduction, then raises on every rank) or end the job: the other ranks wait in this "
            f"iteration's reduction until their timeout")

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._require_sync:
            return  # no_sync(): accumulate locally only
        i = self._index[id(p)]
        if self._ready[i]:
            raise RuntimeError(
                f"DistributedDataParallel: the gradient of '{self._names[i]}' became ready twice "
                f"in one iteration; call sync_gradients() after each backward, or accumulate "
                f"inside `with ddp.no_sync():`")
        self._mark_ready(i)
        if self.overlap and self._pending[self._bucket_of[i]] == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        # Strictly in bucket order: every rank issues the same sequence.
        while self._next_launch < len(self.buckets) and self._pending[self._next_launch] == 0:
            b = self._next_launch
            self._next_launch += 1
            self._works[b] = start_bucket(self._hook, self._hook_state, self.buckets[b],
                                          "DistributedDataParallel")

    # ---- public API -----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward (after broadcasting rank 0's buffers, if enabled).

        Raises:
            RuntimeError: the previous iteration's gradients were not synchronised.
        """
        if nn.is_grad_enabled():
            if self._dirty():
                raise RuntimeError("DistributedDataParallel: call sync_gradients() after "
                                   "backward, before the next forward")
            self._require_sync = self._no_sync_depth == 0
        if self.broadcast_buffers and self.world_size > 1:
            arrays = [b for _, b in self.module.named_buffers()]
            if arrays:
                self._broadcast_arrays(arrays, 0)
        return self.module(*args, **kwargs)

    def backward(self, grad_output: Any) -> Any:
        """Back-propagate through the module; bucket all-reduces start as gradients finish.

        Returns:
            The module's gradient with respect to its input.
        """
        return self.module.backward(grad_output)

    def sync_gradients(self) -> None:
        """Finish the gradient reduction: afterwards every rank holds the mean gradients.

        Launches the buckets not started during backward (all of them without
        overlap), waits for every reduction and, with
        ``gradient_as_bucket_view=False``, copies the results back into
        ``param.grad``.  Inside ``no_sync()`` (for a forward run inside it)
        this does nothing.

        Raises:
            RuntimeError: parameters got no gradient on some rank and
                ``find_unused_parameters`` is False (raised on every rank,
                naming them); or a ringlet error from the reduction.
        """
        if not self._require_sync:
            return
        late = self._late
        unused = [i for i, r in enumerate(self._ready) if not r]
        for i in unused:
            self._mark_ready(i)
        t0 = time.perf_counter()
        try:
            self._launch_ready()
            flag = None
            if not self.find_unused_parameters and self.world_size > 1:
                flag = np.array([1 if unused else 0, 1 if late else 0], np.int32)
                flag_work = ringlet.all_reduce(flag, ringlet.ReduceOp.SUM, group=self.group,
                                               async_op=True)
            first_exc: Optional[BaseException] = None
            for w in self._works:
                try:
                    w.wait()
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    first_exc = first_exc or exc
            if flag is not None:
                try:
                    flag_work.wait()
                except BaseException as exc:  # noqa: BLE001
                    first_exc = first_exc or exc
            if first_exc is not None:
                raise first_exc
        finally:
            self.last_sync_wait_s = time.perf_counter() - t0
            self._reset_iteration()
            if late:  # the broken backward left saved contexts and uses: drop them
                self.module.clear_context()
                for p in self._params:  # a layer that raised after _pop() left its use counted
                    p._pending = 0
        if not self.gradient_as_bucket_view:
            for p, slot in zip(self._params, self._slots):
                if p.grad is None:
                    p.grad = slot.copy()
                else:
                    np.copyto(p.grad, slot, casting="unsafe")
        mine = ([] if self.find_unused_parameters else [self._names[i] for i in unused],
                [(self._names[i], i, b, launched) for i, b, launched in late])
        if flag is None:  # one rank, or find_unused_parameters: nothing to tell the others
            if mine[0] or mine[1]:
                raise RuntimeError(self._iteration_message({self.rank: mine}))
            return
        if flag.any():
            per_rank = ringlet.all_gather_object(mine, group=self.group)
            raise RuntimeError(self._iteration_message(
                {r: m for r, m in enumerate(per_rank) if m[0] or m[1]}))

    @classmethod
    def _iteration_message(cls, per_rank: Dict[int, Tuple[List[str], List[Any]]]) -> str:
        unused = {r: m[0] for r, m in per_rank.items() if m[0]}
        late = {r: m[1] for r, m in per_rank.items() if m[1]}
        parts = []
        if late:
            where = "; ".join(
                f"rank {r}: " + ", ".join(f"'{n}' (index {i}, bucket {b}, "
                                          f"{'launched' if lau else 'not yet launched'})"
                                          for n, i, b, lau in items)
                for r, items in sorted(late.items()))
            parts.append(
                f"DistributedDataParallel: a second gradient in one iteration was refused for "
                f"parameters already marked ready ({where}): those gradients, and the rest "
                f"of the backward that raised there, are not in this iteration's reduction, "
                f"so if they belong to this step, zero_grad() and redo it. Run every forward "
                f"through ddp and call sync_gradients() after each backward. The buckets were "
                f"still reduced on every rank and the saved contexts of the broken pass "
                f"dropped.")
        if unused:
            parts.append(cls._unused_message(unused))
        return " ".join(parts)

    @staticmethod
    def _unused_message(per_rank: Dict[int, List[str]]) -> str:
        parts = []
        for r, names in sorted(per_rank.items()):
            shown = ", ".join(f"'{n}'" for n in names[:20])
            more = f" and {len(names) - 20} more" if len(names) > 20 else ""
            parts.append(f"rank {r}: {shown}{more}")
        return ("DistributedDataParallel: parameters received no gradient in this iteration ("
                + "; ".join(parts) + "). Pass find_unused_parameters=True if that is expected "
                "(they then contribute their current gradient, zero after zero_grad), or make "
                "sure backward reaches every parameter. The gradients were still reduced on "
                "every rank.")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager: forwards inside it skip gradient reduction (gradient accumulation).

        Gradients of the forward/backward pairs run inside accumulate locally;
        the first iteration outside it reduces the accumulated sum.

        Example::

            with ddp.no_sync():
                for x, y in micro_batches[:-1]:
                    ddp.backward(nn.cross_entropy(ddp(x), y)[1])
            x, y = micro_batches[-1]
            ddp.backward(nn.cross_entropy(ddp(x), y)[1])
            ddp.sync_gradients()
        """
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def register_comm_hook(self, hook: Callable[[Any, GradBucket], Any],
                           state: Any = None) -> None:
        """Replace the bucket reduction with ``hook(state, bucket)`` (see ``comm_hooks``).

        Call it once, on every rank, between iterations.

        Raises:
            TypeError: ``hook`` is not callable.
            RuntimeError: a hook is already registered, or an iteration is in progress.
            ImportError: the hook needs a package that is missing (``bf16_compress``).
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        if self._custom_hook:
            raise RuntimeError("register_comm_hook: a communication hook is already registered")
        if self._dirty():
            raise RuntimeError("register_comm_hook: call it between iterations, not after "
                               "backward and before sync_gradients()")
        check = getattr(hook, "_ringlet_check", None)
        if check is not None:
            check()
        self._hook, self._hook_state, self._custom_hook = hook, state, True

    def broadcast_parameters(self, src: int = 0) -> None:
        """Copy rank ``src``'s parameters and buffers into every replica, in place.

        The arrays are not replaced, so optimizers and views stay valid.
        Every rank of the group must call it.

        Raises:
            TypeError/ValueError: bad ``src``.
        """
        if isinstance(src, bool) or not isinstance(src, (int, np.integer)):
            raise TypeError(f"broadcast_parameters: src must be an int rank, got "
                            f"{type(src).__name__}")
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast_parameters: src={src} is out of range for a group of "
                             f"size {self.world_size}")
        arrays = [p.data for p in self.module.parameters()]
        arrays += [b for _, b in self.module.named_buffers()]
        self._broadcast_arrays(arrays, int(src))

    def _broadcast_arrays(self, arrays: Sequence[np.ndarray], src: int) -> None:
        if self.world_size == 1:
            return
        broadcast_packed(arrays, lambda a: ringlet.broadcast(a, src, group=self.group),
                         is_src=self.rank == src, alone_bytes=_SMALL_BYTES)

    # ---- conveniences delegating to the module ---------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def state_dict(self, **kw: Any) -> Any:
        return self.module.state_dict(**kw)

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> Any:
        return self.module.load_state_dict(state_dict, strict)

    def train(self, mode: bool = True) -> "DistributedDataParallel":
        self.module.train(mode)
        return self

    def eval(self) -> "DistributedDataParallel":
        self.module.eval()
        return self

    def zero_grad(self) -> None:
        """Zero the gradients in place (the flat buffers stay bound)."""
        self.module.zero_grad()

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (gradients stay views of the buffers)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __repr__(self) -> str:
        return (f"DistributedDataParallel(world_size={self.world_size}, buckets="
                f"{len(self.buckets)}, overlap={self.overlap}, module={type(self.module).__name__})")


DDP = DistributedDataParallel
