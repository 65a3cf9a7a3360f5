"""Stateless numpy functions shared by layers and losses (forward and derivative pairs)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["relu", "gelu", "gelu_grad", "tanh", "softmax", "log_softmax"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def relu(x: np.ndarray) -> np.ndarray:
    """max(x, 0), same dtype as ``x``."""
    return np.maximum(x, 0, dtype=x.dtype)


def _gelu_tanh(x: np.ndarray):
    u = _SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)
    return np.tanh(u)


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (torch's ``approximate="tanh"``).

    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``; it differs from
    the exact erf form by less than 1e-3 everywhere.  Float16 is computed in
    float32 and returned as float16, as torch does.
    """
    if getattr(x, "dtype", None) == np.float16:
        return gelu(x.astype(np.float32)).astype(np.float16)
    return 0.5 * x * (1.0 + _gelu_tanh(x))


def gelu_grad(x: np.ndarray, t: np.ndarray = None) -> np.ndarray:
    """d gelu(x) / dx for the tanh approximation; ``t`` is ``tanh(u)`` if already known.

    Float16 is computed in float32 and returned as float16: in float16 the
    ``x^2`` term overflows for |x| above about 700 (a NaN gradient) and
    ``1 - t*t`` loses its digits.
    """
    if getattr(x, "dtype", None) == np.float16:
        t32 = None if t is None else t.astype(np.float32)
        return gelu_grad(x.astype(np.float32), t32).astype(np.float16)
    if t is None:
        t = _gelu_tanh(x)
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * x * x)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du


def tanh(x: np.ndarray) -> np.ndarray:
    """Hyperbolic tangent."""
    return np.tanh(x)


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable log-softmax along ``axis`` (the max is subtracted first)."""
    m = np.max(x, axis=axis, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax along ``axis``."""
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)
