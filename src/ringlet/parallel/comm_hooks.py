"""Communication hooks for ``DistributedDataParallel``: how one gradient bucket is reduced.

A hook is called as ``hook(state, bucket)`` the moment the bucket's last
gradient is ready (or at ``sync_gradients`` without overlap).  It must start
the reduction and return a handle with ``wait()``; once ``wait()`` returns,
``bucket.buffer()`` must hold the mean of the bucket over the ranks of
``bucket.group``, identical on every rank.  Hooks use the public collectives
with ``async_op=True`` so the reduction runs while backward continues.

Built-ins:

- ``allreduce_hook``: the default; all-reduce with ``ReduceOp.AVG`` in the
  gradient dtype.
- ``fp16_compress``: cast to float16 (after dividing by the world size, so the
  sum cannot overflow), all-reduce, cast back into the gradient dtype.
  Half the bytes on the wire, about 3 significant digits.
- ``bf16_compress``: the same in bfloat16 (needs the ``ml_dtypes`` package);
  float32's range, about 2 significant digits.

Example::

    ddp = DDP(model)
    ddp.register_comm_hook(comm_hooks.fp16_compress)

Writing one: ``then(work, fn)`` wraps a ``Work`` so that ``fn()`` runs once
after it completes, on the thread that waits (use it to decompress).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

import ringlet

__all__ = ["allreduce_hook", "fp16_compress", "bf16_compress", "then"]


class _ThenWork:
    """A ``Work``-like handle: waits for ``work``, then runs ``fn`` exactly once."""

    __slots__ = ("_work", "_fn", "_done")

    def __init__(self, work: Any, fn: Callable[[], None]) -> None:
        self._work = work
        self._fn: Optional[Callable[[], None]] = fn
        self._done = False

    def wait(self, timeout: Optional[float] = None) -> bool:
        self._work.wait(timeout)
        if self._fn is not None:
            fn, self._fn = self._fn, None
            fn()
        self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done

    def exception(self) -> Optional[BaseException]:
        return self._work.exception()


def then(work: Any, fn: Callable[[], None]) -> Any:
    """Return a handle whose ``wait()`` waits for ``work`` and then calls ``fn()`` once.

    Args:
        work: a ``ringlet.Work`` (or anything with ``wait``).
        fn: called with no arguments after the operation completed.
    Returns:
        An object with ``wait(timeout=None)``, ``is_completed()`` and ``exception()``.
    """
    if not callable(getattr(work, "wait", None)):
        raise TypeError(f"then(): work must have a wait() method, got {type(work).__name__}")
    if not callable(fn):
        raise TypeError(f"then(): fn must be callable, got {type(fn).__name__}")
    return _ThenWork(work, fn)


def allreduce_hook(state: Any, bucket: Any) -> Any:
    """Default hook: average ``bucket.buffer()`` in place with ``ReduceOp.AVG``.

    The C core divides each reduced chunk once, on one rank, before the chunks
    are gathered, so every rank ends with the same bits.  A float16 buffer is
    divided by the world size on each rank first and then summed: its sum can
    overflow where the mean does not.
    """
    buf = bucket.buffer()
    if buf.dtype == np.float16:
        divide_first(buf, bucket.world_size)
        return ringlet.all_reduce(buf, ringlet.ReduceOp.SUM, group=bucket.group, async_op=True)
    return ringlet.all_reduce(buf, ringlet.ReduceOp.AVG, group=bucket.group, async_op=True)


def divide_first(buf: np.ndarray, n: int) -> None:
    """Divide a gradient buffer by ``n`` in place, before it is summed over ``n`` ranks."""
    if n > 1:
        np.divide(buf, n, out=buf)


def fp16_compress(state: Any, bucket: Any) -> Any:
    """Reduce the bucket in float16, then restore it to the gradient dtype.

    Each rank divides by the world size before the cast, so the float16 sum
    holds the mean and cannot overflow where the mean does not.
    """
    buf = bucket.buffer()
    if buf.dtype == np.float16:
        return allreduce_hook(state, bucket)
    comp = (buf / bucket.world_size).astype(np.float16)
    work = ringlet.all_reduce(comp, ringlet.ReduceOp.SUM, group=bucket.group, async_op=True)
    return _ThenWork(work, lambda: np.copyto(buf, comp, casting="unsafe"))


def _bfloat16() -> Any:
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("bf16_compress needs the ml_dtypes package for numpy bfloat16: "
                          "pip install ml_dtypes (or ringlet[bfloat16])") from None
    return ml_dtypes.bfloat16


def bf16_compress(state: Any, bucket: Any) -> Any:
    """Reduce the bucket in bfloat16 (``ml_dtypes``), then restore it to the gradient dtype.

    Raises:
        ImportError: ``ml_dtypes`` is not installed (also raised when the hook
            is registered, before any communication).
    """
    bf16 = _bfloat16()
    buf = bucket.buffer()
    comp = buf.astype(bf16)
    work = ringlet.all_reduce(comp, ringlet.ReduceOp.AVG, group=bucket.group, async_op=True)
    return _ThenWork(work, lambda: np.copyto(buf, comp.astype(buf.dtype)))


# Checked by DistributedDataParallel.register_comm_hook, so a missing
# dependency fails at registration on every rank instead of mid-backward.
bf16_compress._ringlet_check = _bfloat16  # type: ignore[attr-defined]
