"""Layers: Linear, activations, Dropout, LayerNorm, Embedding, BatchNorm1d, Sequential.

Every layer takes inputs of shape (batch, features) or (batch, ..., features)
(``BatchNorm1d``: (N, C) or (N, C, L) like torch) and computes in the dtype of
its parameters (float32 by default, float64 or float16 allowed).  Like torch,
float16 layers compute GELU, normalisation statistics and every sum over the
batch in float32 inside and return float16.  Backward formulas are the
textbook ones; each is checked against central finite differences in
``tests/test_nn.py``.

Layers keep references to arrays, not copies: an array passed to or returned
by a forward must not be modified in place before that forward's backward
(docs/nn.md, "Saved arrays are references").
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional, Sequence, Tuple, Union

import numpy as np

from . import functional as F
from .module import Module, Parameter, _float_dtype

__all__ = ["Linear", "ReLU", "GELU", "Tanh", "Dropout", "LayerNorm", "Embedding",
           "BatchNorm1d", "Sequential", "Identity"]

RngLike = Union[None, int, np.random.Generator]


def _rng(rng: RngLike, what: str) -> np.random.Generator:
    if rng is None:
        return np.random.default_rng()
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    raise TypeError(f"{what}: rng must be None, an int seed or a numpy.random.Generator, "
                    f"got {type(rng).__name__}")


def _positive_int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    if v <= 0:
        raise ValueError(f"{what} must be positive, got {v}")
    return int(v)


def _float_input(x: Any, what: str, dtype: Optional[np.dtype] = None) -> np.ndarray:
    """``x`` as a floating array (cast to ``dtype`` when given)."""
    x = np.asarray(x)
    if dtype is not None:
        if x.dtype.kind not in "fiu":
            raise TypeError(f"{what}: input must be a numeric array, got dtype {x.dtype}")
        return x.astype(dtype, copy=False)
    if x.dtype.kind != "f":
        raise TypeError(f"{what}: input must be a floating array, got dtype {x.dtype}")
    return x


def _compute_dtype(dt: np.dtype) -> np.dtype:
    """Where a layer of dtype ``dt`` sums and normalises: float32 for float16 (as torch:
    float16 overflows past 65504 and stops counting past 2048), else ``dt`` itself."""
    return np.promote_types(dt, np.float32)


def _grad_like(g: Any, shape: Tuple[int, ...], dtype: np.dtype, what: str) -> np.ndarray:
    g = np.asarray(g)
    if g.shape != shape:
        raise ValueError(f"{what}.backward: grad_output has shape {g.shape}, the forward "
                         f"output had shape {shape}")
    return g.astype(dtype, copy=False)


class Identity(Module):
    """Returns its input unchanged (a placeholder in ``Sequential``)."""

    def forward(self, x: Any) -> Any:
        self._save(None)
        return x

    def backward(self, grad_output: Any) -> Any:
        self._pop()
        return grad_output


class Linear(Module):
    """``y = x @ weight.T + bias`` over the last axis.

    Initialised like torch: weight and bias uniform in ±1/sqrt(in_features).

    Args:
        in_features, out_features: sizes of the last axis of input and output.
        bias: add a learnable bias.
        dtype: float32 (default), float64 or float16.
        rng: int seed or ``numpy.random.Generator`` for the initialisation.
    Raises:
        TypeError/ValueError: non-positive sizes, unsupported dtype, bad rng.

    Example::

        fc = Linear(784, 128, rng=0)
        y = fc(np.zeros((32, 784), np.float32))      # (32, 128)
        gx = fc.backward(np.ones_like(y))            # fc.weight.grad filled
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: Any = np.float32, rng: RngLike = None) -> None:
        super().__init__()
        self.in_features = _positive_int(in_features, "Linear: in_features")
        self.out_features = _positive_int(out_features, "Linear: out_features")
        d = _float_dtype(dtype, "Linear")
        g = _rng(rng, "Linear")
        bound = 1.0 / math.sqrt(self.in_features)
        self.weight = Parameter(g.uniform(-bound, bound, (self.out_features, self.in_features))
                                .astype(d))
        if bias:
            self.bias = Parameter(g.uniform(-bound, bound, self.out_features).astype(d))
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")

    def forward(self, x: Any) -> np.ndarray:
        w = self.weight.data
        x = _float_input(x, "Linear", w.dtype)
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"Linear: input's last axis must have {self.in_features} "
                             f"features, got shape {x.shape}")
        y = np.matmul(x, w.T)
        if self.bias is not None:
            y += self.bias.data
        self._save(x, (self.weight, self.bias))
        return y

    def backward(self, grad_output: Any) -> np.ndarray:
        x = self._pop()
        w = self.weight.data
        g = _grad_like(grad_output, x.shape[:-1] + (self.out_features,), w.dtype, "Linear")
        g2 = g.reshape(-1, self.out_features)
        if self.weight.requires_grad:
            self.weight.accumulate_grad(g2.T @ x.reshape(-1, self.in_features))
        if self.bias is not None and self.bias.requires_grad:
            self.bias.accumulate_grad(g2.sum(axis=0, dtype=_compute_dtype(g2.dtype)))
        return g @ w


class ReLU(Module):
    """max(x, 0) element-wise; NaN stays NaN (and passes its gradient), as in torch."""

    def forward(self, x: Any) -> np.ndarray:
        x = _float_input(x, "ReLU")
        # A NaN that came out as 0 would hide a diverged layer upstream.
        mask = ~(x <= 0)
        self._save(mask)
        return np.maximum(x, x.dtype.type(0))

    def backward(self, grad_output: Any) -> np.ndarray:
        mask = self._pop()
        g = np.asarray(grad_output)
        if g.shape != mask.shape:
            raise ValueError(f"ReLU.backward: grad_output has shape {g.shape}, the forward "
                             f"output had shape {mask.shape}")
        return np.where(mask, g, g.dtype.type(0))


class GELU(Module):
    """GELU with the tanh approximation (torch's ``GELU(approximate="tanh")``).

    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, within 1e-3 of the
    exact erf form.
    """

    def extra_repr(self) -> str:
        return "approximate='tanh'"

    def forward(self, x: Any) -> np.ndarray:
        x = _float_input(x, "GELU")
        if x.dtype == np.float16:
            # Computed in float32; backward recomputes t from x in float32.
            self._save((x, None))
            return F.gelu(x)
        t = F._gelu_tanh(x)
        self._save((x, t))
        return 0.5 * x * (1.0 + t)

    def backward(self, grad_output: Any) -> np.ndarray:
        x, t = self._pop()
        g = _grad_like(grad_output, x.shape, x.dtype, "GELU")
        return g * F.gelu_grad(x, t)


class Tanh(Module):
    """tanh element-wise."""

    def forward(self, x: Any) -> np.ndarray:
        y = np.tanh(_float_input(x, "Tanh"))
        self._save(y)
        return y

    def backward(self, grad_output: Any) -> np.ndarray:
        y = self._pop()
        g = _grad_like(grad_output, y.shape, y.dtype, "Tanh")
        return g * (1.0 - y * y)


class Dropout(Module):
    """Inverted dropout: in training, zero each element with probability ``p`` and scale
    the rest by 1/(1-p); identity in evaluation mode.

    Args:
        p: drop probability in [0, 1].
        rng: int seed or ``numpy.random.Generator`` for the masks.
    """

    def __init__(self, p: float = 0.5, *, rng: RngLike = None) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float, np.floating)):
            raise TypeError(f"Dropout: p must be a float, got {type(p).__name__}")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1], got {p}")
        self.p = float(p)
        self._gen = _rng(rng, "Dropout")

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def forward(self, x: Any) -> np.ndarray:
        x = _float_input(x, "Dropout")
        if not self.training or self.p == 0.0:
            self._save((None, x.shape))
            return x
        if self.p == 1.0:
            mask = np.zeros(x.shape, x.dtype)
        else:
            keep = self._gen.random(x.shape) >= self.p
            mask = keep.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - self.p))
        self._save((mask, x.shape))
        return x * mask

    def backward(self, grad_output: Any) -> np.ndarray:
        mask, shape = self._pop()
        g = np.asarray(grad_output)
        if g.shape != shape:
            raise ValueError(f"Dropout.backward: grad_output has shape {g.shape}, the forward "
                             f"output had shape {shape}")
        return g if mask is None else g * mask


class LayerNorm(Module):
    """Normalise over the trailing ``normalized_shape`` axes, then scale and shift.

    Args:
        normalized_shape: int or tuple: the trailing axes normalised together.
        eps: added to the variance.
        elementwise_affine: learn ``weight`` (ones) and ``bias`` (zeros).
        dtype: parameter dtype.
    """

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: float = 1e-5,
                 elementwise_affine: bool = True, *, dtype: Any = np.float32) -> None:
        super().__init__()
        if isinstance(normalized_shape, (int, np.integer)):
            normalized_shape = (normalized_shape,)
        shape = tuple(_positive_int(s, "LayerNorm: normalized_shape") for s in normalized_shape)
        if not shape:
            raise ValueError("LayerNorm: normalized_shape must not be empty")
        if not eps > 0:
            raise ValueError(f"LayerNorm: eps must be positive, got {eps}")
        self.normalized_shape = shape
        self.eps = float(eps)
        self._dtype = _float_dtype(dtype, "LayerNorm")
        if elementwise_affine:
            self.weight = Parameter(np.ones(shape, self._dtype))
            self.bias = Parameter(np.zeros(shape, self._dtype))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"

    def forward(self, x: Any) -> np.ndarray:
        dt = self.weight.data.dtype if self.weight is not None else self._dtype
        x = _float_input(x, "LayerNorm", dt)
        k = len(self.normalized_shape)
        if x.shape[x.ndim - k:] != self.normalized_shape or x.ndim < k:
            raise ValueError(f"LayerNorm: input's trailing axes must be "
                             f"{self.normalized_shape}, got shape {x.shape}")
        axes = tuple(range(x.ndim - k, x.ndim))
        xw = x.astype(_compute_dtype(dt), copy=False)  # a copy for float16 only
        mu = xw.mean(axis=axes, keepdims=True)
        xc = xw - mu
        var = np.mean(xc * xc, axis=axes, keepdims=True)
        rstd = 1.0 / np.sqrt(var + self.eps)
        xhat = xc * rstd
        # Kept in the layer's dtype, rstd in the compute dtype (one value a row).
        y = xhat_s = xhat.astype(dt, copy=False)
        if self.weight is not None:
            y = (xhat * self.weight.data + self.bias.data).astype(dt, copy=False)
        self._save((xhat_s, rstd, axes), (self.weight, self.bias))
        return y

    def backward(self, grad_output: Any) -> np.ndarray:
        xhat_s, rstd, axes = self._pop()
        ct = _compute_dtype(xhat_s.dtype)
        g = _grad_like(grad_output, xhat_s.shape, ct, "LayerNorm")
        xhat = xhat_s.astype(ct, copy=False)
        lead = tuple(range(xhat.ndim - len(axes)))
        if self.weight is not None:
            if self.weight.requires_grad:
                self.weight.accumulate_grad(np.sum(g * xhat, axis=lead))
            if self.bias.requires_grad:
                self.bias.accumulate_grad(np.sum(g, axis=lead))
            gxhat = g * self.weight.data
        else:
            gxhat = g
        # d xhat/dx applied to gxhat: rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat))
        m1 = gxhat.mean(axis=axes, keepdims=True)
        m2 = np.mean(gxhat * xhat, axis=axes, keepdims=True)
        return (rstd * (gxhat - m1 - xhat * m2)).astype(xhat_s.dtype, copy=False)


class Embedding(Module):
    """Lookup table: integer indices of any shape -> vectors of ``embedding_dim``.

    Initialised N(0, 1) like torch.  Backward scatters the output gradient into
    the rows that were looked up (repeated indices add up) and returns None
    (indices have no gradient).

    Args:
        num_embeddings: table size.
        embedding_dim: vector size.
        padding_idx: a row that stays zero and receives no gradient.
        dtype, rng: parameter dtype and initialisation randomness.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 *, dtype: Any = np.float32, rng: RngLike = None) -> None:
        super().__init__()
        self.num_embeddings = _positive_int(num_embeddings, "Embedding: num_embeddings")
        self.embedding_dim = _positive_int(embedding_dim, "Embedding: embedding_dim")
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, (int, np.integer)):
                raise TypeError("Embedding: padding_idx must be an int or None")
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"Embedding: padding_idx {padding_idx} out of range for "
                                 f"{self.num_embeddings} embeddings")
            padding_idx = int(padding_idx) % self.num_embeddings
        self.padding_idx = padding_idx
        d = _float_dtype(dtype, "Embedding")
        w = _rng(rng, "Embedding").standard_normal((self.num_embeddings, self.embedding_dim))
        w = w.astype(d)
        if padding_idx is not None:
            w[padding_idx] = 0
        self.weight = Parameter(w)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"

    def forward(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"Embedding: indices must be an integer array, got dtype {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_embeddings):
            raise IndexError(f"Embedding: indices must be in [0, {self.num_embeddings}), got "
                             f"values in [{idx.min()}, {idx.max()}]")
        self._save(idx, (self.weight,))
        return self.weight.data[idx]

    def backward(self, grad_output: Any) -> None:
        idx = self._pop()
        g = _grad_like(grad_output, idx.shape + (self.embedding_dim,), self.weight.dtype,
                       "Embedding")
        flat = idx.reshape(-1)
        rows = g.reshape(-1, self.embedding_dim)
        if self.padding_idx is not None:
            keep = flat != self.padding_idx
            flat, rows = flat[keep], rows[keep]
        self.weight._accumulate_rows(flat, rows)
        return None


def _update_running_stats(bn: Module, mean: np.ndarray, unbiased_var: np.ndarray) -> None:
    """``running = (1 - m) * running + m * batch`` for a batch norm, in place.

    The new values are computed before any buffer changes, so an error
    (out of memory) leaves all three buffers as they were.
    """
    count = int(bn.num_batches_tracked) + 1
    m = 1.0 / float(count) if bn.momentum is None else bn.momentum
    rm = bn.running_mean * (1.0 - m)
    rm += (m * mean).astype(rm.dtype, copy=False)
    rv = bn.running_var * (1.0 - m)
    rv += (m * unbiased_var).astype(rv.dtype, copy=False)
    # In place, so state_dict views and data-parallel copies stay bound.
    bn.running_mean[...] = rm
    bn.running_var[...] = rv
    bn.num_batches_tracked[...] = count


class BatchNorm1d(Module):
    """Batch normalisation over (N, C) or (N, C, L) inputs, per channel C.

    Training: normalise with the batch mean and biased variance; update the
    running statistics with the *unbiased* variance:
    ``running = (1 - momentum) * running + momentum * batch`` (``momentum=None``:
    cumulative average).  Evaluation: normalise with the running statistics.
    Buffers ``running_mean``, ``running_var`` and ``num_batches_tracked`` are
    updated in place.  All as in torch.

    Args:
        num_features: C.
        eps: added to the variance.
        momentum: running-average factor, or None for a cumulative average.
        affine: learn ``weight`` (ones) and ``bias`` (zeros).
        track_running_stats: keep running statistics (else batch stats always).
        dtype: parameter and buffer dtype.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        self.num_features = _positive_int(num_features, "BatchNorm1d: num_features")
        if not eps > 0:
            raise ValueError(f"BatchNorm1d: eps must be positive, got {eps}")
        if momentum is not None and not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm1d: momentum must be in [0, 1] or None, got {momentum}")
        self.eps = float(eps)
        self.momentum = momentum
        self.affine = bool(affine)
        self.track_running_stats = bool(track_running_stats)
        d = _float_dtype(dtype, "BatchNorm1d")
        self._dtype = d
        if self.affine:
            self.weight = Parameter(np.ones(self.num_features, d))
            self.bias = Parameter(np.zeros(self.num_features, d))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if self.track_running_stats:
            self.register_buffer("running_mean", np.zeros(self.num_features, d))
            self.register_buffer("running_var", np.ones(self.num_features, d))
            self.register_buffer("num_batches_tracked", np.zeros((), np.int64))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}")

    def reset_running_stats(self) -> None:
        """Running mean 0, variance 1, batch count 0 (in place)."""
        if self.track_running_stats:
            self.running_mean[...] = 0
            self.running_var[...] = 1
            self.num_batches_tracked[...] = 0

    def forward(self, x: Any) -> np.ndarray:
        dt = self.weight.data.dtype if self.weight is not None else self._dtype
        x = _float_input(x, "BatchNorm1d", dt)
        if x.ndim not in (2, 3) or x.shape[1] != self.num_features:
            raise ValueError(f"BatchNorm1d: expected input (N, {self.num_features}) or "
                             f"(N, {self.num_features}, L), got shape {x.shape}")
        axes = (0,) if x.ndim == 2 else (0, 2)
        bshape = (1, self.num_features) + ((1,) if x.ndim == 3 else ())
        use_batch = self.training or not self.track_running_stats
        ct = _compute_dtype(dt)
        xw = x.astype(ct, copy=False)  # a copy for float16 only
        if use_batch:
            n = x.size // self.num_features
            if n <= 1:
                raise ValueError(f"BatchNorm1d: training needs more than one value per "
                                 f"channel, got input shape {x.shape}")
            mean = xw.mean(axis=axes)
            xc = xw - mean.reshape(bshape)
            var = np.mean(xc * xc, axis=axes)
        else:
            mean, var = self.running_mean, self.running_var
            xc = xw - mean.reshape(bshape)
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
            _update_running_stats(self, mean, var * (n / (n - 1)))
        self._save((xhat_s, rstd, axes, bshape, use_batch), (self.weight, self.bias))
        return y

    def backward(self, grad_output: Any) -> np.ndarray:
        xhat_s, rstd, axes, bshape, use_batch = self._pop()
        ct = _compute_dtype(xhat_s.dtype)
        g = _grad_like(grad_output, xhat_s.shape, ct, "BatchNorm1d")
        xhat = xhat_s.astype(ct, copy=False)
        if self.weight is not None:
            if self.weight.requires_grad:
                self.weight.accumulate_grad(np.sum(g * xhat, axis=axes))
            if self.bias.requires_grad:
                self.bias.accumulate_grad(np.sum(g, axis=axes))
            gxhat = g * self.weight.data.reshape(bshape)
        else:
            gxhat = g
        if not use_batch:  # running stats are constants
            return (gxhat * rstd).astype(xhat_s.dtype, copy=False)
        m1 = gxhat.mean(axis=axes, keepdims=True)
        m2 = np.mean(gxhat * xhat, axis=axes, keepdims=True)
        return (rstd * (gxhat - m1 - xhat * m2)).astype(xhat_s.dtype, copy=False)


class Sequential(Module):
    """Chain of modules: forward in order, backward in reverse.  Children are named
    "0", "1", ...; supports ``len``, iteration, indexing and slicing.

    Example::

        model = Sequential(Linear(64, 128), ReLU(), Linear(128, 10))
        logits = model(x)
        model.backward(grad_logits)
        model[0].weight.grad
    """

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise TypeError(f"Sequential: argument {i} is a {type(m).__name__}, not a Module")
            self.add_module(str(i), m)

    def append(self, module: Module) -> "Sequential":
        """Add ``module`` at the end; returns self."""
        if not isinstance(module, Module):
            raise TypeError(f"Sequential.append: expected a Module, got {type(module).__name__}")
        self.add_module(str(len(self)), module)
        return self

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._modules.values()))

    def __getitem__(self, i: Union[int, slice]) -> Any:
        mods = list(self._modules.values())
        if isinstance(i, slice):
            return Sequential(*mods[i])
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"Sequential indices must be ints or slices, got {type(i).__name__}")
        if not -len(mods) <= i < len(mods):
            raise IndexError(f"Sequential index {i} out of range for {len(mods)} modules")
        return mods[i]

    def forward(self, x: Any) -> Any:
        for m in self._modules.values():
            x = m(x)
        return x

    def backward(self, grad_output: Any) -> Any:
        g = grad_output
        for m in reversed(list(self._modules.values())):
            g = m.backward(g)
        return g
