"""FSDP's runtime: gathering a unit's parameters and reducing its gradients.

Free functions over the ``FullyShardedDataParallel`` object (``fsdp``) that
owns the groups, the pending reductions, the memory tracker and the stats; the
wrapper in ``fsdp.py`` calls them from its unit hooks, ``_fsdp_state_dict``
from its collectives.  Per unit and flat group (``_FlatGroup``):

- parameters: ``issue_gather`` (async all-gather of the shard, in
  ``param_dtype``), ``wait_gather`` + ``bind`` (slices become the parameters'
  ``.data``), ``free_full`` (back to empty sentinels), ``prefetch`` (the next
  unit in recorded order);
- gradients: ``prepare_grads`` (``.grad`` views of one flat buffer),
  ``reduce_grads`` (async reduce-scatter on the shard group, or NO_SHARD's
  all-reduce), ``progress`` (completes reductions in issue order, then
  HYBRID_SHARD's all-reduce across replicas).  Replica all-reduces are DDP
  buckets (``start_replica_reduce``, ``_buckets``).
"""

from __future__ import annotations

import time
from typing import Any, List

import numpy as np

import ringlet

from . import comm_hooks
from ._buckets import GradBucket, start_bucket
from ._fsdp_flat_group import _FlatGroup, _Pending
from ._fsdp_unit import _FSDPUnit

__all__: List[str] = []


# ---- parameters ----------------------------------------------------------------------------------
def check_bindings(fg: _FlatGroup, expect_sentinel: bool) -> None:
    for mod, attr, i in fg.bindings:
        if mod._parameters.get(attr) is not fg.params[i]:
            raise RuntimeError(f"FSDP: parameter '{fg.names[i]}' was replaced after "
                               f"wrapping; FSDP manages it through its shard")
    for i, p in enumerate(fg.params):
        want = fg.sentinels[i] if expect_sentinel else fg.views[i]  # type: ignore[index]
        if p.data is not want:
            raise ValueError(
                f"FSDP: parameter '{fg.names[i]}' changed after wrapping (its data is now "
                f"shape {p.data.shape}, dtype {p.data.dtype}; FSDP laid it out as "
                f"{fg.layout.shapes[i]}, {fg.dtype}); parameter shapes and dtypes are "
                f"fixed once wrapped: change the model before constructing FSDP")


def bind(fg: _FlatGroup, full: np.ndarray) -> None:
    fg.full = full
    fg.views = fg.layout.views(full)
    for p, v in zip(fg.params, fg.views):
        p.data = v


def issue_gather(fsdp: Any, fg: _FlatGroup) -> None:
    if fg.full is not None or fg.gather is not None:
        return
    check_bindings(fg, expect_sentinel=True)
    if fg.layout.shards == 1:  # NO_SHARD with a cast: a local copy
        x = fg.shard.data
        if fg.comm_dtype != fg.dtype:  # round as a gather in param_dtype would
            x = x.astype(fg.comm_dtype)
        full = fsdp.memory.track("full_params", x.astype(fg.compute_dtype))
        bind(fg, full)
        return
    mem = fsdp.memory
    inp = fg.shard.data
    if fg.comm_dtype != fg.dtype:
        inp = mem.track("comm", inp.astype(fg.comm_dtype))
    out = mem.alloc("full_params", fg.layout.padded, fg.comm_dtype)
    work = ringlet.all_gather(out, inp, group=fsdp._shard.pg, async_op=True)
    fsdp.stats["all_gathers"] += 1
    fg.gather = (work, out, inp)


def wait_gather(fsdp: Any, fg: _FlatGroup) -> None:
    if fg.gather is None:
        return
    work, out, inp = fg.gather
    t0 = time.perf_counter()
    try:
        work.wait()
    finally:
        fsdp.stats["gather_wait_s"] += time.perf_counter() - t0
        fg.gather = None
        if inp is not fg.shard.data:
            fsdp.memory.release(inp)
    if fg.compute_dtype != fg.comm_dtype:  # bfloat16 gathered, float32 compute
        full = fsdp.memory.track("full_params", out.astype(fg.compute_dtype))
        fsdp.memory.release(out)
        out = full
    bind(fg, out)


def gather_unit(fsdp: Any, u: _FSDPUnit) -> None:
    """Make every flat group of ``u`` full: permanent ones are checked, others gathered."""
    for fg in u.flat_groups:
        if fg.permanent:
            check_bindings(fg, expect_sentinel=False)
        else:
            issue_gather(fsdp, fg)
    for fg in u.flat_groups:
        wait_gather(fsdp, fg)


def free_full(fsdp: Any, fg: _FlatGroup) -> None:
    """Drop ``fg``'s full parameters (not NO_SHARD's permanent views of the shard)."""
    if fg.permanent:
        return
    if fg.gather is not None:  # a prefetch nobody used: let it land, then drop it
        wait_gather(fsdp, fg)
    if fg.full is None:
        return
    check_bindings(fg, expect_sentinel=False)
    for p, s in zip(fg.params, fg.sentinels):
        p.data = s
    fsdp.memory.release(fg.full)
    fg.full = fg.views = None


def prefetch(fsdp: Any, u: _FSDPUnit, backward: bool) -> None:
    """Issue the all-gather of the unit after ``u`` in the previous pass's order."""
    if not fsdp.prefetch:
        return
    if backward:
        order = fsdp._bwd_order_prev
        if order is None:
            order = fsdp._fwd_order_prev[::-1]
    else:
        order = fsdp._fwd_order_prev
    try:
        i = order.index(u)
    except ValueError:
        return
    if i + 1 >= len(order):
        return
    nxt = order[i + 1]
    if backward and nxt.fwd_pending == 0:
        return  # it will not run backward in this pass
    for fg in nxt.flat_groups:
        if not fg.permanent and fg.full is None and fg.gather is None:
            issue_gather(fsdp, fg)
            fsdp.stats["prefetches"] += 1


# ---- gradients -----------------------------------------------------------------------------------
def prepare_grads(fsdp: Any, fg: _FlatGroup) -> None:
    """Bind ``fg``'s parameters' ``.grad`` to views of one zeroed flat gradient buffer."""
    if fg.grad_full is None:
        if fg.permanent and fg.reduce_dtype == fg.dtype:
            # NO_SHARD in one dtype: gradients accumulate straight into the
            # shard's gradient (DDP's layout); it is all-reduced in place.
            if fg.shard.grad is None:
                fg.shard.grad = fsdp.memory.alloc("sharded_grads", fg.layout.padded,
                                                  fg.dtype, zero=True)
            fg.grad_full = fg.shard.grad
        else:
            fg.grad_full = fsdp.memory.alloc("full_grads", fg.layout.padded,
                                             fg.compute_dtype, zero=True)
    for p, v in zip(fg.params, fg.layout.views(fg.grad_full)):
        if p.grad is not v:
            p.grad = v


def reduce_grads(fsdp: Any, fg: _FlatGroup) -> None:
    """Start the unit's gradient reduction (unless in no_sync); the buffer is then theirs."""
    if not fsdp._require_sync or fg.grad_full is None:
        return
    for p in fg.params:
        p.grad = None
    g, fg.grad_full = fg.grad_full, None
    mem = fsdp.memory
    inp = g
    if fg.reduce_dtype != g.dtype:
        inp = mem.track("comm", g.astype(fg.reduce_dtype))
        mem.release(g)
    sh, rep = fsdp._shard, fsdp._replicate
    if sh.size > 1:
        if fg.shard.grad is None:
            fg.shard.grad = mem.alloc("sharded_grads", fg.layout.shard_numel, fg.dtype,
                                      zero=True)
        # After zero_grad the shard gradient is zero: reduce straight into
        # it, no staging buffer (else stage, then add: gradients accumulate).
        if fg.reduce_dtype == fg.dtype and not fg.shard.grad.any():
            out = fg.shard.grad
        else:
            out = mem.alloc("comm", fg.layout.shard_numel, fg.reduce_dtype)
        op = ringlet.ReduceOp.AVG
        if inp.dtype == np.float16:  # its sum can overflow where the mean does not
            comm_hooks.divide_first(inp, sh.size)
            op = ringlet.ReduceOp.SUM
        work = ringlet.reduce_scatter(out, inp, op, group=sh.pg, async_op=True)
        fsdp.stats["reduce_scatters"] += 1
        fsdp._pending.append(_Pending(fg, work, inp, out, 1))
    else:
        work = start_replica_reduce(fsdp, fg, inp) if rep is not None else None
        fsdp._pending.append(_Pending(fg, work, inp, inp, 2))


def start_replica_reduce(fsdp: Any, fg: _FlatGroup, buf: np.ndarray) -> Any:
    """Start averaging ``buf`` over the replica group as a DDP bucket; returns its handle.

    ``buf`` is NO_SHARD's unsharded flat gradient or HYBRID_SHARD's reduced
    gradient shard; either way DDP's default hook reduces it.
    """
    rep = fsdp._replicate
    bucket = GradBucket(fg.index, buf, fg.params, fg.names, rep.pg, rep.size, rep.rank, False)
    fsdp.stats["all_reduces"] += 1
    return start_bucket(comm_hooks.allreduce_hook, None, bucket, "FSDP")


def progress(fsdp: Any, block: bool, keep: int = 0) -> None:
    """Advance finished reductions, strictly in issue order (same order on every rank).

    ``block``: wait until at most ``keep`` reductions are still in flight.
    """
    while fsdp._pending:
        pend = fsdp._pending[0]
        if pend.work is not None:
            if not pend.work.is_completed():
                if not block or len(fsdp._pending) <= keep:
                    return
                t0 = time.perf_counter()
                try:
                    pend.work.wait()
                finally:
                    fsdp.stats["reduce_wait_s"] += time.perf_counter() - t0
            else:
                pend.work.wait()  # raises the operation's error, if any
        if pend.stage == 1:
            if pend.inp is not pend.out:
                fsdp.memory.release(pend.inp)
            pend.inp = pend.out
            pend.stage = 2
            if fsdp._replicate is not None:
                pend.work = start_replica_reduce(fsdp, pend.fg, pend.out)
                continue
            pend.work = None
        fg = pend.fg
        if pend.out is not fg.shard.grad:
            if fg.shard.grad is None:
                fg.shard.grad = fsdp.memory.alloc("sharded_grads", fg.layout.shard_numel,
                                                  fg.dtype, zero=True)
            np.add(fg.shard.grad, pend.out, out=fg.shard.grad, casting="unsafe")
            fsdp.memory.release(pend.out)
        fsdp._pending.popleft()
