"""Turn any accepted buffer object into a numpy view of the same memory (never a copy).

Accepted: numpy arrays (returned as they are); torch CPU tensors (float16 and
bfloat16 included); any object exporting DLPack (``__dlpack__``); any object
exporting the buffer protocol (``array.array``, ``memoryview``, ``bytearray``).
The collectives write results into the view, so they land in the caller's
object.  Everything else, and every case that would need a copy, raises
``TypeError`` / ``ValueError`` naming the argument and the fix.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["as_array"]

_ACCEPTED = ("a numpy.ndarray, a CPU torch tensor, or an object exporting DLPack (__dlpack__) "
             "or the buffer protocol (array.array, memoryview)")


# torch tensor classes met so far: one set lookup per call instead of the module test.
_TENSOR_TYPES: set = set()


def as_array(x: Any, what: str, writable: bool) -> np.ndarray:
    """A C-contiguous numpy view of ``x``'s memory.

    Args:
        x: the caller's buffer object.
        what: its argument name, for error messages ("array", "output", ...).
        writable: the operation writes into ``x``.
    Returns:
        ``x`` itself when it is a numpy array; else a view sharing its memory.
    Raises:
        TypeError: ``x`` exports no memory numpy can view, or lives on a device
            (a CUDA tensor: pass ``x.cpu()``).
        ValueError: ``x`` is not contiguous, or is read-only but ``writable``.

    Example::

        as_array(torch.ones(4), "array", True)   # float32 view of the tensor
    """
    if isinstance(x, np.ndarray):
        return x
    tp = type(x)
    if tp in _TENSOR_TYPES:
        return _torch_view(x, what)
    if tp.__module__.startswith("torch") and hasattr(x, "untyped_storage"):
        _TENSOR_TYPES.add(tp)
        return _torch_view(x, what)
    if hasattr(x, "__dlpack__"):
        try:
            a = np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError, ValueError) as exc:
            raise TypeError(f"{what}: numpy cannot view this {type(x).__name__} through "
                            f"DLPack ({exc}); move it to host memory first") from None
    else:
        try:
            m = memoryview(x)
        except TypeError:
            raise TypeError(f"{what} must be {_ACCEPTED}, got {type(x).__name__}") from None
        if not m.c_contiguous:
            raise ValueError(f"{what} is a non-contiguous {type(x).__name__}; pass a "
                             f"contiguous buffer")
        if writable and m.readonly:
            raise ValueError(f"{what} is a read-only {type(x).__name__}; ringlet writes the "
                             f"result into it: pass a writable buffer (e.g. a bytearray)")
        try:
            a = np.asarray(m)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{what}: numpy cannot read the buffer format {m.format!r} of this "
                            f"{type(x).__name__} ({exc})") from None
        return a
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} is a non-contiguous {type(x).__name__}; make it contiguous "
                         f"first")
    if writable and not a.flags.writeable:
        raise ValueError(f"{what} is a read-only {type(x).__name__}; ringlet writes the result "
                         f"into it")
    return a


def _torch_view(t: Any, what: str) -> np.ndarray:
    try:  # the common case in one call: a CPU tensor numpy can view
        a = t.numpy()
        if a.flags.c_contiguous:
            return a
    except (TypeError, RuntimeError):
        pass  # off the CPU, tracking gradients or bfloat16: the checks below say which
    dev = t.device
    if dev.type != "cpu":
        raise TypeError(f"{what} is a torch tensor on {dev}; ringlet reduces host memory: pass "
                        f"{what}.cpu() (and copy the result back with .copy_())")
    if not t.is_contiguous():
        raise ValueError(f"{what} is a non-contiguous torch tensor (shape {tuple(t.shape)}, "
                         f"stride {t.stride()}); pass {what}.contiguous() and copy the result "
                         f"back")
    if t.requires_grad:
        t = t.detach()  # same storage; numpy() refuses tensors that track gradients
    name = str(t.dtype)
    if name == "torch.bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"{what} is a bfloat16 tensor: numpy needs ml_dtypes to view it "
                            f"(pip install ml_dtypes, or 'ringlet[torch]')") from None
        return t.view(_torch_int16()).numpy().view(ml_dtypes.bfloat16)
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"{what}: a torch tensor of dtype {name} has no numpy view ({exc})"
                        ) from None


def _torch_int16():
    import torch

    return torch.int16
