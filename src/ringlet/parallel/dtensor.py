"""``DTensor``: one logical array spread over a ``DeviceMesh``, one placement per mesh dimension.

Placements
----------
For every mesh dimension a DTensor says how the array relates to the ranks
along that dimension:

* ``Shard(d)``: each rank holds one piece of tensor dimension ``d``.  Pieces
  follow ``numpy.array_split``: a length L over n ranks gives the first
  ``L % n`` ranks ``L // n + 1`` elements and the rest ``L // n`` (so a
  piece may be empty).  The piece at coordinate c starts at
  ``sum(sizes[:c])``.
* ``Replicate()``: every rank holds the same values.
* ``Partial(op)``: every rank holds an array of the full (piece) shape and
  the logical value is their reduction with ``op`` (SUM by default; PROD,
  MIN, MAX and AVG too).  Partial sums are what a row-parallel matmul
  leaves before its all-reduce.  Several mesh dimensions may be Partial
  with the same op, or with SUM and AVG mixed (linear, so the order of
  reduction does not matter); other mixes (SUM with MAX, MIN with MAX,
  PROD with anything else) are refused with ``ValueError``, since their
  value would depend on which mesh dimension is reduced first.

Several mesh dimensions may shard the same tensor dimension; they nest in
mesh-dimension order (mesh dimension 0 cuts the array, dimension 1 cuts
each of those pieces, ...), as in torch.

Redistribution
--------------
``redistribute(placements)`` changes placements with real collectives over
the mesh's groups, never by collecting the whole array on one rank.  One
mesh dimension changes at a time:

=========================  ==============================================
from -> to                 data movement along that mesh dimension
=========================  ==============================================
Shard(d) -> Replicate      ``all_gather`` (uneven pieces: ``all_gather_v``)
Partial -> Replicate       ``all_reduce(op)``
Partial -> Shard(d)        ``reduce_scatter(op)`` (blocks padded)
Shard(d) -> Shard(e)       ``all_to_all_v`` (exact per-pair counts)
Replicate -> Shard(d)      local slice
Replicate -> Partial(op)   local: SUM keeps the value on coordinate 0 and
                           zeros elsewhere, PROD ones elsewhere; MIN, MAX
                           and AVG keep it everywhere
Shard(d) -> Partial(op)    local: the piece in an array filled with op's
                           identity (AVG goes through Replicate)
Partial(a) -> Partial(b)   ``all_reduce(a)`` then as Replicate -> Partial(b)
=========================  ==============================================

A change on a mesh dimension whose tensor dimensions no other mesh
dimension shards is done directly as above.  When shards nest (two mesh
dimensions cut the same tensor dimension), the affected mesh dimensions are
first turned into Replicate from the innermost out (all-gathers) and then
into their targets from the outermost in (local slices), which keeps the
nesting order right.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Set, Tuple

import numpy as np

from .._dtypes import ReduceOp, dtype_code, dtype_from_code
from .mesh import DeviceMesh

__all__ = ["Placement", "Shard", "Replicate", "Partial", "DTensor", "distribute",
           "shard_sizes"]

_PARTIAL_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)
# Partial ops that may differ between mesh dimensions: both linear, so reducing the
# dimensions in either order (and filling with SUM's zeros) gives the same value.
_COMMUTING_OPS = {ReduceOp.SUM, ReduceOp.AVG}


class Placement:
    """Base class of ``Shard``, ``Replicate`` and ``Partial``."""

    def is_shard(self, dim: Optional[int] = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Shard(Placement):
    """Split tensor dimension ``dim`` across the ranks of a mesh dimension (array_split sizes)."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, (int, np.integer)):
            raise TypeError(f"Shard(dim): dim must be an int, got {type(self.dim).__name__}")
        object.__setattr__(self, "dim", int(self.dim))

    def is_shard(self, dim: Optional[int] = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank of the mesh dimension holds the same values."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """Each rank holds a partial value; the logical value is their reduction with ``op``."""

    op: ReduceOp = ReduceOp.SUM

    def __post_init__(self) -> None:
        try:
            op = ReduceOp(self.op)
        except ValueError:
            raise ValueError(f"Partial(op): unknown reduction {self.op!r}") from None
        if op not in _PARTIAL_OPS:
            raise ValueError(f"Partial(op): op must be one of SUM, AVG, PROD, MIN, MAX, got "
                             f"{op.name}")
        object.__setattr__(self, "op", op)

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Partial({self.op.name})"


def shard_sizes(length: int, n: int) -> List[int]:
    """Piece sizes of ``length`` elements over ``n`` ranks: ``numpy.array_split``'s rule.

    Example::

        shard_sizes(7, 3)   # [3, 2, 2]
    """
    q, r = divmod(int(length), int(n))
    return [q + 1] * r + [q] * (n - r)


def _offsets(sizes: Sequence[int]) -> List[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _take(x: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(start, stop)
    return x[tuple(idx)]


# ---- collectives along one line of the mesh ------------------------------------------
# ``order[c]`` is the group rank of the member at line coordinate c (mesh.line_order).

def _in_group_order(order: Sequence[int]) -> bool:
    return list(order) == list(range(len(order)))


def _flat_view(x: np.ndarray, axis: int, order: Sequence[int]) -> Optional[np.ndarray]:
    """``x`` flat, when its pieces along ``axis`` in coordinate order are also its blocks
    in group-rank order (contiguous, nothing before ``axis`` but size-1 dims, lines in
    group order); else None.  Such an ``x`` is a collective's buffer as it is."""
    if not (_in_group_order(order) and x.flags.c_contiguous
            and int(np.prod(x.shape[:axis], dtype=np.int64)) == 1):
        return None
    return x.reshape(-1)


def _block_counts(shape: Sequence[int], axis: int, sizes: Sequence[int],
                  order: Sequence[int]) -> List[int]:
    """Element count of each piece along ``axis`` of an array of ``shape``, in group-rank
    order (the count list of a v-collective)."""
    inner = int(np.prod([s for a, s in enumerate(shape) if a != axis], dtype=np.int64))
    counts = [0] * len(sizes)
    for c, s in enumerate(sizes):
        counts[order[c]] = s * inner
    return counts


def _pack(x: np.ndarray, axis: int, sizes: Sequence[int], order: Sequence[int]) -> np.ndarray:
    """``x``'s pieces along ``axis`` as flat blocks in group-rank order, each piece's
    elements in C order: ``x`` itself when it already is that layout, else one copy."""
    flat = _flat_view(x, axis, order)
    if flat is not None:
        return flat
    out = np.empty(x.size, x.dtype)
    for piece, block in _pieces(x, out, axis, sizes, order):
        block[...] = piece
    return out


def _unpack(flat: np.ndarray, res: np.ndarray, axis: int, sizes: Sequence[int],
            order: Sequence[int]) -> None:
    """The inverse of ``_pack``: copy blocks in group-rank order into ``res``'s pieces."""
    for piece, block in _pieces(res, flat, axis, sizes, order):
        piece[...] = block


def _pieces(arr: np.ndarray, flat: np.ndarray, axis: int, sizes: Sequence[int],
            order: Sequence[int]):
    """Each piece of ``arr`` along ``axis`` with its block of ``flat`` (group-rank order),
    shaped as the piece."""
    off = _offsets(sizes)
    counts = _block_counts(arr.shape, axis, sizes, order)
    g_off = _offsets(counts)
    for c in range(len(sizes)):
        piece = _take(arr, axis, off[c], off[c] + sizes[c])
        g = order[c]
        yield piece, flat[g_off[g]: g_off[g] + counts[g]].reshape(piece.shape)


def gather_axis(group: Any, order: Sequence[int], x: np.ndarray, axis: int,
                sizes: Sequence[int], *, timeout: Optional[float] = None) -> np.ndarray:
    """All-gather pieces of ``axis`` (array_split ``sizes``, coordinate order) into the whole.

    Each rank sends its piece as it lies in memory (C order); equal pieces
    travel with ``all_gather``, uneven ones with ``all_gather_v`` (exact
    sizes, no padding).  The collective writes straight into the result
    when the pieces are its consecutive blocks (``axis`` leads, lines in
    group order); otherwise into one staging buffer, copied once into
    place.  Used by DTensor and the tensor-parallel layers
    (sequence-parallel gathers).
    """
    res = np.empty(x.shape[:axis] + (sum(sizes),) + x.shape[axis + 1:], x.dtype)
    if res.size == 0:
        return res  # every rank computes this alike: the line moves nothing
    mine = np.ascontiguousarray(x).reshape(-1)
    out = _flat_view(res, axis, order)
    staged = out is None
    if staged:
        out = np.empty(res.size, x.dtype)
    if all(s == sizes[0] for s in sizes):
        group.all_gather(out, mine, timeout=timeout)
    else:
        group.all_gather_v(out, _block_counts(res.shape, axis, sizes, order), mine,
                           timeout=timeout)
    if staged:
        _unpack(out, res, axis, sizes, order)
    return res


def reduce_scatter_axis(group: Any, order: Sequence[int], x: np.ndarray, axis: int,
                        sizes: Sequence[int], coord: int, op: ReduceOp = ReduceOp.SUM, *,
                        timeout: Optional[float] = None) -> np.ndarray:
    """Reduce ``x`` over the line and keep this rank's piece of ``axis`` (array_split sizes).

    Each coordinate's segment is copied into an equal, zero-padded block so
    one ``reduce_scatter`` does the work; equal pieces along a contiguous
    leading axis, in group order, are reduced straight from ``x``.
    """
    n = len(sizes)
    xt = np.moveaxis(x, axis, 0)
    rest = xt.shape[1:]
    m = max(sizes)
    mine = sizes[coord]
    if m == 0 or int(np.prod(rest, dtype=np.int64)) == 0:
        return np.zeros(x.shape[:axis] + (mine,) + x.shape[axis + 1:], x.dtype)
    if (all(s == m for s in sizes) and list(order) == list(range(n))
            and xt.flags.c_contiguous):
        inp = xt  # equal pieces already in group order (axis 0): no staging copy
    else:
        inp = np.zeros((n, m) + rest, x.dtype)
        for c, off in enumerate(_offsets(sizes)):
            inp[order[c], :sizes[c]] = xt[off: off + sizes[c]]
    out = np.empty((m,) + rest, x.dtype)
    group.reduce_scatter(out, inp, op, timeout=timeout)
    return np.ascontiguousarray(np.moveaxis(out[:mine], 0, axis))


def all_to_all_axes(group: Any, order: Sequence[int], x: np.ndarray, src_axis: int,
                    dst_axis: int, src_sizes: Sequence[int], dst_sizes: Sequence[int],
                    coord: int, *, timeout: Optional[float] = None) -> np.ndarray:
    """Re-shard from ``src_axis`` to ``dst_axis`` along the line with one ``all_to_all_v``.

    ``x`` holds piece ``coord`` of ``src_axis`` and all of ``dst_axis``.  The
    block for coordinate c is ``x``'s piece c of ``dst_axis``; the block from
    coordinate c is its piece of ``src_axis`` restricted to this rank's piece
    of ``dst_axis``.  Exact counts, no padding.  The blocks are packed into
    one send buffer (none when ``x`` already is one) and the collective
    receives straight into the result when its blocks are the result's
    consecutive pieces, else into one buffer copied once into place.
    """
    shp = list(x.shape)
    shp[src_axis] = sum(src_sizes)
    shp[dst_axis] = dst_sizes[coord]
    res = np.empty(tuple(shp), x.dtype)
    inp = _pack(x, dst_axis, dst_sizes, order)
    in_counts = _block_counts(x.shape, dst_axis, dst_sizes, order)
    out_counts = _block_counts(res.shape, src_axis, src_sizes, order)
    out = _flat_view(res, src_axis, order)
    staged = out is None
    if staged:
        out = np.empty(res.size, x.dtype)
    # Skip only when the whole line moves nothing, which every rank computes
    # alike; a rank whose own piece is empty must still join the others.
    rest = int(np.prod([s for a, s in enumerate(x.shape) if a != src_axis], dtype=np.int64))
    if sum(src_sizes) * rest:
        group.all_to_all_v(out, out_counts, inp, in_counts, timeout=timeout)
    if staged:
        _unpack(out, res, src_axis, src_sizes, order)
    return res


def _identity(op: ReduceOp, dtype: np.dtype) -> Any:
    if op == ReduceOp.SUM:
        return 0
    if op == ReduceOp.PROD:
        return 1
    if dtype.kind == "f" or dtype.name == "bfloat16":  # bfloat16: ml_dtypes, kind "V"
        return -np.inf if op == ReduceOp.MAX else np.inf
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.min if op == ReduceOp.MAX else info.max
    if dtype.kind == "b":
        return op == ReduceOp.MIN
    raise TypeError(f"no identity element of {op.name} for dtype {dtype}")


def _check_placements(placements: Any, mesh: DeviceMesh, ndim: int, *,
                      strict: bool = True) -> Tuple[Placement, ...]:
    """The placements, checked, with Shard dims made non-negative.  ``strict=False``
    leaves a Shard dim outside ``ndim`` as given instead of raising (the caller
    finds it with the other ranks)."""
    if isinstance(placements, Placement):
        placements = (placements,)
    try:
        ps = tuple(placements)
    except TypeError:
        raise TypeError(f"placements must be a sequence of Shard/Replicate/Partial, got "
                        f"{type(placements).__name__}") from None
    if len(ps) != mesh.ndim:
        raise ValueError(f"placements {ps} has {len(ps)} entries but the mesh has "
                         f"{mesh.ndim} dimensions {mesh.dim_names}")
    out = []
    for p in ps:
        if not isinstance(p, Placement) or type(p) is Placement:
            raise TypeError(f"each placement must be Shard(dim), Replicate() or Partial(op), "
                            f"got {p!r}")
        if isinstance(p, Shard):
            if -ndim <= p.dim < ndim:
                p = Shard(p.dim % ndim)
            elif strict:
                raise ValueError(f"{p!r} is out of range for a {ndim}-D array")
        out.append(p)
    ops = sorted({p.op for p in out if isinstance(p, Partial)})
    if len(ops) > 1 and not set(ops) <= _COMMUTING_OPS:
        raise ValueError(f"placements {tuple(out)} mix Partial reductions "
                         f"{' and '.join(op.name for op in ops)} on different mesh dimensions: "
                         f"they do not commute, so the logical value would depend on the order "
                         f"in which the mesh dimensions are reduced.  Use one reduction for "
                         f"every Partial dimension (SUM and AVG may mix), or reduce the partial "
                         f"values along one mesh dimension first")
    return tuple(out)


def _tdims(p: Placement) -> Set[int]:
    return {p.dim} if isinstance(p, Shard) else set()


class DTensor:
    """An array distributed over a ``DeviceMesh`` (see the module docstring for placements).

    Create one with ``distribute`` (from a whole array) or ``DTensor.from_local``
    (from each rank's piece).  Every method that moves data is collective over
    the mesh: every rank of the mesh calls it with the same arguments.

    Attributes:
        mesh: the ``DeviceMesh``.
        placements: tuple with one placement per mesh dimension.
        shape: the global shape.
        dtype: the element type.

    Example::

        mesh = DeviceMesh((2,), ("tp",))
        x = distribute(np.arange(12.0).reshape(3, 4), mesh, [Shard(1)])
        x.to_local().shape                 # (3, 2)
        y = x.redistribute([Replicate()])  # all_gather
        y.to_local()                       # the whole array on every rank
    """

    def __init__(self, local: np.ndarray, mesh: DeviceMesh, placements: Sequence[Placement],
                 shape: Sequence[int], *, _checked: bool = False) -> None:
        if not _checked:
            if not isinstance(mesh, DeviceMesh):
                raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
            if not isinstance(local, np.ndarray):
                raise TypeError(f"local must be a numpy.ndarray, got {type(local).__name__}")
            shape = tuple(int(s) for s in shape)
            placements = _check_placements(placements, mesh, len(shape))
            mesh._require_member("DTensor")
            problem = _fit_problem(local, mesh, placements, shape)
            if problem is not None:
                raise ValueError(f"DTensor: {problem}")
            local = np.asarray(local, order="C")  # ascontiguousarray would make 0-d 1-d
        self._local = local
        self.mesh = mesh
        self.placements: Tuple[Placement, ...] = tuple(placements)
        self.shape: Tuple[int, ...] = tuple(shape)

    # ---- construction --------------------------------------------------------------
    @classmethod
    def from_local(cls, local: np.ndarray, mesh: DeviceMesh, placements: Sequence[Placement],
                   *, shape: Optional[Sequence[int]] = None, run_check: bool = False,
                   timeout: Optional[float] = None) -> "DTensor":
        """Wrap this rank's piece ``local`` as a DTensor (no data is copied between ranks).

        Args:
            local: this rank's piece (for Partial dimensions, its partial value).
            mesh: the mesh.
            placements: one per mesh dimension.
            shape: the global shape.  Each rank checks that its own piece is
                its ``numpy.array_split`` piece of it (uneven and empty pieces
                included); nothing is communicated, so ranks that pass
                different shapes go unnoticed unless ``run_check``.  When
                omitted it is inferred collectively: along each sharded mesh
                dimension the pieces' sizes (and a digest of their dtype and
                other sizes) are all-gathered, 24 bytes per rank; on a mesh of
                more than one dimension every rank then learns, with one
                8-byte all-reduce per mesh dimension, whether any line failed.
            run_check: also check, collectively over the whole mesh, that
                every rank has the same global shape, dtype and placements and
                that every rank's piece fits: one 24-byte all-reduce per mesh
                dimension (one all-gather of the ranks' arguments per mesh
                dimension more, on failure only, to name them).  Off by
                default: passing ``shape`` is the way to wrap without
                communicating.
            timeout: for the inference and the check.
        Returns:
            The ``DTensor``.
        Raises:
            TypeError / ValueError: bad arguments; a piece that does not fit
                the given ``shape`` (naming the world rank, its local shape,
                the placements and the shape; with ``run_check`` every rank of
                the mesh raises); with ``run_check``, ranks that disagree on
                the shape, dtype or placements (every rank raises, naming them
                all); without ``shape``, pieces
                whose sizes do not follow ``numpy.array_split`` or that differ
                in ndim, dtype or the sizes of the other tensor dimensions
                (every rank of the mesh raises ``ValueError``; the ranks whose
                line failed name each piece's world rank and sizes, which takes
                one more all-gather of those shapes on that line, the others
                name the first such world rank).  Along Replicate and Partial
                dimensions the inference compares nothing (``run_check`` does).
            RingletError: the mesh was closed.

        Example::

            part = x_local @ w_local.T                       # row-parallel partial sums
            y = DTensor.from_local(part, mesh, [Partial()])
            y = y.redistribute([Replicate()])                # all_reduce
        """
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        if not isinstance(local, np.ndarray):
            raise TypeError(f"local must be a numpy.ndarray, got {type(local).__name__}")
        # With the shape inferred, or checked collectively, a Shard dim outside this
        # rank's piece (ranks passing pieces of different ndim) is found with the others:
        # raising here would leave them waiting in a collective.
        ps = _check_placements(placements, mesh, local.ndim,
                               strict=shape is not None and not run_check)
        mesh._require_member("from_local")
        mesh._check_open("from_local")
        problem: Optional[str] = None
        if shape is None:
            shape = _infer_shape(local, mesh, ps, timeout)
        else:
            shape = tuple(int(s) for s in shape)
            problem = _fit_problem(local, mesh, ps, shape)
            if problem is not None and not run_check:
                raise ValueError(f"from_local: {problem}")
        if run_check:
            _check_across_mesh(local, mesh, ps, shape, problem, timeout)
        return cls(local, mesh, ps, shape)

    # ---- accessors -----------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        return self._local.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return tuple(self._local.shape)

    def to_local(self) -> np.ndarray:
        """This rank's piece (the array itself, not a copy)."""
        return self._local

    def local_offsets(self) -> Tuple[int, ...]:
        """Global index of this rank's piece's first element along each tensor dimension."""
        return _local_extent(self.shape, self.mesh, self.placements, self.mesh.coordinate)[0]

    def __repr__(self) -> str:
        return (f"DTensor(shape={self.shape}, dtype={self.dtype}, placements={self.placements}, "
                f"mesh={self.mesh.dim_names})")

    # ---- data movement ---------------------------------------------------------------
    def full_tensor(self, *, timeout: Optional[float] = None) -> np.ndarray:
        """The whole logical array on every rank (redistributes to all-Replicate).

        Collective over the mesh.  When already replicated, returns the local
        array itself.
        """
        return self.redistribute([Replicate()] * self.mesh.ndim, timeout=timeout).to_local()

    def redistribute(self, placements: Sequence[Placement], *,
                     timeout: Optional[float] = None) -> "DTensor":
        """A DTensor of the same values with new placements; moves data with collectives.

        Collective over the mesh (every rank, same arguments).  See the module
        docstring for the collective each change uses.  The result may share
        memory with this DTensor when little or nothing changes.

        Args:
            placements: one per mesh dimension.
            timeout: seconds for each collective.
        Returns:
            The new ``DTensor``.
        Raises:
            TypeError / ValueError: bad placements; this rank is not in the mesh.
            RingletError: the mesh was closed.

        Example::

            y = x.redistribute([Shard(0), Replicate()])
        """
        dst = _check_placements(placements, self.mesh, self.ndim)
        self.mesh._require_member("redistribute")
        self.mesh._check_open("redistribute")
        src = self.placements
        cur = list(src)
        local = self._local
        changing = [i for i in range(self.mesh.ndim) if src[i] != dst[i]]
        if not changing:
            return self
        nested = self._nested_dims(src, dst, changing)
        # Exclusive changes commute with everything else: do them directly.
        for i in changing:
            if i not in nested:
                local = self._step(local, i, cur, dst[i], timeout)
                cur[i] = dst[i]
        # Nested shards: unwind the innermost first, then rebuild outermost first.
        for i in sorted(nested, reverse=True):
            if not cur[i].is_replicate():
                local = self._step(local, i, cur, Replicate(), timeout)
                cur[i] = Replicate()
        for i in sorted(nested):
            if cur[i] != dst[i]:
                local = self._step(local, i, cur, dst[i], timeout)
                cur[i] = dst[i]
        return DTensor(local, self.mesh, dst, self.shape, _checked=True)

    @staticmethod
    def _nested_dims(src, dst, changing) -> Set[int]:
        """Mesh dimensions that must go through Replicate because their shards nest."""
        n = len(src)
        touch = [_tdims(src[k]) | _tdims(dst[k]) for k in range(n)]
        nested = {i for i in changing
                  if any(k != i and touch[k] & touch[i] for k in range(n))}
        grew = True
        while grew:  # a nested dim drags every later dim that cuts the same tensor dims
            grew = False
            for i in sorted(nested):
                for j in range(i + 1, n):
                    if j not in nested and touch[j] & touch[i]:
                        nested.add(j)
                        grew = True
        return nested

    def _piece_len(self, d: int, i: int, cur: Sequence[Placement]) -> int:
        """Length along tensor dim ``d`` of the piece that mesh dim ``i`` splits.

        Only mesh dims before ``i`` (outer) are applied: at the time ``i``
        changes, no later dim shards ``d`` (guaranteed by the ordering).
        """
        length = self.shape[d]
        coord = self.mesh.coordinate
        for k in range(i):
            if isinstance(cur[k], Shard) and cur[k].dim == d:
                length = shard_sizes(length, self.mesh.shape[k])[coord[k]]
        return length

    def _step(self, x: np.ndarray, i: int, cur: Sequence[Placement], to: Placement,
              timeout: Optional[float]) -> np.ndarray:
        """Change mesh dim ``i`` from ``cur[i]`` to ``to``; returns the new local array."""
        frm = cur[i]
        mesh = self.mesh
        n = mesh.shape[i]
        c = mesh.coordinate[i]
        if n == 1:
            return x  # a single rank: every placement holds the same data
        group = mesh.get_group(i)
        order = mesh.line_order(i)
        if isinstance(frm, Replicate):
            if isinstance(to, Shard):
                sizes = shard_sizes(self._piece_len(to.dim, i, cur), n)
                off = _offsets(sizes)[c]
                return np.ascontiguousarray(_take(x, to.dim, off, off + sizes[c]))
            return _replicate_to_partial(x, to.op, c)
        if isinstance(frm, Shard):
            sizes = shard_sizes(self._piece_len(frm.dim, i, cur), n)
            if isinstance(to, Replicate):
                return gather_axis(group, order, x, frm.dim, sizes, timeout=timeout)
            if isinstance(to, Shard):
                dsizes = shard_sizes(self._piece_len(to.dim, i, cur), n)
                return all_to_all_axes(group, order, x, frm.dim, to.dim, sizes, dsizes, c,
                                       timeout=timeout)
            if to.op == ReduceOp.AVG:  # no identity element: go through Replicate
                full = gather_axis(group, order, x, frm.dim, sizes, timeout=timeout)
                return _replicate_to_partial(full, to.op, c)
            shp = list(x.shape)
            shp[frm.dim] = sum(sizes)
            out = np.full(shp, _identity(to.op, x.dtype), x.dtype)
            off = _offsets(sizes)[c]
            idx = [slice(None)] * x.ndim
            idx[frm.dim] = slice(off, off + sizes[c])
            out[tuple(idx)] = x
            return out
        # frm is Partial
        if isinstance(to, Shard):
            sizes = shard_sizes(self._piece_len(to.dim, i, cur), n)
            return reduce_scatter_axis(group, order, x, to.dim, sizes, c, frm.op,
                                       timeout=timeout)
        full = np.array(x, copy=True, order="C")
        group.all_reduce(full, frm.op, timeout=timeout)
        if isinstance(to, Replicate):
            return full
        return _replicate_to_partial(full, to.op, c)


def _replicate_to_partial(x: np.ndarray, op: ReduceOp, c: int) -> np.ndarray:
    if op in (ReduceOp.SUM, ReduceOp.PROD) and c != 0:
        return np.full(x.shape, _identity(op, x.dtype), x.dtype)
    return np.array(x, copy=True, order="C")


def _local_extent(shape, mesh, placements, coord) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(offsets, sizes) of the piece at ``coord``: nested array_split in mesh-dim order."""
    off = [0] * len(shape)
    size = list(shape)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            sizes = shard_sizes(size[p.dim], mesh.shape[i])
            off[p.dim] += sum(sizes[:coord[i]])
            size[p.dim] = sizes[coord[i]]
    return tuple(off), tuple(size)


def _local_shape(shape, mesh, placements, coord) -> Tuple[int, ...]:
    return _local_extent(shape, mesh, placements, coord)[1]


def _fit_problem(local: np.ndarray, mesh: DeviceMesh, ps: Tuple[Placement, ...],
                 shape: Tuple[int, ...]) -> Optional[str]:
    """Why ``local`` is not this rank's piece of a global ``shape`` under ``ps``, or None."""
    me = f"world rank {mesh._me} (mesh coordinate {mesh.coordinate})"
    if any(s < 0 for s in shape):
        return f"{me}: the global shape {shape} has a negative size"
    if len(shape) != local.ndim:
        return (f"{me}: the global shape {shape} has {len(shape)} dimensions, the local "
                f"array of shape {tuple(local.shape)} {local.ndim}")
    for p in ps:
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
            return f"{me}: {p!r} is out of range for the {len(shape)}-D global shape {shape}"
    want = _local_shape(shape, mesh, ps, mesh.coordinate)
    if tuple(local.shape) != want:
        return (f"{me}: local array has shape {tuple(local.shape)}, but placements {ps} of "
                f"the global shape {shape} give this rank {want} (numpy.array_split pieces)")
    return None


def _check_across_mesh(local: np.ndarray, mesh: DeviceMesh, ps: Tuple[Placement, ...],
                       shape: Tuple[int, ...], problem: Optional[str],
                       timeout: Optional[float]) -> None:
    """``from_local(run_check=True)``: ValueError on every rank of the mesh unless every
    rank passed the same global shape, dtype and placements and no rank has a ``problem``.

    One all-reduce(MIN) of three int64 per mesh dimension covers the grid: a digest of
    the arguments and its negation (equal everywhere iff min == -max), and the smallest
    world rank with a problem.  Only on failure are the arguments all-gathered, dimension
    by dimension, so that every rank names them all in the same message.
    """
    dt = local.dtype.name if local.dtype.isnative else local.dtype.str
    text = f"{list(shape)}/{local.dtype.str}/{dt}/{ps!r}".encode()
    d = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2
    big = np.iinfo(np.int64).max
    v = np.array([d, -d, mesh._me if problem is not None else big], np.int64)
    for k in range(mesh.ndim):
        if mesh.shape[k] > 1:
            mesh.get_group(k).all_reduce(v, ReduceOp.MIN, timeout=timeout)
    if v[0] == -v[1] and v[2] == big:
        return
    entries = [[mesh._me, list(shape), dt, repr(ps), problem]]
    for k in reversed(range(mesh.ndim)):  # innermost first: lines, then planes, ...
        if mesh.shape[k] > 1:
            got = mesh.get_group(k).all_gather_object(entries, timeout=timeout)
            entries = [e for part in got for e in part]
    entries.sort(key=lambda e: e[0])
    kinds: dict = {}
    for r, shp, dtn, pl, _ in entries:
        kinds.setdefault((tuple(shp), dtn, pl), []).append(r)
    msgs = []
    if len(kinds) > 1:
        msgs.append("the ranks passed different global shapes, dtypes or placements ("
                    + "; ".join(f"world ranks {rs}: shape {s}, {dtn}, placements {pl}"
                                for (s, dtn, pl), rs in kinds.items())
                    + "); every rank of the mesh must pass the same")
    bad = [e for e in entries if e[4] is not None]
    if bad:
        more = f" (and {len(bad) - 1} more ranks' pieces do not fit)" if len(bad) > 1 else ""
        msgs.append(bad[0][4] + more)
    raise ValueError("from_local(run_check=True): " + "; ".join(msgs)
                     + "; every rank of the mesh raises")


def _digest(dtype: np.dtype, dims: Sequence[int]) -> int:
    """A digest of a dtype and some sizes, equal on every process (int64)."""
    text = f"{dtype.str}/{dtype.name}/{list(dims)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def _infer_shape(local: np.ndarray, mesh: DeviceMesh, ps: Tuple[Placement, ...],
                 timeout: Optional[float]) -> Tuple[int, ...]:
    """The global shape from every rank's piece; ValueError on every rank of the mesh if they
    disagree.

    Per sharded mesh dimension, innermost first (each all-gather recovers the
    piece one nesting level out), the line gathers [size along the sharded
    tensor dim, digest of (dtype, other sizes), found a problem already].  A
    piece without the sharded dimension (of another ndim than its peers')
    sends size -1 and a digest no good piece has.  A problem is only noted,
    never raised mid-way: a rank on a good line would otherwise go on to the
    next all-gather and wait for ranks that left.  At the end every rank
    agrees on the first world rank with a problem.
    """
    shape = list(local.shape)
    problem: Optional[str] = None
    for i, p in enumerate(ps):
        # No line to tell on a dimension of one rank: the final agreement does.
        if isinstance(p, Shard) and not 0 <= p.dim < local.ndim and mesh.shape[i] == 1:
            problem = (f"from_local: {p!r} is out of range for this rank's {local.ndim}-D piece "
                       f"of shape {tuple(local.shape)}")
    sharded = False
    for i in reversed(range(mesh.ndim)):
        p = ps[i]
        if not isinstance(p, Shard) or mesh.shape[i] == 1:
            continue
        sharded = True
        n = mesh.shape[i]
        group = mesh.get_group(i)
        order = mesh.line_order(i)
        has_dim = 0 <= p.dim < len(shape)
        if has_dim:
            digest = _digest(local.dtype, [s for d, s in enumerate(shape) if d != p.dim])
        else:
            digest = _digest(local.dtype, [-1, local.ndim])
        mine = np.array([shape[p.dim] if has_dim else -1, digest, problem is not None],
                        np.int64)
        got = np.zeros((n, 3), np.int64)
        group.all_gather(got, mine, timeout=timeout)
        got = got[order]  # coordinate order
        sizes = [int(s) for s in got[:, 0]]
        if has_dim:
            shape[p.dim] = sum(sizes)
        if problem is not None or got[:, 2].any():
            continue  # an inner line already failed: these sizes mean nothing
        # Every rank of the line sees the same `got`, so all take the same branch.
        where = f"along mesh dimension {mesh.dim_names[i]!r}"
        if (got[:, 1] != got[0, 1]).any() or min(sizes) < 0:
            problem = _misfit(local, mesh, i, p, group, order, timeout)
        elif sizes != shard_sizes(sum(sizes), n):
            problem = (f"from_local: pieces {where} (world ranks {mesh.ranks_along(i)}) have "
                       f"sizes {sizes} (this rank's piece: {tuple(local.shape)}); uneven "
                       f"shards must follow numpy.array_split "
                       f"({shard_sizes(sum(sizes), n)}); pass shape= otherwise")
    if not sharded:
        if problem is not None:  # nothing was communicated: this rank alone raises
            raise ValueError(problem)
        return tuple(shape)
    if mesh.ndim > 1:  # on a 1-D mesh the one line saw everything alike
        first = _first_failed_rank(mesh, problem is not None, timeout)
        if problem is None and first >= 0:
            problem = (f"from_local: the pieces on world rank {first}'s mesh line do not fit "
                       f"together (see the error there); every rank of the mesh raises")
    if problem is not None:
        raise ValueError(problem)
    return tuple(shape)


def _misfit(local: np.ndarray, mesh: DeviceMesh, i: int, p: Shard, group: Any,
            order: Sequence[int], timeout: Optional[float]) -> str:
    """The error for a line whose pieces differ in ndim, dtype or other sizes, naming each
    rank's piece: one more all-gather, on this failure path only."""
    got = group.all_gather_object([local.dtype.name, list(local.shape)], timeout=timeout)
    pieces = ", ".join(f"world rank {r}: {got[order[c]][0]} {tuple(got[order[c]][1])}"
                       for c, r in enumerate(mesh.ranks_along(i)))
    return (f"from_local: the pieces along mesh dimension {mesh.dim_names[i]!r} do not fit "
            f"together ({pieces}); sharded by {p!r} they need the same ndim and dtype, and "
            f"the same sizes in every other tensor dimension")


def _first_failed_rank(mesh: DeviceMesh, failed: bool, timeout: Optional[float]) -> int:
    """Smallest world rank of the mesh with ``failed`` set, or -1: one 8-byte MIN per dim."""
    big = np.iinfo(np.int64).max
    v = np.array([mesh._me if failed else big], np.int64)
    for k in range(mesh.ndim):  # a MIN along each dimension in turn covers the grid
        if mesh.shape[k] > 1:
            mesh.get_group(k).all_reduce(v, ReduceOp.MIN, timeout=timeout)
    return -1 if v[0] == big else int(v[0])


def distribute(array: Optional[np.ndarray], mesh: DeviceMesh, placements: Sequence[Placement],
               *, src: Optional[int] = None, timeout: Optional[float] = None) -> DTensor:
    """Distribute a whole array over ``mesh`` with ``placements``.

    Two ways to provide the data:

    * ``src=None`` (default): every rank of the mesh passes the same whole
      array and keeps its piece; no communication (not verified).
    * ``src=r`` (a world rank in the mesh): only rank r needs the array
      (others may pass None).  Its shape and dtype are broadcast over the
      mesh one dimension at a time (along dimension 0 through r, then along
      dimension 1 from every rank that has them, ...).  Then the values
      travel the same way, Shard mesh dimensions first: along a Shard
      dimension the rank holding the data scatters the pieces
      (``scatter_v``), along the others it broadcasts its piece.  So a rank
      receives its own piece, or the piece of the outer Shard dimensions it
      passes on, never the whole array unless its placements replicate it
      or make it Partial (broadcast like Replicate, then filled as below,
      as torch's ``distribute_tensor`` broadcasts and then partitions).

    Partial placements treat the array as the logical value: for SUM the
    rank at coordinate 0 of that mesh dimension holds it and the others
    zeros (PROD: ones; MIN, MAX, AVG: every rank holds it).

    Args:
        array: the whole array (or None on non-source ranks with ``src``).
        mesh: the mesh; collective over its ranks.
        placements: one per mesh dimension.
        src: world rank holding the array, or None.
        timeout: seconds for each collective.
    Returns:
        The ``DTensor``; its local array never shares memory with ``array``.
    Raises:
        TypeError / ValueError: bad arguments or placements.  With ``src``, a
            source that passes no array or an unsupported dtype raises
            ``TypeError`` on every rank of the mesh (the error is broadcast in
            place of the metadata); placements that do not fit the array's
            ndim raise ``ValueError`` on every rank, before any data moves.
        RingletError: the mesh was closed.

    Example::

        mesh = DeviceMesh((2, 3), ("dp", "tp"))
        w = distribute(np.arange(35.0).reshape(7, 5), mesh, [Replicate(), Shard(0)])
        w.to_local().shape   # (3, 5), (2, 5) or (2, 5) by tp coordinate
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    mesh._require_member("distribute")
    mesh._check_open("distribute")
    if src is None:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"distribute: array must be a numpy.ndarray (pass src= to send it "
                            f"from one rank), got {type(array).__name__}")
        ps = _check_placements(placements, mesh, array.ndim)
        shape = tuple(array.shape)
        # From all-Replicate, outermost mesh dim first: local slices only.
        cur: List[Placement] = [Replicate()] * mesh.ndim
        tmp = DTensor(np.asarray(array, order="C"), mesh, cur, shape, _checked=True)
        local = tmp._local
        for i in range(mesh.ndim):
            if ps[i] != cur[i]:
                local = tmp._step(local, i, cur, ps[i], timeout)
                cur[i] = ps[i]
    else:
        scoord, full, shape, dtype = _meta_over_mesh(array, mesh, src, timeout)
        # The same shape on every rank of the mesh: all raise here, or none.
        ps = _check_placements(placements, mesh, len(shape))
        local = _send_pieces(full, shape, dtype, mesh, ps, scoord, timeout)
    if isinstance(array, np.ndarray) and np.shares_memory(local, array):
        local = np.array(local, copy=True, order="C")  # never alias the caller's array
    return DTensor(local, mesh, ps, shape, _checked=True)


def _meta_over_mesh(array: Optional[np.ndarray], mesh: DeviceMesh, src: int,
                    timeout: Optional[float]) -> Tuple[Tuple[int, ...], Optional[np.ndarray],
                                                       Tuple[int, ...], np.dtype]:
    """Broadcast the source's shape and dtype (or its error) over the mesh.

    Returns (source coordinate, the source's contiguous array or None, shape,
    dtype); raises the source's TypeError on every rank of the mesh.
    """
    if isinstance(src, bool) or not isinstance(src, (int, np.integer)):
        raise TypeError(f"distribute: src must be a world rank (int) or None, got "
                        f"{type(src).__name__}")
    where = np.argwhere(mesh.mesh == int(src))
    if not len(where):
        raise ValueError(f"distribute: src={src} is not in the mesh "
                         f"{mesh.mesh.reshape(-1).tolist()}")
    scoord = tuple(int(c) for c in where[0])
    coord = mesh.coordinate
    is_src = coord == scoord
    # meta: [shape, C dtype code, None] or, when the source cannot send, [None, None, error].
    # The code (not dtype.str, which is '<V2' for bfloat16) rebuilds the dtype exactly.
    meta: Any = None
    full: Optional[np.ndarray] = None
    if is_src:
        if not isinstance(array, np.ndarray):
            meta = [None, None, f"distribute: the source rank must pass a numpy.ndarray, got "
                                f"{type(array).__name__}"]
        else:
            try:
                code = dtype_code(array.dtype, "distribute: the source array")
            except TypeError as exc:
                meta = [None, None, str(exc)]
            else:
                full = np.asarray(array, order="C")
                meta = [list(full.shape), code, None]
    for k in range(mesh.ndim):
        # Ranks agreeing with the source on every dim after k take part at step k.
        if coord[k + 1:] != scoord[k + 1:] or mesh.shape[k] == 1:
            continue
        group = mesh.get_group(k)
        root = mesh.line_order(k)[scoord[k]]
        meta = group.broadcast_object(meta if coord[k] == scoord[k] else None, root,
                                      timeout=timeout)
    if meta[2] is not None:  # every rank of the mesh got the source's error
        raise TypeError(meta[2] if is_src else f"{meta[2]} (raised on the source, world rank "
                                               f"{int(src)}; every rank of the mesh raises)")
    return scoord, full, tuple(int(s) for s in meta[0]), dtype_from_code(meta[1])


def _send_pieces(full: Optional[np.ndarray], shape: Tuple[int, ...], dtype: np.dtype,
                 mesh: DeviceMesh, ps: Tuple[Placement, ...], scoord: Tuple[int, ...],
                 timeout: Optional[float]) -> np.ndarray:
    """This rank's piece of the source's array ``full`` (None off the source).

    The data spreads over the mesh one dimension at a time, as the metadata
    did, with the Shard dimensions first (in mesh order, so nested shards cut
    in the documented order): ranks that agree with the source on every
    dimension still to come take part in a step, and on each line the rank
    at the source's coordinate holds the piece cut by the Shard steps before.
    It scatters that piece (Shard) or broadcasts it (Replicate, Partial), so
    no rank receives more than the Shard steps leave.  Partial values are set
    last: they only fill or copy, which commutes with the cuts.
    """
    coord = mesh.coordinate
    steps = [k for k in range(mesh.ndim) if isinstance(ps[k], Shard)]
    steps += [k for k in range(mesh.ndim) if not isinstance(ps[k], Shard)]
    cut: List[Placement] = [Replicate()] * mesh.ndim  # the cuts made so far
    piece = full
    for t, k in enumerate(steps):
        later = steps[t + 1:]
        n = mesh.shape[k]
        if n == 1 or any(coord[j] != scoord[j] for j in later):
            cut[k] = ps[k]
            continue
        group = mesh.get_group(k)
        order = mesh.line_order(k)
        root = order[scoord[k]]
        holder = coord[k] == scoord[k]
        # Every rank of the line shares the coordinates of the cuts so far.
        held = _local_shape(shape, mesh, cut, coord)
        p = ps[k]
        if isinstance(p, Shard):
            sizes = shard_sizes(held[p.dim], n)
            mine = list(held)
            mine[p.dim] = sizes[coord[k]]
            out = np.empty(tuple(mine), dtype)
            if int(np.prod(held, dtype=np.int64)):  # alike on the line: it moves something
                inp = counts = None
                if holder:
                    inp = _pack(piece, p.dim, sizes, order)
                    counts = _block_counts(held, p.dim, sizes, order)
                group.scatter_v(out.reshape(-1), inp, counts, root, timeout=timeout)
            piece = out
        else:
            if not holder:
                piece = np.empty(held, dtype)
            group.broadcast(piece, root, timeout=timeout)
        cut[k] = ps[k]
    for k, p in enumerate(ps):
        if isinstance(p, Partial) and mesh.shape[k] > 1:
            piece = _replicate_to_partial(piece, p.op, coord[k])
    return piece
