"""Tensor parallelism (Megatron-LM style): layers whose weights are split over a group.

A transformer MLP ``Linear(h, 4h) -> GELU -> Linear(4h, h)`` becomes
``ColumnParallelLinear -> GELU -> RowParallelLinear`` over a tensor-parallel
(TP) group of t ranks:

* ``ColumnParallelLinear`` splits the weight's *output* dimension: each rank
  computes its slice of the output features from the whole input.  Forward
  needs no communication (the input is replicated); backward all-reduces the
  input gradient, because each rank's slice contributes part of it.
* ``RowParallelLinear`` splits the *input* dimension: each rank multiplies its
  slice of the features (exactly what the column layer left it) and the
  partial outputs are all-reduced in forward; the bias is added once, after
  the reduction.  Backward needs no communication.

So the pair costs one all-reduce in forward and one in backward.

Sequence parallelism (``sequence_parallel=True``) removes the replicated
activations between TP regions: LayerNorm and dropout run on *sequence
shards* (each rank holds its piece of the sequence dimension), the column
layer all-gathers the sequence in forward (reduce-scatters its input
gradient in backward) and the row layer reduce-scatters its output along the
sequence in forward (all-gathers the gradient in backward).  The same bytes
move as with the two all-reduces, but activations outside the TP region are
t times smaller.  Parameters used on sequence shards (LayerNorm weights, the
row layer's bias) then see only part of the sequence: they carry
``param.sequence_parallel = True`` and their gradients must be all-reduced
over the TP group after backward (``ringlet.parallel.finalize_model_grads``
does it; ``mark_sequence_parallel`` tags a LayerNorm).

Splits follow ``numpy.array_split`` (the first ``n % t`` ranks get one more
row), for weights, vocabularies and sequences alike; a rank's piece is
selected by its rank in the TP group.  The default sequence dimension is 1,
the ``(batch, sequence, hidden)`` layout that ``ringlet.nn`` and the pipeline
runtime use; pass ``sequence_dim=0`` for Megatron's ``[s, b, h]``.

Initialisation equals slicing the unsplit layer: given the same ``rng`` seed
on every rank, ``ColumnParallelLinear(..., rng=s)`` holds exactly its rows of
``Linear(..., rng=s)``; ``from_full(layer, group)`` slices an existing layer.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

import ringlet

from . import dtensor as _dt
from .._dtypes import ReduceOp
from ..nn.layers import Embedding, Linear, _float_input, _grad_like, _positive_int
from ..nn.module import Module, Parameter

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "SequenceParallelScatter", "SequenceParallelGather",
           "scatter_to_sequence_parallel", "gather_from_sequence_parallel",
           "mark_sequence_parallel"]


def _tp_group(group: Any, what: str) -> Tuple[Any, int, int]:
    """(group, rank, size), with ``group`` resolved to a ProcessGroup."""
    if group is None:
        from .mesh import _group_or_world

        group = _group_or_world(None)
    if not isinstance(group, ringlet.ProcessGroup):
        raise TypeError(f"{what}: group must be a ringlet.ProcessGroup or None, got "
                        f"{type(group).__name__}")
    if group.rank < 0:
        raise ValueError(f"{what}: this rank is not a member of the tensor-parallel group "
                         f"{group.ranks}")
    return group, group.rank, group.size


def _segment(length: int, size: int, rank: int) -> Tuple[int, int, List[int]]:
    sizes = _dt.shard_sizes(length, size)
    start = sum(sizes[:rank])
    return start, start + sizes[rank], sizes


def _seq_dim(dim: Any, what: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 0:
        raise ValueError(f"{what}: sequence_dim must be a non-negative int, got {dim!r}")
    return int(dim)


def _check_seq_input(x: np.ndarray, seq_dim: int, what: str) -> None:
    if x.ndim < seq_dim + 2:
        raise ValueError(f"{what}: with sequence_dim={seq_dim} the input needs at least "
                         f"{seq_dim + 2} dimensions (sequence and features), got shape {x.shape}")


def _order(size: int) -> List[int]:
    return list(range(size))


def _rows(a: np.ndarray, width: int) -> np.ndarray:
    """``a`` as a (rows, width) matrix.  The row count is explicit: a rank whose array_split
    slice is empty has width 0, and numpy refuses ``reshape(-1, 0)``."""
    return a.reshape(int(np.prod(a.shape[:-1], dtype=np.int64)), width)


def _gather_seq(group: Any, x: np.ndarray, seq_dim: int, what: str) -> Tuple[np.ndarray, List[int]]:
    """All-gather sequence shards of any (array_split) sizes; returns (whole, sizes).

    The shard sizes are exchanged first (one 8-byte all-gather), so the
    sequence length need not divide the group size.
    """
    n = group.size
    got = np.zeros(n, np.int64)
    group.all_gather(got, np.array([x.shape[seq_dim]], np.int64))
    sizes = [int(s) for s in got]
    if sizes != _dt.shard_sizes(sum(sizes), n):
        raise ValueError(f"{what}: sequence shards have sizes {sizes} across the group; they "
                         f"must follow numpy.array_split ({_dt.shard_sizes(sum(sizes), n)})")
    return _dt.gather_axis(group, _order(n), x, seq_dim, sizes), sizes


def mark_sequence_parallel(module: Module) -> Module:
    """Tag every parameter of ``module`` with ``sequence_parallel = True``; returns it.

    Use it on LayerNorms (and other replicated layers) that run on sequence
    shards, so ``finalize_model_grads`` all-reduces their gradients over the
    tensor-parallel group.

    Example::

        ln = mark_sequence_parallel(nn.LayerNorm(64))
    """
    if not isinstance(module, Module):
        raise TypeError(f"mark_sequence_parallel: expected a Module, got {type(module).__name__}")
    for p in module.parameters():
        p.sequence_parallel = True
    return module


def _from_linear(cls: Any, linear: Any, group: Any, kwargs: dict) -> Any:
    # The two parallel Linears' from_full: this rank's slice of a whole layer.
    if not isinstance(linear, Linear):
        raise TypeError(f"from_full: expected a ringlet.nn.Linear, got "
                        f"{type(linear).__name__}")
    return cls(linear.in_features, linear.out_features, linear.bias is not None,
               group=group, _full=linear, **kwargs)


class ColumnParallelLinear(Module):
    """``Linear(in_features, out_features)`` with the output features split over ``group``.

    This rank holds rows ``[start, stop)`` of the full ``(out, in)`` weight
    (array_split over the group) and the matching bias slice.

    Forward: ``y_local = x @ W_local.T + b_local`` (output features of this
    rank); with ``gather_output`` the slices are all-gathered into the full
    output.  Backward: the input gradient is all-reduced over the group (or,
    with ``sequence_parallel``, reduce-scattered along the sequence).

    Args:
        in_features, out_features: sizes of the unsplit layer.
        bias: learn a bias.
        group: the tensor-parallel ``ProcessGroup`` (default: the world).
        gather_output: return the full output on every rank instead of the local slice.
        sequence_parallel: the input is this rank's sequence shard; it is
            all-gathered along ``sequence_dim`` first (the shard sizes are
            exchanged in one small all-gather, so any sequence length works).
        sequence_dim: axis of the sequence (default 1: ``(batch, seq, hidden)``).
        dtype, rng: as ``Linear``; the same seed on every rank gives the
            slices of ``Linear(in, out, rng=seed)``.
    Attributes:
        output_start, output_stop: this rank's slice of the output features.
    Raises:
        TypeError / ValueError: bad sizes, dtype, group or input.

    Example::

        fc1 = ColumnParallelLinear(64, 256, group=tp, rng=0)
        fc2 = RowParallelLinear(256, 64, group=tp, rng=1)
        y = fc2(gelu(fc1(x)))          # equals Linear(256, 64, rng=1)(gelu(Linear(64, 256, rng=0)(x)))
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: Any = None, gather_output: bool = False, sequence_parallel: bool = False,
                 sequence_dim: int = 1, dtype: Any = np.float32, rng: Any = None,
                 _full: Optional[Linear] = None) -> None:
        super().__init__()
        self.group, self.tp_rank, self.tp_size = _tp_group(group, "ColumnParallelLinear")
        self.in_features = _positive_int(in_features, "ColumnParallelLinear: in_features")
        self.out_features = _positive_int(out_features, "ColumnParallelLinear: out_features")
        self.gather_output = bool(gather_output)
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim = _seq_dim(sequence_dim, "ColumnParallelLinear")
        full = _full if _full is not None else Linear(self.in_features, self.out_features,
                                                      bias, dtype=dtype, rng=rng)
        self.output_start, self.output_stop, self._out_sizes = _segment(
            self.out_features, self.tp_size, self.tp_rank)
        sl = slice(self.output_start, self.output_stop)
        self.weight = Parameter(np.array(full.weight.data[sl], copy=True, order="C"))
        if full.bias is not None:
            self.bias = Parameter(np.array(full.bias.data[sl], copy=True, order="C"))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_full(cls, linear: Linear, group: Any = None, **kwargs: Any) -> "ColumnParallelLinear":
        """This rank's column slice of an existing ``Linear`` (its weights are copied).

        ``kwargs``: ``gather_output``, ``sequence_parallel``, ``sequence_dim``.
        """
        return _from_linear(cls, linear, group, kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"[{self.output_start}:{self.output_stop}], bias={self.bias is not None}, "
                f"tp={self.tp_size}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")

    def forward(self, x: Any) -> np.ndarray:
        w = self.weight.data
        x = _float_input(x, "ColumnParallelLinear", w.dtype)
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"ColumnParallelLinear: input's last axis must have "
                             f"{self.in_features} features, got shape {x.shape}")
        seq_sizes = None
        if self.sequence_parallel and self.tp_size > 1:
            _check_seq_input(x, self.sequence_dim, "ColumnParallelLinear")
            x, seq_sizes = _gather_seq(self.group, x, self.sequence_dim, "ColumnParallelLinear")
        y = np.matmul(x, w.T)
        if self.bias is not None:
            y += self.bias.data
        if self.gather_output and self.tp_size > 1:
            y = _dt.gather_axis(self.group, _order(self.tp_size), y, y.ndim - 1,
                                self._out_sizes)
        self._save((x, seq_sizes), (self.weight, self.bias))
        return y

    def backward(self, grad_output: Any) -> np.ndarray:
        x, seq_sizes = self._pop()
        w = self.weight.data
        out_full = self.out_features if self.gather_output else w.shape[0]
        g = _grad_like(grad_output, x.shape[:-1] + (out_full,), w.dtype, "ColumnParallelLinear")
        if self.gather_output and self.tp_size > 1:
            # Every rank received the same full gradient; keep this rank's columns.
            g = np.ascontiguousarray(g[..., self.output_start:self.output_stop])
        g2 = _rows(g, w.shape[0])
        if self.weight.requires_grad:
            self.weight.accumulate_grad(g2.T @ _rows(x, self.in_features))
        if self.bias is not None and self.bias.requires_grad:
            self.bias.accumulate_grad(g2.sum(axis=0))
        gx = np.ascontiguousarray(g @ w)  # this rank's part of the input gradient
        if self.tp_size == 1:
            return gx
        if seq_sizes is not None:
            return _dt.reduce_scatter_axis(self.group, _order(self.tp_size), gx,
                                           self.sequence_dim, seq_sizes, self.tp_rank)
        self.group.all_reduce(gx)
        return gx


class RowParallelLinear(Module):
    """``Linear(in_features, out_features)`` with the input features split over ``group``.

    This rank holds columns ``[start, stop)`` of the full ``(out, in)`` weight;
    the bias is whole on every rank and added once, after the reduction.

    Forward: ``partial = x_local @ W_local.T`` is all-reduced over the group
    (or, with ``sequence_parallel``, reduce-scattered along the sequence), then
    the bias is added.  Backward: no communication, except an all-gather of
    the gradient along the sequence with ``sequence_parallel`` and of the
    input gradient's features when ``input_is_parallel`` is False.

    Args:
        in_features, out_features: sizes of the unsplit layer.
        bias: learn a bias.  With ``sequence_parallel`` it gets
            ``bias.sequence_parallel = True`` (its gradient covers only this
            rank's sequence shard; ``finalize_model_grads`` sums it over the group).
        group: the tensor-parallel ``ProcessGroup`` (default: the world).
        input_is_parallel: the input is already this rank's feature slice
            (the output of a ``ColumnParallelLinear``).  False: the input is
            whole and each rank takes its slice.
        sequence_parallel: reduce-scatter the output along ``sequence_dim``.
        sequence_dim: axis of the sequence (default 1).
        dtype, rng: as ``Linear`` (same seed on every rank).
    Attributes:
        input_start, input_stop: this rank's slice of the input features.
    Raises:
        TypeError / ValueError: bad sizes, dtype, group or input.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: Any = None, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, sequence_dim: int = 1,
                 dtype: Any = np.float32, rng: Any = None, _full: Optional[Linear] = None) -> None:
        super().__init__()
        self.group, self.tp_rank, self.tp_size = _tp_group(group, "RowParallelLinear")
        self.in_features = _positive_int(in_features, "RowParallelLinear: in_features")
        self.out_features = _positive_int(out_features, "RowParallelLinear: out_features")
        self.input_is_parallel = bool(input_is_parallel)
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim = _seq_dim(sequence_dim, "RowParallelLinear")
        full = _full if _full is not None else Linear(self.in_features, self.out_features,
                                                      bias, dtype=dtype, rng=rng)
        self.input_start, self.input_stop, self._in_sizes = _segment(
            self.in_features, self.tp_size, self.tp_rank)
        self.weight = Parameter(np.array(full.weight.data[:, self.input_start:self.input_stop],
                                         copy=True, order="C"))
        if full.bias is not None:
            self.bias = Parameter(np.array(full.bias.data, copy=True, order="C"))
            if self.sequence_parallel:
                self.bias.sequence_parallel = True
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_full(cls, linear: Linear, group: Any = None, **kwargs: Any) -> "RowParallelLinear":
        """This rank's row slice of an existing ``Linear`` (its weights are copied).

        ``kwargs``: ``input_is_parallel``, ``sequence_parallel``, ``sequence_dim``.
        """
        return _from_linear(cls, linear, group, kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} [{self.input_start}:{self.input_stop}], "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp={self.tp_size}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")

    def forward(self, x: Any) -> np.ndarray:
        w = self.weight.data
        x = _float_input(x, "RowParallelLinear", w.dtype)
        want = w.shape[1] if self.input_is_parallel else self.in_features
        if x.ndim < 1 or x.shape[-1] != want:
            which = "this rank's slice" if self.input_is_parallel else "all"
            raise ValueError(f"RowParallelLinear: input's last axis must have {want} features "
                             f"({which} of {self.in_features}), got shape {x.shape}")
        if not self.input_is_parallel:
            x = np.ascontiguousarray(x[..., self.input_start:self.input_stop])
        y = np.ascontiguousarray(np.matmul(x, w.T))
        seq_sizes = None
        if self.tp_size > 1:
            if self.sequence_parallel:
                _check_seq_input(y, self.sequence_dim, "RowParallelLinear")
                seq_sizes = _dt.shard_sizes(y.shape[self.sequence_dim], self.tp_size)
                y = _dt.reduce_scatter_axis(self.group, _order(self.tp_size), y,
                                            self.sequence_dim, seq_sizes, self.tp_rank)
            else:
                self.group.all_reduce(y)
        if self.bias is not None:
            y += self.bias.data
        self._save((x, seq_sizes, y.shape), (self.weight, self.bias))
        return y

    def backward(self, grad_output: Any) -> np.ndarray:
        x, seq_sizes, out_shape = self._pop()
        w = self.weight.data
        g = _grad_like(grad_output, out_shape, w.dtype, "RowParallelLinear")
        if self.bias is not None and self.bias.requires_grad:
            # Bias added after the reduction: with sequence parallelism this is
            # only this shard's sum (param.sequence_parallel marks it for finalize).
            self.bias.accumulate_grad(g.reshape(-1, self.out_features).sum(axis=0))
        if seq_sizes is not None:
            g = _dt.gather_axis(self.group, _order(self.tp_size), np.ascontiguousarray(g),
                                self.sequence_dim, seq_sizes)
        g2 = g.reshape(-1, self.out_features)
        if self.weight.requires_grad:
            self.weight.accumulate_grad(g2.T @ _rows(x, w.shape[1]))
        gx = np.ascontiguousarray(g @ w)
        if not self.input_is_parallel and self.tp_size > 1:
            gx = _dt.gather_axis(self.group, _order(self.tp_size), gx, gx.ndim - 1,
                                 self._in_sizes)
        return gx


class VocabParallelEmbedding(Module):
    """``Embedding(num_embeddings, embedding_dim)`` with the vocabulary split over ``group``.

    This rank holds rows ``[vocab_start, vocab_stop)`` (array_split).  Forward
    looks up the indices in its range, writes zeros for the others and
    all-reduces, so every rank gets the full embedding (with
    ``sequence_parallel``: reduce-scatters along the sequence instead, so each
    rank gets its sequence shard).  Backward scatters the gradient into the
    local rows only (all-gathering it along the sequence first with
    ``sequence_parallel``); it returns None like ``Embedding``.

    Args:
        num_embeddings, embedding_dim: sizes of the unsplit table.
        group: the tensor-parallel ``ProcessGroup`` (default: the world).
        padding_idx: a row that stays zero and gets no gradient (global index).
        sequence_parallel, sequence_dim: as the linear layers; ``sequence_dim``
            indexes the *indices* array (default 1: ``(batch, seq)``).
        dtype, rng: as ``Embedding`` (same seed on every rank gives the rows of
            ``Embedding(num, dim, rng=seed)``).
    Raises:
        TypeError / ValueError / IndexError: as ``Embedding``.

    Example::

        emb = VocabParallelEmbedding(50000, 512, group=tp, rng=0)
        h = emb(tokens)                     # (batch, seq, 512) on every TP rank
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: Optional[int] = None, *, group: Any = None,
                 sequence_parallel: bool = False, sequence_dim: int = 1,
                 dtype: Any = np.float32, rng: Any = None,
                 _full: Optional[Embedding] = None) -> None:
        super().__init__()
        self.group, self.tp_rank, self.tp_size = _tp_group(group, "VocabParallelEmbedding")
        full = _full if _full is not None else Embedding(num_embeddings, embedding_dim,
                                                         padding_idx, dtype=dtype, rng=rng)
        self.num_embeddings = full.num_embeddings
        self.embedding_dim = full.embedding_dim
        self.padding_idx = full.padding_idx
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim = _seq_dim(sequence_dim, "VocabParallelEmbedding")
        self.vocab_start, self.vocab_stop, _ = _segment(self.num_embeddings, self.tp_size,
                                                        self.tp_rank)
        self.weight = Parameter(np.array(full.weight.data[self.vocab_start:self.vocab_stop],
                                         copy=True, order="C"))

    @classmethod
    def from_full(cls, embedding: Embedding, group: Any = None,
                  **kwargs: Any) -> "VocabParallelEmbedding":
        """This rank's rows of an existing ``Embedding`` (copied)."""
        if not isinstance(embedding, Embedding):
            raise TypeError(f"from_full: expected a ringlet.nn.Embedding, got "
                            f"{type(embedding).__name__}")
        return cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
                   group=group, _full=embedding, **kwargs)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} [{self.vocab_start}:{self.vocab_stop}], "
                f"{self.embedding_dim}, tp={self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}")

    def forward(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"VocabParallelEmbedding: indices must be an integer array, got "
                            f"dtype {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_embeddings):
            raise IndexError(f"VocabParallelEmbedding: indices must be in "
                             f"[0, {self.num_embeddings}), got values in "
                             f"[{idx.min()}, {idx.max()}]")
        mine = (idx >= self.vocab_start) & (idx < self.vocab_stop)
        local = np.where(mine, idx - self.vocab_start, 0)
        w = self.weight.data
        if w.shape[0]:
            out = w[local]
        else:  # more ranks than vocabulary rows: this rank owns none
            out = np.zeros(idx.shape + (self.embedding_dim,), w.dtype)
        out[~mine] = 0
        out = np.ascontiguousarray(out)
        seq_sizes = None
        if self.tp_size > 1:
            if self.sequence_parallel:
                _check_seq_input(out, self.sequence_dim, "VocabParallelEmbedding")
                seq_sizes = _dt.shard_sizes(out.shape[self.sequence_dim], self.tp_size)
                out = _dt.reduce_scatter_axis(self.group, _order(self.tp_size), out,
                                              self.sequence_dim, seq_sizes, self.tp_rank)
            else:
                self.group.all_reduce(out)
        self._save((local, mine, seq_sizes, out.shape), (self.weight,))
        return out

    def backward(self, grad_output: Any) -> None:
        local, mine, seq_sizes, out_shape = self._pop()
        g = _grad_like(grad_output, out_shape, self.weight.dtype, "VocabParallelEmbedding")
        if seq_sizes is not None:
            g = _dt.gather_axis(self.group, _order(self.tp_size), np.ascontiguousarray(g),
                                self.sequence_dim, seq_sizes)
        keep = mine.reshape(-1)
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_stop:
            keep = keep & (local.reshape(-1) != self.padding_idx - self.vocab_start)
        rows = g.reshape(-1, self.embedding_dim)[keep]
        self.weight._accumulate_rows(local.reshape(-1)[keep], rows)
        return None


def vocab_parallel_cross_entropy(logits: Any, targets: Any, vocab_size: int, *,
                                 group: Any = None, reduction: str = "mean",
                                 ignore_index: Optional[int] = None) -> Tuple[float, np.ndarray]:
    """Softmax cross-entropy over logits whose class axis is split over ``group``.

    Each rank holds the logits of its vocabulary slice (array_split of
    ``vocab_size``, by group rank), e.g. the output of a
    ``ColumnParallelLinear`` without ``gather_output``.  Two all-reduces (the
    row maxima, then the sum of exponentials packed with the target logits)
    give every rank the loss; the full logits are never gathered.

    Args:
        logits: floating array (..., V_local) of this rank's vocabulary slice.
        targets: integer labels (...) in [0, vocab_size), same on every rank.
        vocab_size: size of the whole vocabulary.
        group: the tensor-parallel ``ProcessGroup`` (default: the world).
        reduction: "mean" over the counted targets, or "sum".
        ignore_index: label value that contributes neither loss nor gradient.
    Returns:
        (loss, d loss / d logits_local): the loss (same on every rank) and this
        rank's slice of the gradient.
    Raises:
        TypeError / ValueError: as ``cross_entropy``; also a local width that
            is not this rank's slice of ``vocab_size``.

    Example::

        logits = head(h)                    # ColumnParallelLinear(h, vocab), local slice
        loss, g = vocab_parallel_cross_entropy(logits, y, vocab, group=tp)
        head.backward(g)
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean' or 'sum', "
                         f"got {reduction!r}")
    group, rank, size = _tp_group(group, "vocab_parallel_cross_entropy")
    vocab_size = _positive_int(vocab_size, "vocab_parallel_cross_entropy: vocab_size")
    z = np.asarray(logits)
    if z.dtype.kind != "f" and z.dtype.name != "bfloat16":  # bfloat16: ml_dtypes, kind "V"
        raise TypeError(f"vocab_parallel_cross_entropy: logits must be floating, got dtype "
                        f"{z.dtype}")
    start, stop, _ = _segment(vocab_size, size, rank)
    if z.ndim < 1 or z.shape[-1] != stop - start:
        raise ValueError(f"vocab_parallel_cross_entropy: rank {rank} of {size} owns "
                         f"vocabulary [{start}, {stop}) ({stop - start} logits) but got logits "
                         f"of shape {z.shape}")
    t = np.asarray(targets)
    if t.dtype.kind not in "iu":
        raise TypeError(f"vocab_parallel_cross_entropy: targets must be integer labels, got "
                        f"dtype {t.dtype}")
    if t.shape != z.shape[:-1]:
        raise ValueError(f"vocab_parallel_cross_entropy: targets shape {t.shape} must equal "
                         f"logits shape without the class axis, {z.shape[:-1]}")
    t = t.reshape(-1).astype(np.int64, copy=False)
    # float16/bfloat16 logits: max, exponentials, their sum (and its all-reduce)
    # run in float32; a float16 sum of exponentials overflows past 65504 terms.
    ct = np.float32 if z.dtype.itemsize < 4 else z.dtype
    z2 = _rows(z, stop - start).astype(ct, copy=False)
    keep = np.ones(t.shape, bool) if ignore_index is None else (t != ignore_index)
    tk = t[keep]
    if tk.size and (tk.min() < 0 or tk.max() >= vocab_size):
        raise ValueError(f"vocab_parallel_cross_entropy: labels must be in [0, {vocab_size}), "
                         f"got values in [{tk.min()}, {tk.max()}]")
    # Global row maxima for a stable softmax.
    m = np.max(z2, axis=-1, initial=-np.inf) if z2.shape[0] else np.zeros(0, z2.dtype)
    m = np.ascontiguousarray(m, dtype=z2.dtype)
    if size > 1 and m.size:
        group.all_reduce(m, ReduceOp.MAX)
    e = np.exp(z2 - m[:, None])
    mine = keep & (t >= start) & (t < stop)
    rows = np.nonzero(mine)[0]
    packed = np.zeros((2, z2.shape[0]), z2.dtype)
    packed[0] = e.sum(axis=-1)
    packed[1, rows] = z2[rows, t[rows] - start] - m[rows]   # shifted target logit
    if size > 1 and packed.size:
        group.all_reduce(packed)
    sumexp, target_shifted = packed[0], packed[1]
    kept = np.nonzero(keep)[0]
    loss = float(np.sum(np.log(sumexp[kept]) - target_shifted[kept], dtype=np.float64))
    grad = e / sumexp[:, None]
    grad[rows, t[rows] - start] -= 1
    if ignore_index is not None:
        grad[~keep] = 0
    if reduction == "mean":
        n = max(int(kept.size), 1)
        loss /= n
        grad /= n
    return loss, grad.reshape(z.shape).astype(z.dtype, copy=False)


def scatter_to_sequence_parallel(x: np.ndarray, group: Any = None, *,
                                 sequence_dim: int = 1) -> np.ndarray:
    """This rank's sequence shard (array_split by group rank) of a replicated ``x``; no communication."""
    group, rank, size = _tp_group(group, "scatter_to_sequence_parallel")
    sd = _seq_dim(sequence_dim, "scatter_to_sequence_parallel")
    x = np.asarray(x)
    _check_seq_input(x, sd, "scatter_to_sequence_parallel")
    start, stop, _ = _segment(x.shape[sd], size, rank)
    return np.ascontiguousarray(_dt._take(x, sd, start, stop))


def gather_from_sequence_parallel(x: np.ndarray, group: Any = None, *,
                                  sequence_dim: int = 1) -> np.ndarray:
    """All-gather sequence shards (any array_split sizes) into the whole sequence."""
    group, rank, size = _tp_group(group, "gather_from_sequence_parallel")
    sd = _seq_dim(sequence_dim, "gather_from_sequence_parallel")
    x = np.ascontiguousarray(x)
    _check_seq_input(x, sd, "gather_from_sequence_parallel")
    if size == 1:
        return x
    return _gather_seq(group, x, sd, "gather_from_sequence_parallel")[0]


class SequenceParallelScatter(Module):
    """Enter a sequence-parallel region: keep this rank's sequence shard.

    Forward slices (no communication); backward all-gathers the gradient
    along the sequence, since every rank's replicated input fed all shards.
    """

    def __init__(self, group: Any = None, *, sequence_dim: int = 1) -> None:
        super().__init__()
        self.group, self.tp_rank, self.tp_size = _tp_group(group, "SequenceParallelScatter")
        self.sequence_dim = _seq_dim(sequence_dim, "SequenceParallelScatter")

    def forward(self, x: Any) -> np.ndarray:
        x = _float_input(x, "SequenceParallelScatter")
        _check_seq_input(x, self.sequence_dim, "SequenceParallelScatter")
        sizes = _dt.shard_sizes(x.shape[self.sequence_dim], self.tp_size)
        start = sum(sizes[:self.tp_rank])
        self._save((sizes, x.shape))
        return np.ascontiguousarray(_dt._take(x, self.sequence_dim, start,
                                              start + sizes[self.tp_rank]))

    def backward(self, grad_output: Any) -> np.ndarray:
        sizes, shape = self._pop()
        g = np.ascontiguousarray(grad_output)
        if self.tp_size == 1:
            return g
        return _dt.gather_axis(self.group, _order(self.tp_size), g, self.sequence_dim, sizes)


class SequenceParallelGather(Module):
    """Leave a sequence-parallel region: all-gather the sequence shards.

    Backward keeps this rank's shard of the gradient.  That is right when
    every rank uses the gathered array the same way (a replicated head and
    loss).  When the consumer is itself tensor-parallel and each rank's
    gradient is a partial sum, pass ``reduce_grads=True`` to reduce-scatter
    it instead.
    """

    def __init__(self, group: Any = None, *, sequence_dim: int = 1,
                 reduce_grads: bool = False) -> None:
        super().__init__()
        self.group, self.tp_rank, self.tp_size = _tp_group(group, "SequenceParallelGather")
        self.sequence_dim = _seq_dim(sequence_dim, "SequenceParallelGather")
        self.reduce_grads = bool(reduce_grads)

    def forward(self, x: Any) -> np.ndarray:
        x = np.ascontiguousarray(_float_input(x, "SequenceParallelGather"))
        _check_seq_input(x, self.sequence_dim, "SequenceParallelGather")
        if self.tp_size == 1:
            self._save([x.shape[self.sequence_dim]])
            return x
        full, sizes = _gather_seq(self.group, x, self.sequence_dim, "SequenceParallelGather")
        self._save(sizes)
        return full

    def backward(self, grad_output: Any) -> np.ndarray:
        sizes = self._pop()
        g = np.ascontiguousarray(grad_output)
        if self.tp_size == 1:
            return g
        if self.reduce_grads:
            return _dt.reduce_scatter_axis(self.group, _order(self.tp_size), g,
                                           self.sequence_dim, sizes, self.tp_rank)
        start = sum(sizes[:self.tp_rank])
        return np.ascontiguousarray(_dt._take(g, self.sequence_dim, start,
                                              start + sizes[self.tp_rank]))
