"""``SyncBatchNorm``: batch normalisation whose statistics cover the whole data-parallel batch.

With data parallelism each rank sees only its slice of the batch, and
``BatchNorm1d`` would normalise with that slice's statistics.
``SyncBatchNorm`` reduces them over a group so every rank normalises with
the statistics of the concatenated batch, whatever each rank's batch size.

Forward (training) packs, per channel, the local sum and sum of squares,
plus the local count and a refusal flag, into one float64 array of
``2C + 2`` values and all-reduces it once: ``mean = S1 / N``,
``var = S2 / N - mean**2`` (biased, for normalising; the running variance
gets the unbiased ``var * N/(N-1)``).
Sums are taken in float64 whatever the layer's dtype, so the
``E[x^2] - E[x]^2`` form keeps its precision for activations of ordinary
scale.  A rank may hold zero samples; the global count must exceed one.
A float16 layer normalises, and sums in backward, in float32 (as
``BatchNorm1d`` does) and returns float16.

Backward needs two per-channel sums over the whole batch, ``sum(dy)`` and
``sum(dy * xhat)``; they are packed with a flag (the number of ranks that
cannot go on) into one array of ``2C + 1`` values and all-reduced once,
before the parameter gradients are accumulated (a pre-accumulate hook that
refuses one raises after it).
Then, with ``g = dy * weight``,
``dx = rstd * (g - weight*sum(dy)/N - xhat * weight*sum(dy*xhat)/N)``.
The parameter gradients stay local sums over this rank's samples (a
data-parallel wrapper averages or sums them as for any parameter).

A rank that refuses its input (shape, dtype) or ``grad_output`` still joins
that all-reduce, flagged, and raises its ``ValueError``/``TypeError``; the
others raise ``ValueError`` at once instead of waiting for it until their
timeout, and the group stays usable.  So does a rank in training mode whose
backward finds no saved forward context (its forward failed or ran under
``no_grad()``, the context was cleared, one backward too many), with zeros.
When backward's flag is set, every rank takes part in one more all-reduce of
one value a rank (what went wrong there, if anything) and all raise together:
a ``RuntimeError`` naming the ranks without a context if there are any, else
the ``ValueError`` of a refused ``grad_output``.

Evaluation mode communicates nothing: it uses the running statistics, or
with ``track_running_stats=False`` this rank's own batch statistics (as
``torch.nn.SyncBatchNorm`` does), so one rank may evaluate alone.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

import ringlet

from .._timeout import seconds
from .layers import (BatchNorm1d, _compute_dtype, _float_input, _grad_like,
                     _update_running_stats)
from .module import Module

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]

# What a rank reports in the backward's roll call (see SyncBatchNorm._backward_failed).
_BACKWARD_OK, _REFUSED_GRAD, _NO_CONTEXT = 0, 1, 2


def _check_group(group: Any, what: str) -> Any:
    if group is not None and not isinstance(group, ringlet.ProcessGroup):
        raise TypeError(f"{what}: group must be a ringlet.ProcessGroup or None, got "
                        f"{type(group).__name__}")
    return group


class SyncBatchNorm(BatchNorm1d):
    """``BatchNorm1d`` with batch statistics reduced over ``group``.

    Takes (N, C) or (N, C, L) inputs like ``BatchNorm1d`` and has the same
    parameters, buffers and running-statistics rule (so state dicts are
    interchangeable).  In training mode every rank of ``group`` must call
    forward and backward the same number of times (each is one all-reduce).

    Args:
        num_features, eps, momentum, affine, track_running_stats, dtype: as ``BatchNorm1d``.
        group: the ``ProcessGroup`` to reduce over (default: the world).
        timeout: seconds for each all-reduce (default: the group's).
    Raises:
        TypeError / ValueError: as ``BatchNorm1d``; also when the whole group
            holds at most one value per channel in training, or on every rank
            when some rank refused its input or ``grad_output``.
        RuntimeError: backward in training on every rank of the group when some
            rank had no saved forward context (the message names those ranks).

    Example::

        bn = SyncBatchNorm(64, group=dp_group)
        y = bn(x_local)            # normalised with the statistics of every rank's x
        gx = bn.backward(gy)
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *,
                 group: Any = None, timeout: Optional[float] = None,
                 dtype: Any = np.float32) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, dtype=dtype)
        self.group = _check_group(group, "SyncBatchNorm")
        if timeout is not None:
            timeout = seconds(timeout, "SyncBatchNorm: timeout")
        self.timeout = timeout

    def extra_repr(self) -> str:
        return super().extra_repr() + (", group=world" if self.group is None
                                       else f", group={self.group.ranks}")

    def _all_reduce(self, arr: np.ndarray) -> None:
        ringlet.all_reduce(arr, group=self.group, timeout=self.timeout)

    @staticmethod
    def _check_peers(flags: float, what: str, when: str) -> None:
        # Ranks that refused their own argument took part in the all-reduce
        # flagged (and raise why themselves): fail here too, with nothing changed.
        if flags > 0:
            raise ValueError(f"SyncBatchNorm.{when}: {int(round(flags))} other rank(s) of the "
                             f"group refused their {what} (each raised why); this rank "
                             f"computed and updated nothing")

    def forward(self, x: Any) -> np.ndarray:
        dt = self.weight.data.dtype if self.weight is not None else self._dtype
        C = self.num_features
        sync = self.training  # evaluation never communicates
        try:
            x = _float_input(x, "SyncBatchNorm", dt)
            if x.ndim not in (2, 3) or x.shape[1] != C:
                raise ValueError(f"SyncBatchNorm: expected input (N, {C}) or (N, {C}, L), got "
                                 f"shape {x.shape}")
        except (TypeError, ValueError):
            if sync:
                # Still take part in the statistics' all-reduce, flagged, so the
                # other ranks raise now instead of waiting for this rank until the timeout.
                flagged = np.zeros(2 * C + 2, np.float64)
                flagged[2 * C + 1] = 1
                self._all_reduce(flagged)
            raise
        axes = (0,) if x.ndim == 2 else (0, 2)
        bshape = (1, C) + ((1,) if x.ndim == 3 else ())
        use_batch = self.training or not self.track_running_stats
        ct = _compute_dtype(dt)
        n_global = 0
        if use_batch:
            # One fused all-reduce: [sum x (C), sum x^2 (C), count, ranks refusing their
            # input], in float64.
            x64 = x.astype(np.float64, copy=False)
            stats = np.empty(2 * C + 2, np.float64)
            stats[:C] = x64.sum(axis=axes)
            stats[C:2 * C] = np.square(x64).sum(axis=axes)
            stats[2 * C] = x.size // C
            stats[2 * C + 1] = 0
            if sync:
                self._all_reduce(stats)
                self._check_peers(stats[2 * C + 1], "input", "forward")
            n_global = int(round(stats[2 * C]))
            if n_global <= 1:
                where = "over the group" if sync else "in evaluation on this rank"
                raise ValueError(f"SyncBatchNorm: batch statistics need more than one value "
                                 f"per channel {where}, got {n_global} (this rank's input "
                                 f"shape {x.shape})")
            mean64 = stats[:C] / n_global
            var64 = np.maximum(stats[C:2 * C] / n_global - mean64 * mean64, 0.0)
            mean = mean64.astype(ct)
            var = var64.astype(ct)
        else:
            mean, var = self.running_mean, self.running_var
        xc = x.astype(ct, copy=False) - mean.reshape(bshape)  # a copy for float16 only
        rstd = (1.0 / np.sqrt(var.astype(ct, copy=False) + self.eps)).astype(
            ct, copy=False).reshape(bshape)
        xhat = xc * rstd
        # Kept in the layer's dtype, rstd in the compute dtype (one value a channel).
        y = xhat_s = xhat.astype(dt, copy=False)
        if self.weight is not None:
            y = (xhat * self.weight.data.reshape(bshape) + self.bias.data.reshape(bshape)
                 ).astype(dt, copy=False)
        if use_batch and self.training and self.track_running_stats:
            # Last, once nothing else can raise: a failed forward leaves the statistics alone.
            _update_running_stats(self, mean64, var64 * (n_global / (n_global - 1)))
        self._save((xhat_s, rstd, axes, bshape, use_batch, sync, n_global),
                   (self.weight, self.bias))
        return y

    def _backward_failed(self, mine: int, error: Optional[BaseException]) -> None:
        """Some rank cannot finish this backward: every rank learns which and why, and raises.

        Every rank of the group calls it, so its all-reduces pair up: a failing
        rank (``mine`` not ``_BACKWARD_OK``) in place of backward's all-reduce,
        which it joins here flagged, with zeros; the others once that all-reduce
        came back flagged.  Returns only on a rank that refused its
        ``grad_output`` when no rank lacked a context (it re-raises its own error).
        """
        C = self.num_features
        if mine != _BACKWARD_OK:
            flagged = np.zeros(2 * C + 1, np.float64)
            flagged[2 * C] = 1
            self._all_reduce(flagged)
        # The roll call: one value a rank, only on this failure path.
        why = np.zeros(ringlet.get_world_size(self.group), np.float64)
        why[ringlet.get_rank(self.group)] = mine
        self._all_reduce(why)
        missing = np.flatnonzero(why == _NO_CONTEXT).tolist()
        if missing:
            where = f"rank(s) {missing} of the group"
            if self.group is not None:
                where += f" (world rank(s) {[self.group.ranks[r] for r in missing]})"
            this = ("this rank is one of them" if mine == _NO_CONTEXT
                    else "this rank computed and updated nothing")
            raise RuntimeError(
                f"SyncBatchNorm.backward: {where} had no saved forward context (a forward "
                f"that failed or ran under no_grad(), a cleared context, or one backward "
                f"too many); every rank of the group raised this at once, {this}") from error
        if mine == _BACKWARD_OK:
            self._check_peers(float(np.count_nonzero(why == _REFUSED_GRAD)), "grad_output",
                              "backward")

    def backward(self, grad_output: Any) -> np.ndarray:
        C = self.num_features
        try:
            ctx = self._pop()
        except RuntimeError as e:
            if self.training:
                # A forward in training communicates, so the peers are entering this
                # backward's all-reduce: join it, flagged, and every rank raises now.
                self._backward_failed(_NO_CONTEXT, e)  # raises
            raise
        xhat_s, rstd, axes, bshape, use_batch, sync, n_global = ctx
        communicates = use_batch and sync
        ct = _compute_dtype(xhat_s.dtype)
        try:
            g = _grad_like(grad_output, xhat_s.shape, ct, "SyncBatchNorm")
        except (TypeError, ValueError) as e:
            if communicates:  # flagged, as in forward
                self._backward_failed(_REFUSED_GRAD, e)
            raise
        xhat = xhat_s.astype(ct, copy=False)
        sum_g = g.sum(axis=axes)
        sum_gx = (g * xhat).sum(axis=axes)
        sums = None
        if communicates:
            # One fused all-reduce of the two per-channel sums backward needs (and
            # the count of ranks that cannot go on), before anything here can
            # raise on this rank alone (a pre-accumulate hook refusing a gradient).
            sums = np.empty(2 * C + 1, np.float64)
            sums[:C] = sum_g
            sums[C:2 * C] = sum_gx
            sums[2 * C] = 0
            self._all_reduce(sums)
            if sums[2 * C] > 0:
                self._backward_failed(_BACKWARD_OK, None)  # raises
        if self.weight is not None:
            if self.weight.requires_grad:
                self.weight.accumulate_grad(sum_gx)
            if self.bias.requires_grad:
                self.bias.accumulate_grad(sum_g)
            w = self.weight.data.reshape(bshape)
        else:
            w = None
        gxhat = g if w is None else g * w
        if not use_batch:  # running statistics are constants
            return (gxhat * rstd).astype(xhat_s.dtype, copy=False)
        if sums is None:  # batch statistics of this rank alone (evaluation)
            sums = np.concatenate([sum_g, sum_gx]).astype(np.float64, copy=False)
        m1 = (sums[:C] / n_global).astype(ct).reshape(bshape)
        m2 = (sums[C:2 * C] / n_global).astype(ct).reshape(bshape)
        if w is not None:
            m1 = m1 * w
            m2 = m2 * w
        return (rstd * (gxhat - m1 - xhat * m2)).astype(xhat_s.dtype, copy=False)


def convert_sync_batchnorm(module: Module, group: Any = None) -> Module:
    """Replace every ``BatchNorm1d`` in ``module`` (recursively) with a ``SyncBatchNorm``.

    The new layers take over the old ones' ``Parameter`` objects and buffer
    arrays (so optimizers built on the old parameters keep working) and the
    training flag.  A layer reachable under several names is replaced by one
    ``SyncBatchNorm``.  Existing ``SyncBatchNorm`` layers are left alone.

    Args:
        module: a ``Module`` (or a ``BatchNorm1d`` itself).
        group: the group to reduce over (default: the world).
    Returns:
        ``module`` with its batch norms replaced, or the new ``SyncBatchNorm``
        when ``module`` itself is a ``BatchNorm1d``.
    Raises:
        TypeError: ``module`` is not a Module; bad group.

    Example::

        model = convert_sync_batchnorm(model, group=dp_group)
        ddp = DistributedDataParallel(model, group=dp_group)
    """
    if not isinstance(module, Module):
        raise TypeError(f"convert_sync_batchnorm: expected a ringlet.nn.Module, got "
                        f"{type(module).__name__}")
    _check_group(group, "convert_sync_batchnorm")
    memo: Dict[int, Module] = {}
    root = _convert_one(module, group, memo)
    if root is not module:
        return root
    seen = set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        for name, child in list(m._modules.items()):
            if child is None:
                continue
            new = _convert_one(child, group, memo)
            if new is not child:
                # Assign in place so the child keeps its position (Sequential order).
                m._modules[name] = new
            stack.append(new)
    return module


def _convert_one(m: Module, group: Any, memo: Dict[int, Module]) -> Module:
    if not isinstance(m, BatchNorm1d) or isinstance(m, SyncBatchNorm):
        return m
    if id(m) in memo:
        return memo[id(m)]
    # The layer's real dtype (``Module.to`` may have cast it since construction).
    ref = m.weight if m.weight is not None else m.running_mean
    dtype = ref.dtype if ref is not None else m._dtype
    new = SyncBatchNorm(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats,
                        group=group, dtype=dtype)
    for name in ("weight", "bias"):
        new._parameters[name] = m._parameters.get(name)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        new._buffers[name] = m._buffers.get(name)
    object.__setattr__(new, "training", m.training)
    memo[id(m)] = new
    return new
