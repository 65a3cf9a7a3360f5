"""``DeviceMesh``: ranks laid out on an N-D grid, with one process group per grid line.

A job that combines several kinds of parallelism (pipeline, data, tensor,
expert) arranges its ranks on a grid with one axis per kind.  Ranks that
differ only in their coordinate along axis *d* form a *line* along *d*, and
every line gets its own ``ProcessGroup``; a rank's group along *d* is the line
through it.  With ``shape=(2, 2, 2)`` and ``dim_names=("pp", "dp", "tp")``
(row-major, so "tp" varies fastest)::

    rank = 4*pp + 2*dp + tp
    tp lines: [0,1] [2,3] [4,5] [6,7]     dp lines: [0,2] [1,3] [4,6] [5,7]
    pp lines: [0,4] [1,5] [2,6] [3,7]

Group creation is collective.  ``ringlet.new_group`` must be called by every
rank of the parent group, in the same order, so the constructor creates
every line of every dimension, dimension by dimension, lines in row-major
order of the other coordinates, on every rank (a rank keeps the handles of
the lines it is on).  Sub-meshes and ``mesh[dim]`` reuse these groups and
create nothing.  ``close()`` (or leaving a ``with mesh:`` block) releases
every group the mesh created.

Coordinates and group ranks.  ``new_group`` orders a group's members by
world rank, so when the ranks along a line are not increasing (a custom
``ranks=`` layout) a member's group rank differs from its coordinate on the
line.  ``line_order(dim)`` gives the mapping; ``ringlet.dtensor`` uses it, so a
shard's position always follows the mesh coordinate.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .._world import _require, get_rank, get_world_size, new_group
from ..errors import RingletError
from ..group import ProcessGroup

__all__ = ["DeviceMesh"]

DimKey = Union[int, str]


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    return int(v)


def _nested_shape(x: Any, where: str) -> Tuple[Optional[Tuple[int, ...]], Optional[str]]:
    """(shape, None) of nested lists/tuples, or (None, which entries disagree) when ragged.

    numpy refuses ragged lists with a message that names neither the argument nor the rows.
    """
    if isinstance(x, np.ndarray):
        return tuple(x.shape), None
    if not isinstance(x, (list, tuple)):
        return (), None
    first: Optional[Tuple[int, ...]] = None
    for i, e in enumerate(x):
        s, bad = _nested_shape(e, f"{where}[{i}]")
        if bad is not None:
            return None, bad
        if first is None:
            first = s
        elif s != first:
            return None, (f"{where}[0] {_describe(first)} but {where}[{i}] {_describe(s)}")
    return (len(x),) + (first or ()), None


def _describe(shape: Tuple[int, ...]) -> str:
    if not shape:
        return "is a single rank"
    if len(shape) == 1:
        return f"has {shape[0]} entr{'y' if shape[0] == 1 else 'ies'}"
    return f"has shape {shape}"


class _Shared:
    """State shared by a mesh and every sub-mesh taken from it."""

    def __init__(self, parent: Any, timeout: Optional[float]) -> None:
        self.parent = parent
        self.timeout = timeout
        # (full-mesh dim, coordinates along it) -> this rank's group, or None
        self.subgroups: Dict[Tuple[int, Tuple[int, ...]], Any] = {}
        # Every handle the mesh made, non-member ones included: what close() releases.
        self.created: List[ProcessGroup] = []
        self.closed = False

    def release(self) -> None:
        groups, self.created, self.subgroups = self.created, [], {}
        for g in groups:
            g.close()  # nothing to do where ringlet.shutdown() closed it already


def _group_or_world(group: Optional[ProcessGroup]) -> ProcessGroup:
    """``group``, or the default group for None: how the training layers resolve one."""
    return _require(group)

class DeviceMesh:
    """An N-D grid of ranks with a process group along every dimension.

    Construction is collective: every rank of the parent group (default:
    the world) must create the same mesh, in the same order relative to its
    other ``new_group`` calls, even ranks that are not in the mesh.

    Args:
        shape: an int or a sequence of positive ints, e.g. ``(2, 2, 2)``.
        dim_names: one distinct name per dimension, e.g. ``("pp", "dp", "tp")``;
            default ``("dim0", "dim1", ...)``.
        ranks: world ranks on the grid: ``prod(shape)`` distinct ranks of the
            parent group, flat (laid out row-major) or already of ``shape``.
            Default: the parent group's ranks in order, which then must number
            exactly ``prod(shape)``.
        group: the parent group whose members construct the mesh (default: the world).
        timeout: seconds passed to ``new_group``.
    Attributes:
        shape, ndim, dim_names: the grid.
        mesh: int64 array of ``shape`` holding the world rank at each coordinate.
        coordinate: this rank's coordinate tuple, or None when it is not in the mesh.
    Raises:
        TypeError / ValueError: bad shape, names or ranks.

    The mesh owns its groups: ``close()`` releases them, and ``with mesh:``
    closes it on leaving the block.

    Example::

        ringlet.init()                                   # 8 ranks
        mesh = DeviceMesh((2, 2, 2), ("pp", "dp", "tp"))
        tp_group = mesh["tp"]                            # = mesh.get_group("tp")
        dp_tp = mesh["dp", "tp"]                         # 2-D sub-mesh through this rank
        print(mesh.coordinate, mesh.size("tp"))
        mesh.close()                                     # once no rank uses its groups
    """

    def __init__(self, shape: Union[int, Sequence[int]], dim_names: Optional[Sequence[str]] = None,
                 *, ranks: Any = None, group: Any = None, timeout: Optional[float] = None) -> None:
        shape_t = self._check_shape(shape)
        names = self._check_names(dim_names, len(shape_t))
        if group is not None and not isinstance(group, ProcessGroup):
            raise TypeError(f"DeviceMesh: group must be a ringlet.ProcessGroup or None, got "
                            f"{type(group).__name__}")
        parent = group
        parent_ranks = list(parent.ranks) if parent is not None else \
            list(range(get_world_size()))
        n = int(np.prod(shape_t))
        if ranks is None:
            if len(parent_ranks) != n:
                raise ValueError(f"DeviceMesh: shape {shape_t} holds {n} ranks but the parent "
                                 f"group has {len(parent_ranks)}; pass ranks= to use a subset")
            grid = np.array(parent_ranks, dtype=np.int64).reshape(shape_t)
        else:
            grid = self._check_ranks(ranks, shape_t, parent_ranks)
        if parent is None:
            me = get_rank()
        elif parent.rank >= 0:
            me = parent.ranks[parent.rank]
        else:
            raise ValueError("DeviceMesh: this rank is not a member of the parent group")
        shared = _Shared(parent, timeout)
        self._init_view(grid, names, shared, me)
        self._groups: List[Any] = [None] * self.ndim
        try:
            # Every rank creates every line, in one fixed order (collective rule of new_group).
            for d in range(self.ndim):
                for line in self._lines(d):
                    g = new_group([int(r) for r in line], timeout=timeout, group=parent)
                    shared.created.append(g)
                    if me in line:
                        self._groups[d] = g
        except BaseException:
            shared.release()  # a half-built mesh must not hold the lines made so far
            raise

    # ---- construction helpers ------------------------------------------------
    @staticmethod
    def _check_shape(shape: Any) -> Tuple[int, ...]:
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
            shape = (shape,)
        try:
            dims = tuple(shape)
        except TypeError:
            raise TypeError(f"DeviceMesh: shape must be an int or a sequence of ints, got "
                            f"{type(shape).__name__}") from None
        if not dims:
            raise ValueError("DeviceMesh: shape must have at least one dimension")
        out = tuple(_int(s, "DeviceMesh: shape entry") for s in dims)
        if any(s < 1 for s in out):
            raise ValueError(f"DeviceMesh: shape entries must be positive, got {out}")
        return out

    @staticmethod
    def _check_names(dim_names: Any, ndim: int) -> Tuple[str, ...]:
        if dim_names is None:
            return tuple(f"dim{i}" for i in range(ndim))
        if isinstance(dim_names, str):
            dim_names = (dim_names,)
        names = tuple(dim_names)
        if len(names) != ndim:
            raise ValueError(f"DeviceMesh: {len(names)} dim_names for a {ndim}-D shape")
        for nm in names:
            if not isinstance(nm, str) or not nm:
                raise TypeError(f"DeviceMesh: dim_names must be non-empty strings, got {nm!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"DeviceMesh: dim_names must be distinct, got {names}")
        return names

    @staticmethod
    def _check_ranks(ranks: Any, shape: Tuple[int, ...], parent_ranks: List[int]) -> np.ndarray:
        n = int(np.prod(shape))
        _, ragged = _nested_shape(ranks, "ranks")
        if ragged is not None:
            raise ValueError(f"DeviceMesh: ranks is a ragged nested list ({ragged}); the mesh "
                             f"needs {n} ranks, flat or nested as a grid of shape {shape}")
        arr = np.asarray(ranks)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"DeviceMesh: ranks must be integers, got dtype {arr.dtype}")
        if arr.size != n or (arr.ndim > 1 and arr.shape != shape):
            raise ValueError(f"DeviceMesh: ranks has shape {arr.shape}; the mesh needs {n} "
                             f"ranks, flat or of shape {shape}")
        flat = [int(r) for r in arr.reshape(-1)]
        if len(set(flat)) != n:
            raise ValueError(f"DeviceMesh: ranks must be distinct, got {flat}")
        outside = sorted(set(flat) - set(parent_ranks))
        if outside:
            raise ValueError(f"DeviceMesh: ranks {outside} are not in the parent group")
        return np.array(flat, dtype=np.int64).reshape(shape)

    def _init_view(self, grid: np.ndarray, names: Tuple[str, ...], shared: _Shared,
                   me: int) -> None:
        self.mesh = grid
        self.mesh.setflags(write=False)
        self.shape: Tuple[int, ...] = tuple(grid.shape)
        self.ndim = grid.ndim
        self.dim_names: Tuple[str, ...] = names
        self._shared = shared
        self._me = me
        where = np.argwhere(grid == me)
        self.coordinate: Optional[Tuple[int, ...]] = \
            tuple(int(c) for c in where[0]) if len(where) else None

    def _lines(self, d: int) -> List[np.ndarray]:
        """Every line along dim ``d``, in row-major order of the other coordinates."""
        moved = np.moveaxis(self.mesh, d, -1)
        return list(moved.reshape(-1, self.shape[d]))

    # ---- lookup --------------------------------------------------------------
    def _dim(self, dim: DimKey) -> int:
        if isinstance(dim, str):
            if dim not in self.dim_names:
                raise ValueError(f"DeviceMesh has no dimension named {dim!r}; its dimensions "
                                 f"are {self.dim_names}")
            return self.dim_names.index(dim)
        d = _int(dim, "mesh dimension")
        if not -self.ndim <= d < self.ndim:
            raise ValueError(f"mesh dimension {d} is out of range for a {self.ndim}-D mesh")
        return d % self.ndim

    def _check_open(self, what: str) -> None:
        if self._shared.closed:
            raise RingletError(f"DeviceMesh.{what}: world rank {self._me}: the mesh "
                               f"{self.mesh.reshape(-1).tolist()} was closed and its groups "
                               f"released; create a new DeviceMesh")

    def _require_member(self, what: str) -> Tuple[int, ...]:
        if self.coordinate is None:
            raise ValueError(f"DeviceMesh.{what}: this rank (world rank {self._me}) is not in "
                             f"the mesh {self.mesh.reshape(-1).tolist()}")
        return self.coordinate

    def get_group(self, dim: Optional[DimKey] = None) -> Any:
        """This rank's process group along ``dim`` (index or name).

        Args:
            dim: the dimension; may be omitted for a 1-D mesh.
        Returns:
            A ``ringlet.ProcessGroup`` of the ranks on this rank's line along ``dim``.
        Raises:
            ValueError: unknown dimension, or this rank is not in the mesh.
            RingletError: the mesh was closed.

        Example::

            mesh.get_group("dp").all_reduce(grad, ringlet.ReduceOp.AVG)
        """
        if dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_group: a {self.ndim}-D mesh needs a dimension")
            dim = 0
        d = self._dim(dim)
        self._require_member("get_group")
        self._check_open("get_group")
        return self._groups[d]

    def __getitem__(self, key: Any) -> Any:
        """``mesh[dim]`` is ``get_group(dim)``; ``mesh[d1, d2, ...]`` is ``submesh((d1, d2, ...))``."""
        if isinstance(key, tuple):
            return self.submesh(key)
        return self.get_group(key)

    def size(self, dim: Optional[DimKey] = None) -> int:
        """Number of ranks along ``dim``, or in the whole mesh when ``dim`` is None."""
        if dim is None:
            return int(self.mesh.size)
        return self.shape[self._dim(dim)]

    def get_local_rank(self, dim: Optional[DimKey] = None) -> int:
        """This rank's coordinate along ``dim`` (may be omitted for a 1-D mesh)."""
        if dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_local_rank: a {self.ndim}-D mesh needs a dimension")
            dim = 0
        return self._require_member("get_local_rank")[self._dim(dim)]

    def line_order(self, dim: DimKey) -> List[int]:
        """Group rank of each coordinate on this rank's line along ``dim``.

        ``line_order(d)[c]`` is the rank in ``get_group(d)`` of the member at
        coordinate c.  It is ``[0, 1, ...]`` unless a custom ``ranks=`` layout
        puts ranks out of increasing order along ``d``.
        """
        d = self._dim(dim)
        coord = self._require_member("line_order")
        idx = list(coord)
        idx[d] = slice(None)
        line = [int(r) for r in self.mesh[tuple(idx)]]
        sorted_line = sorted(line)
        return [sorted_line.index(r) for r in line]

    def ranks_along(self, dim: DimKey) -> List[int]:
        """World ranks on this rank's line along ``dim``, in coordinate order."""
        d = self._dim(dim)
        coord = self._require_member("ranks_along")
        idx = list(coord)
        idx[d] = slice(None)
        return [int(r) for r in self.mesh[tuple(idx)]]

    # ---- sub-meshes ------------------------------------------------------------
    def submesh(self, dims: Sequence[DimKey]) -> "DeviceMesh":
        """The sub-mesh through this rank spanned by ``dims`` (kept in the given order).

        No group is created: the sub-mesh shares this mesh's groups.

        Args:
            dims: one or more distinct dimensions (indices or names).
        Returns:
            A ``DeviceMesh`` of ``len(dims)`` dimensions.
        Raises:
            ValueError: unknown or repeated dimensions, or this rank is not in the mesh.
            RingletError: the mesh was closed.

        Example::

            dp_tp = mesh.submesh(("dp", "tp"))      # the 4 ranks sharing this rank's pp
        """
        if isinstance(dims, (str, int, np.integer)):
            dims = (dims,)
        ds = [self._dim(d) for d in dims]
        if not ds:
            raise ValueError("submesh: needs at least one dimension")
        if len(set(ds)) != len(ds):
            raise ValueError(f"submesh: repeated dimensions in {tuple(dims)}")
        coord = self._require_member("submesh")
        self._check_open("submesh")
        idx: List[Any] = list(coord)
        for d in ds:
            idx[d] = slice(None)
        sub = self.mesh[tuple(idx)]
        # The kept axes appear in increasing order after indexing; reorder as asked.
        kept = sorted(ds)
        sub = np.transpose(sub, [kept.index(d) for d in ds]).copy()
        out = object.__new__(DeviceMesh)
        out._init_view(sub, tuple(self.dim_names[d] for d in ds), self._shared, self._me)
        out._groups = [self._groups[d] for d in ds]
        out._full_dims = [self._full_dim(d) for d in ds]
        out._root = self._root_mesh()
        return out

    def _full_dim(self, d: int) -> int:
        dims = getattr(self, "_full_dims", None)
        return d if dims is None else dims[d]

    def _root_mesh(self) -> "DeviceMesh":
        return getattr(self, "_root", None) or self

    def get_subgroup(self, dim: DimKey, coordinates: Sequence[int]) -> Optional[Any]:
        """The group of ranks at ``coordinates`` along ``dim`` on this rank's line.

        Collective on first use for a given ``(dim, coordinates)``: every
        rank of the mesh's parent group must call it (then it creates one
        group per line of the full mesh, in a fixed order); later calls
        return the cached handle.  When ``coordinates`` cover the whole
        dimension in order, the dimension's own group is returned and
        nothing is created.  ``finalize_model_grads`` uses it for the group of
        the first and last pipeline stages.

        Args:
            dim: the dimension.
            coordinates: distinct coordinates along ``dim``, e.g. ``(0, size-1)``.
        Returns:
            This rank's group, or None when its coordinate is not among them
            (or it is not in the mesh).
        Raises:
            ValueError: bad dimension or coordinates.
            RingletError: the mesh was closed.

        Example::

            emb_group = mesh.get_subgroup("pp", (0, mesh.size("pp") - 1))
        """
        self._check_open("get_subgroup")
        d = self._dim(dim)
        asked = list(coordinates)
        coords = tuple(sorted({_int(c, "coordinate") for c in asked}))
        if len(coords) != len(asked) or not coords:
            raise ValueError(f"get_subgroup: coordinates must be distinct and non-empty, "
                             f"got {tuple(asked)}")
        if coords[0] < 0 or coords[-1] >= self.shape[d]:
            raise ValueError(f"get_subgroup: coordinates {coords} out of range for dimension "
                             f"{self.dim_names[d]!r} of size {self.shape[d]}")
        if coords == tuple(range(self.shape[d])):
            return self._groups[d] if self.coordinate is not None else None
        root = self._root_mesh()
        fd = self._full_dim(d)
        key = (fd, coords)
        cache = self._shared.subgroups
        if key not in cache:
            mine = None
            for line in root._lines(fd):
                members = [int(line[c]) for c in coords]
                g = new_group(members, timeout=self._shared.timeout,
                              group=self._shared.parent)
                self._shared.created.append(g)
                if self._me in members:
                    mine = g
            cache[key] = mine
        return cache[key]

    # ---- lifetime ----------------------------------------------------------------
    def close(self) -> None:
        """Release every process group the mesh created: its lines and ``get_subgroup``'s.

        Local, not collective: each rank closes its own handles (sockets,
        shared-memory segments, threads).  Call it on every rank once no rank
        will use the mesh's groups again (a barrier over the parent group
        first, when some rank may still be in an operation on them).  Calling it
        again does nothing; ``ringlet.shutdown()`` closes the groups too.
        Afterwards ``get_group``, ``get_subgroup``, ``submesh`` and DTensor
        operations on the mesh raise ``RingletError``, and group handles taken
        from it earlier fail on use.

        Raises:
            ValueError: on a sub-mesh, which owns no groups (close the mesh it
                was taken from).

        Example::

            with DeviceMesh((2, 4), ("dp", "tp")) as mesh:
                train(mesh)
                ringlet.barrier()
            # the mesh's groups are released here
        """
        if self._root_mesh() is not self:
            raise ValueError(f"DeviceMesh.close: {self!r} is a sub-mesh and shares its groups "
                             f"with the mesh it was taken from; close that mesh instead")
        if self._shared.closed:
            return
        self._shared.closed = True
        self._groups = [None] * self.ndim
        self._shared.release()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has released the mesh's groups."""
        return self._shared.closed

    def __enter__(self) -> "DeviceMesh":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- printing ----------------------------------------------------------------
    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"DeviceMesh({dims}; ranks {self.mesh.reshape(-1).tolist()})"
