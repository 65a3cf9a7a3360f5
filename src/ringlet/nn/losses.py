"""Losses.  Each returns ``(loss, grad)``: the loss as a Python float and its gradient
with respect to the prediction, in the prediction's dtype, ready for ``model.backward``."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import functional as F

__all__ = ["mse_loss", "cross_entropy"]

_REDUCTIONS = ("mean", "sum")


def _check_reduction(reduction: Any, what: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{what}: reduction must be 'mean' or 'sum', got {reduction!r}")


def mse_loss(pred: Any, target: Any, reduction: str = "mean") -> Tuple[float, np.ndarray]:
    """Squared error: ``mean((pred - target)**2)`` (or the sum).

    Args:
        pred: floating array.
        target: array of the same shape.
        reduction: "mean" over all elements, or "sum".
    Returns:
        (loss, d loss / d pred).
    Raises:
        TypeError: ``pred`` is not floating.  ValueError: shapes differ or bad reduction.

    Example::

        loss, g = mse_loss(model(x), y)
        model.backward(g)
    """
    _check_reduction(reduction, "mse_loss")
    pred = np.asarray(pred)
    if pred.dtype.kind != "f":
        raise TypeError(f"mse_loss: pred must be a floating array, got dtype {pred.dtype}")
    target = np.asarray(target)
    if target.shape != pred.shape:
        raise ValueError(f"mse_loss: target shape {target.shape} differs from pred shape "
                         f"{pred.shape}")
    diff = pred - target.astype(pred.dtype, copy=False)
    loss = float(np.sum(diff * diff, dtype=np.float64))
    grad = diff * pred.dtype.type(2)
    if reduction == "mean":
        n = max(pred.size, 1)
        loss /= n
        grad /= n
    return loss, grad


def cross_entropy(logits: Any, targets: Any, reduction: str = "mean",
                  ignore_index: Optional[int] = None) -> Tuple[float, np.ndarray]:
    """Softmax cross-entropy with integer class labels (numerically stable log-softmax).

    The class axis is the LAST axis of ``logits`` (shape (..., C)), unlike
    torch's axis 1; ``targets`` has the leading shape (...).

    Args:
        logits: floating array (..., C).
        targets: integer array (...) of labels in [0, C).
        reduction: "mean" over the counted targets, or "sum".
        ignore_index: label value that contributes neither loss nor gradient.
    Returns:
        (loss, d loss / d logits).
    Raises:
        TypeError: non-floating logits or non-integer targets.
        ValueError: shape mismatch, labels out of range, bad reduction.

    Example::

        loss, g = cross_entropy(model(x), y)   # y: int labels
        model.backward(g)
    """
    _check_reduction(reduction, "cross_entropy")
    logits = np.asarray(logits)
    if logits.dtype.kind != "f":
        raise TypeError(f"cross_entropy: logits must be a floating array, got dtype "
                        f"{logits.dtype}")
    if logits.ndim < 1:
        raise ValueError("cross_entropy: logits need a class axis")
    t = np.asarray(targets)
    if t.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: targets must be integer class labels, got dtype "
                        f"{t.dtype}")
    if t.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: targets shape {t.shape} must equal logits shape "
                         f"without the class axis, {logits.shape[:-1]}")
    C = logits.shape[-1]
    t = t.reshape(-1).astype(np.int64, copy=False)
    z = logits.reshape(-1, C)
    keep = np.ones(t.shape, bool) if ignore_index is None else (t != ignore_index)
    tk = t[keep]
    if tk.size and (tk.min() < 0 or tk.max() >= C):
        raise ValueError(f"cross_entropy: labels must be in [0, {C}), got values in "
                         f"[{tk.min()}, {tk.max()}]")
    logp = F.log_softmax(z, axis=-1)
    rows = np.nonzero(keep)[0]
    loss = -float(np.sum(logp[rows, tk], dtype=np.float64))
    # d/dz of -log softmax(z)[t] = softmax(z) - onehot(t)
    grad = np.exp(logp)
    grad[rows, tk] -= 1
    if ignore_index is not None:
        grad[~keep] = 0
    if reduction == "mean":
        n = max(int(rows.size), 1)
        loss /= n
        grad /= n
    return loss, grad.reshape(logits.shape)
