"""``FullyShardedDataParallel`` (alias ``FSDP``): shard parameters, gradients and optimizer state.

How it works (details and measurements: docs/fsdp.md):

- **Units.**  The model is cut into units: by default every child of a
  ``Sequential`` that holds parameters, plus the root for whatever is left;
  or a user policy (``auto_wrap``).  A unit's parameters, grouped by dtype
  (and by ``requires_grad``), become one flat buffer padded to a multiple of
  the shard count S (``_flat.FlatLayout``), so no parameter size needs to
  divide S.  Each rank keeps only its shard, as an ``nn.Parameter``: that is
  what ``fsdp.parameters()`` yields and what ``ringlet.optim`` updates, so the
  optimizer state is sharded as well.
- **Forward.**  Each unit is replaced in its parent by a wrapper module.  When
  it runs, its shard is all-gathered into a fresh flat buffer whose slices
  become the original parameters' ``.data``; after the unit's forward the
  buffer is dropped (FULL_SHARD, HYBRID_SHARD) or kept until the unit's
  backward (SHARD_GRAD_OP).  With ``prefetch`` the next unit's all-gather is
  issued asynchronously before the current unit computes.
- **Backward.**  The unit is re-gathered if needed (prefetched in backward
  order), its parameters' ``.grad`` become views into one flat full-size
  gradient buffer, and once the unit's backward is complete (every forward of
  it back-propagated) the buffer is reduce-scattered (``ReduceOp.AVG``)
  asynchronously into a shard-sized buffer that is added to the shard's
  ``.grad``.  HYBRID_SHARD then all-reduces that shard across the replica
  group; NO_SHARD (S = 1) just all-reduces.  Those all-reduces are DDP's:
  a ``GradBucket`` started with its default hook (``_buckets``), so NO_SHARD
  is DDP with one bucket per unit.  ``fsdp.backward`` returns when
  every reduction has finished, so the optimizer may step right after.
- Collectives are issued in program order, identical on every rank, on the
  shard group (gathers, reduce-scatters) and the replica group (all-reduces),
  whose async operations run in issue order.  They live in
  ``_fsdp_collectives``; this file holds the wrapper and its unit hooks.

Why not parameter ready hooks: the wrapper knows exactly when its unit's
backward is complete (forward count back to zero), including parameters that
got no gradient, for which ready hooks never fire.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections import OrderedDict, deque
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

import numpy as np

import ringlet
from ringlet import nn

from . import _fsdp_collectives as _col
from . import _fsdp_state_dict as _sd
from ._flat import MemoryTracker
from ._fsdp_flat_group import _NUMPY_FLOATS, _FlatGroup, _Pending
from ._fsdp_init import check_policy, own_params, plan_units, state_entries
from ._fsdp_groups import _Grp, _hybrid_groups, _mesh_group
from ._fsdp_unit import _WRAPPED, _FSDPUnit
from ._replicas import broadcast_packed, gather_layouts, layout_digest

__all__ = ["FullyShardedDataParallel", "FSDP", "ShardingStrategy", "MixedPrecision"]

_NORM_CHUNK = 1 << 20  # elements widened to float64 at a time by clip_grad_norm_


class ShardingStrategy(enum.Enum):
    """What is sharded across the data-parallel ranks.

    - ``FULL_SHARD``: parameters, gradients and optimizer state (ZeRO-3); full
      parameters exist only while their unit runs.
    - ``SHARD_GRAD_OP``: gradients and optimizer state (ZeRO-2); a unit's full
      parameters are kept from its forward until its backward.
    - ``NO_SHARD``: nothing; gradients are all-reduced (like DDP).
    - ``HYBRID_SHARD``: FULL_SHARD inside a shard group, replicated across
      groups (gradient shards are all-reduced over the replica group).
    """

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"


def _low_dtype(d: Any, what: str) -> Optional[np.dtype]:
    if d is None:
        return None
    if isinstance(d, str) and d == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError(f"{what}: bfloat16 needs the ml_dtypes package "
                              f"(pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(d)
    except TypeError:
        raise TypeError(f"{what}: {d!r} is not a numpy dtype") from None
    if dt in _NUMPY_FLOATS or (dt.name == "bfloat16" and dt.itemsize == 2):
        return dt
    raise TypeError(f"{what} must be float16, bfloat16, float32 or float64, got {dt}")


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Low-precision parameters and gradient reduction; shards and optimizer stay as they are.

    Args:
        param_dtype: dtype in which full parameters are all-gathered and the
            unit computes (float16: numpy computes in float16).  bfloat16
            (``ml_dtypes.bfloat16`` or ``"bfloat16"``) is gathered in bfloat16
            and then widened to float32 for compute, because numpy has no
            bfloat16 kernels: the values are bfloat16-rounded, the arithmetic
            float32.  None: the shard's dtype.
        reduce_dtype: dtype of the gradient reduce-scatter/all-reduce.  None:
            the dtype the gradients were computed in.
    Raises:
        TypeError: a dtype that is not float16/bfloat16/float32/float64.

    Example::

        FSDP(model, mixed_precision=MixedPrecision(param_dtype=np.float16,
                                                   reduce_dtype=np.float32))
    """

    param_dtype: Any = None
    reduce_dtype: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", _low_dtype(self.param_dtype,
                                                           "MixedPrecision.param_dtype"))
        object.__setattr__(self, "reduce_dtype", _low_dtype(self.reduce_dtype,
                                                            "MixedPrecision.reduce_dtype"))


# ---- the wrapper ------------------------------------------------------------------------------
class FullyShardedDataParallel:
    """Shard a ``ringlet.nn`` model's parameters, gradients and optimizer state over ranks.

    Every rank of the group(s) constructs it with the same model structure and
    options.  The module's parameters are replaced by shards (the module is
    changed in place: its units are wrapped, its parameters' ``.data`` are
    empty outside their unit's forward and backward).  Build the optimizer on
    ``fsdp.parameters()``, call ``fsdp(x)`` and ``fsdp.backward(grad)``, then
    ``opt.step()``: gradients on the shards are the mean over all ranks.

    Args:
        module: the model, fully materialised on every rank (rank 0's values
            win with ``sync_module_states``).
        group: process group to shard over (None: the world).  HYBRID_SHARD:
            a ``(shard_group, replicate_group)`` pair, or the parent group to
            split with ``shard_size``.
        strategy: a ``ShardingStrategy`` (or its name).
        auto_wrap: how units are chosen: ``"sequential"`` (default: each
            child of any ``nn.Sequential``), None (one unit: the whole model),
            a tuple of ``Module`` classes (each instance is a unit), or a
            callable ``policy(name, module) -> bool``.  Modules with no
            parameters of their own never become units.
        prefetch: issue the next unit's all-gather asynchronously (forward and
            backward order, as recorded in the previous pass) before
            computing the current one.
        mixed_precision: a ``MixedPrecision``, or None.
        mesh: instead of ``group``: an object with ``get_group(dim)``; 1-D for
            FULL_SHARD/SHARD_GRAD_OP/NO_SHARD, 2-D (dim 0 replicate, dim 1
            shard) for HYBRID_SHARD.
        shard_size: HYBRID_SHARD without groups: shard inside consecutive
            blocks of this many ranks of ``group`` (every rank creates all
            sub-groups, in the same order).
        sync_module_states: broadcast rank 0's parameters and buffers at
            construction.
        broadcast_buffers: broadcast rank 0's buffers (batch-norm statistics)
            at every forward, so buffers stay replicated.
        overlap_reduce: let a unit's gradient reduction run while the next
            unit's backward computes (True), or finish it first (False: at most
            one unit's full gradient exists; with ``prefetch=False`` a rank
            holds at most one unit's full parameters and gradients).
    Raises:
        TypeError/ValueError: bad arguments, a parameter shared between two
            units, ranks whose models/options differ, groups that do not form
            a shard x replica grid, or a rank outside the group.

    Example::

        ringlet.init()
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
        fsdp = FSDP(model)                                 # FULL_SHARD
        opt = ringlet.optim.AdamW(fsdp.parameters(), lr=1e-3)
        for x, y in local_batches:
            opt.zero_grad()
            loss, g = nn.cross_entropy(fsdp(x), y)
            fsdp.backward(g)                               # gradients reduced and sharded
            opt.step()
    """

    def __init__(self, module: nn.Module, *, group: Any = None,
                 strategy: Any = ShardingStrategy.FULL_SHARD, auto_wrap: Any = "sequential",
                 prefetch: bool = True, mixed_precision: Optional[MixedPrecision] = None,
                 mesh: Any = None, shard_size: Optional[int] = None,
                 sync_module_states: bool = True, broadcast_buffers: bool = True,
                 overlap_reduce: bool = True) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP: module must be a ringlet.nn.Module, got "
                            f"{type(module).__name__}")
        if any(isinstance(m, _FSDPUnit) for m in module.modules()):
            raise ValueError("FSDP: the module is already wrapped by FSDP")
        self.strategy = self._check_strategy(strategy)
        for flag, v in (("prefetch", prefetch), ("overlap_reduce", overlap_reduce)):
            if not isinstance(v, bool):
                raise TypeError(f"FSDP: {flag} must be a bool, got {type(v).__name__}")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(f"FSDP: mixed_precision must be a MixedPrecision or None, got "
                            f"{type(mixed_precision).__name__}")
        policy = check_policy(auto_wrap)
        self.module = module
        self.prefetch = prefetch
        self.overlap_reduce = overlap_reduce
        self.mixed_precision = mixed_precision
        self.broadcast_buffers = bool(broadcast_buffers)
        self.sync_module_states = bool(sync_module_states)
        self._resolve_groups(group, mesh, shard_size)
        self.reshard_after_forward = self.strategy in (ShardingStrategy.FULL_SHARD,
                                                       ShardingStrategy.HYBRID_SHARD)
        self.memory = MemoryTracker()
        self.stats: Dict[str, float] = {}
        self.reset_stats()

        # Names are taken from the model as given, before any wrapping.
        self._entries = state_entries(module)
        # A plan or build that fails here (a user policy, shared parameters) joins the
        # agreement below, so every rank raises instead of the others waiting in it.
        failed: Optional[BaseException] = None
        try:
            units = plan_units(module, policy)
            self._build(module, units)
        except Exception as exc:  # re-raised by _verify, after the agreement
            failed = exc
        self._verify(failed)
        self._materialise_shards(self.sync_module_states)
        self._wrap(module)

        self._pending: Deque[_Pending] = deque()
        self._no_sync_depth = 0
        self._require_sync = True
        self._in_call = 0
        self._fwd_order_cur: List[_FSDPUnit] = []
        self._fwd_order_prev: List[_FSDPUnit] = list(self._units)  # registration order first
        self._bwd_order_cur: List[_FSDPUnit] = []
        self._bwd_order_prev: Optional[List[_FSDPUnit]] = None
        # After a backward that raised: why, and what it left that only zero_grad() clears.
        self._failed: Optional[str] = None
        self._failed_lost = False
        self._failed_inplace: List[_FlatGroup] = []
        self.memory.reset_peak()

    # ---- construction ----------------------------------------------------------------------
    @staticmethod
    def _check_strategy(strategy: Any) -> ShardingStrategy:
        if isinstance(strategy, ShardingStrategy):
            return strategy
        if isinstance(strategy, str):
            try:
                return ShardingStrategy[strategy.upper()]
            except KeyError:
                pass
        raise ValueError(f"FSDP: strategy must be a ShardingStrategy "
                         f"({', '.join(s.name for s in ShardingStrategy)}), got {strategy!r}")

    def _resolve_groups(self, group: Any, mesh: Any, shard_size: Any) -> None:
        st = self.strategy
        if mesh is not None and group is not None:
            raise ValueError("FSDP: pass either group or mesh, not both")
        if st is ShardingStrategy.HYBRID_SHARD:
            if mesh is not None:
                ndim = getattr(mesh, "ndim", 2)
                if ndim != 2:
                    raise ValueError(f"FSDP: HYBRID_SHARD needs a 2-D mesh (replicate, shard), "
                                     f"got {ndim} dimensions")
                sg, rg = _mesh_group(mesh, 1), _mesh_group(mesh, 0)
            elif isinstance(group, (tuple, list)):
                if len(group) != 2:
                    raise ValueError("FSDP: HYBRID_SHARD group must be a (shard_group, "
                                     "replicate_group) pair")
                sg, rg = group
                if shard_size is not None:
                    raise ValueError("FSDP: give shard_size or a pair of groups, not both")
            elif shard_size is not None:
                sg, rg = _hybrid_groups(group, shard_size)
            else:
                raise ValueError("FSDP: HYBRID_SHARD needs a (shard_group, replicate_group) "
                                 "pair, a 2-D mesh, or shard_size")
            self._shard = _Grp.of(sg, "the shard group")
            rep = _Grp.of(rg, "the replicate group")
            self._replicate: Optional[_Grp] = rep if rep.size > 1 else None
            if set(self._shard.ranks) & set(rep.ranks) != {self._shard.ranks[self._shard.rank]}:
                raise ValueError(f"FSDP: the shard group (world ranks {self._shard.ranks}) and "
                                 f"the replicate group (world ranks {rep.ranks}) must share "
                                 f"exactly this rank")
        else:
            if shard_size is not None:
                raise ValueError(f"FSDP: shard_size is for HYBRID_SHARD, not {st.name}")
            if isinstance(group, (tuple, list)):
                raise ValueError(f"FSDP: a pair of groups is for HYBRID_SHARD, not {st.name}")
            if mesh is not None:
                if getattr(mesh, "ndim", 1) != 1:
                    raise ValueError(f"FSDP: {st.name} needs a 1-D mesh; use HYBRID_SHARD for "
                                     f"a 2-D one")
                group = _mesh_group(mesh, 0)
            dp = _Grp.of(group, "group")
            if st is ShardingStrategy.NO_SHARD:
                self._shard = _Grp(None, 1, 0, [dp.ranks[dp.rank]])
                self._replicate = dp if dp.size > 1 else None
            else:
                self._shard, self._replicate = dp, None
        S = self._shard.size
        R = self._replicate.size if self._replicate is not None else 1
        self.shard_world_size, self.replicate_world_size = S, R
        self.world_size = S * R
        self.rank = (self._replicate.rank if self._replicate is not None else 0) * S \
            + self._shard.rank

    def _build(self, root: nn.Module, units: List[Tuple[str, nn.Module]]) -> None:
        first_name: Dict[int, str] = {}
        for kind, name, *rest in self._entries:
            if kind == "param":
                first_name.setdefault(id(rest[0]), name)
        unit_ids = {id(m): n for n, m in units}
        self._units: List[_FSDPUnit] = []
        owner_of: Dict[int, str] = {}
        wrappers: Dict[int, _FSDPUnit] = {}
        for name, m in [("", root)] + units:
            w = _FSDPUnit(self, m, name, is_root=m is root)
            owned = own_params(m, {k: v for k, v in unit_ids.items() if k != id(m)})
            by_key: "OrderedDict[Tuple[str, bool], List[nn.Parameter]]" = OrderedDict()
            index: Dict[int, Tuple[Tuple[str, bool], int]] = {}
            for mod, attr, p in owned:
                if id(p) in owner_of and owner_of[id(p)] != name:
                    raise ValueError(
                        f"FSDP: parameter '{first_name.get(id(p), attr)}' is shared by units "
                        f"'{owner_of[id(p)] or '<root>'}' and '{name or '<root>'}'; put the "
                        f"modules sharing it in one unit (adjust auto_wrap)")
                owner_of[id(p)] = name
                key = (p.dtype.str, bool(p.requires_grad))
                lst = by_key.setdefault(key, [])
                if id(p) not in index:
                    index[id(p)] = (key, len(lst))
                    lst.append(p)
            groups: Dict[Tuple[str, bool], _FlatGroup] = {}
            for gi, (key, params) in enumerate(by_key.items()):
                base = f"{name}.flat_param" if name else "flat_param"
                fg_name = base if len(by_key) == 1 else f"{base}_{gi}"
                fg = _FlatGroup(fg_name, params, [first_name.get(id(p), "?") for p in params],
                                np.dtype(key[0]), key[1], self._shard.size, self._shard.rank,
                                self.mixed_precision)
                groups[key] = fg
                w.flat_groups.append(fg)
            for mod, attr, p in owned:
                key, i = index[id(p)]
                groups[key].bindings.append((mod, attr, i))
            if m is root:
                self._root = w
            self._units.append(w)
            wrappers[id(m)] = w
        self._wrappers = wrappers
        self._groups: List[_FlatGroup] = [fg for u in self._units for fg in u.flat_groups]
        for i, fg in enumerate(self._groups):
            fg.index = i
        if not self._groups:
            raise ValueError("FSDP: the module has no parameters")

    def _describe(self) -> str:
        mp = self.mixed_precision
        units = [(u.unit_name, [(fg.dtype.str, fg.requires_grad,
                                 [(n, p.shape) for n, p in zip(fg.names, fg.params)])
                                for fg in u.flat_groups]) for u in self._units]
        bufs = [(n, b.shape, str(b.dtype)) for n, b in self.module.named_buffers()]
        return repr((self.strategy.name, self.shard_world_size, self.replicate_world_size,
                     None if mp is None else (str(mp.param_dtype), str(mp.reduce_dtype)),
                     self.prefetch, self.overlap_reduce, self.broadcast_buffers,
                     self.sync_module_states, units, [e[1] for e in self._entries], bufs))

    def _verify(self, failed: Optional[BaseException] = None) -> None:
        """All ranks must agree on model layout and options, and the groups must form a grid.

        ``failed``: this rank's planning failed; it takes part, then raises that error.
        """
        digest = layout_digest(self._describe()) if failed is None else "failed"
        problems: List[str] = []
        sh, rep = self._shard, self._replicate
        R = rep.size if rep is not None else 1
        rrank = rep.rank if rep is not None else 0
        if sh.size > 1:
            got = gather_layouts(digest, sh.pg, R, rrank)
            bad = [sh.ranks[i] for i, g in enumerate(got) if g[0] != digest]
            if bad:
                problems.append(f"world ranks {bad} of the shard group {sh.ranks} built a "
                                f"different model (names, shapes, dtypes, units) or different "
                                f"FSDP options than world rank {sh.ranks[sh.rank]}")
            if any(g[1] != R or g[2] != rrank for g in got):
                problems.append(f"the shard group {sh.ranks} mixes ranks of different replica "
                                f"positions/sizes {[tuple(g[1:]) for g in got]}; shard and "
                                f"replicate groups must form a grid")
        if rep is not None:
            got = gather_layouts(digest, rep.pg, sh.size, sh.rank)
            bad = [rep.ranks[i] for i, g in enumerate(got) if g[0] != digest]
            if bad:
                problems.append(f"world ranks {bad} of the replicate group {rep.ranks} built a "
                                f"different model or different FSDP options than world rank "
                                f"{rep.ranks[rep.rank]}")
            if any(g[1] != sh.size or g[2] != sh.rank for g in got):
                problems.append(f"the replicate group {rep.ranks} holds ranks with different "
                                f"shard positions/sizes {[tuple(g[1:]) for g in got]}; shard "
                                f"and replicate groups must form a grid (each replicate group "
                                f"the same shard index of every shard group)")
        # One flag reduced over both groups, so every rank raises, not just some.
        flag = np.array([1 if problems else 0], np.int32)
        if sh.size > 1:
            ringlet.all_reduce(flag, ringlet.ReduceOp.MAX, group=sh.pg)
        if rep is not None:
            ringlet.all_reduce(flag, ringlet.ReduceOp.MAX, group=rep.pg)
        if sh.size > 1 and rep is not None:
            ringlet.all_reduce(flag, ringlet.ReduceOp.MAX, group=sh.pg)
        if failed is not None:
            raise failed
        if problems:
            raise ValueError("FSDP: ranks disagree: " + "; ".join(problems))
        if int(flag[0]):
            raise ValueError("FSDP: other ranks found a mismatch in model layout, options or "
                             "groups (see their errors); construct FSDP identically everywhere")

    def _bcast_array(self, a: np.ndarray) -> None:
        """Broadcast ``a`` from data-parallel rank 0 to every rank, in place."""
        sh, rep = self._shard, self._replicate
        if sh.size > 1 and (rep is None or rep.rank == 0):
            ringlet.broadcast(a, 0, group=sh.pg)
        if rep is not None:
            ringlet.broadcast(a, 0, group=rep.pg)

    def _bcast_object(self, obj: Any) -> Any:
        sh, rep = self._shard, self._replicate
        if sh.size > 1 and (rep is None or rep.rank == 0):
            obj = ringlet.broadcast_object(obj, 0, group=sh.pg)
        if rep is not None:
            obj = ringlet.broadcast_object(obj, 0, group=rep.pg)
        return obj

    def _materialise_shards(self, sync: bool) -> None:
        for fg in self._groups:
            # One unit's full buffer at a time.
            full = fg.layout.pack([p.data for p in fg.params], fg.dtype)
            if sync and self.world_size > 1:
                self._bcast_array(full)
            lo, hi = fg.layout.shard_bounds(fg.shard_rank)
            data = full if fg.layout.shards == 1 else full[lo:hi].copy()
            fg.shard = nn.Parameter(data, requires_grad=fg.requires_grad)
            self.memory.track("sharded_params", data)
            for i, p in enumerate(fg.params):
                p.grad = None
                p.data = fg.sentinels[i]
            if fg.permanent:
                _col.bind(fg, data)
        if sync and self.world_size > 1:
            self._broadcast_buffers_now()

    def _wrap(self, root: nn.Module) -> None:
        for m in list(root.modules()):
            for attr, c in list(m._modules.items()):
                if c is not None and c is not root and id(c) in self._wrappers:
                    m._modules[attr] = self._wrappers[id(c)]

    # ---- buffers ------------------------------------------------------------------------------
    def _live_buffers(self) -> List[np.ndarray]:
        out, seen = [], set()
        for e in self._entries:
            if e[0] == "buffer":
                b = e[2]._buffers.get(e[3])
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    out.append(b)
        return out

    def _broadcast_buffers_now(self) -> None:
        broadcast_packed(self._live_buffers(), self._bcast_array, is_src=self.rank == 0)

    # ---- unit hooks (called by the wrappers) ----------------------------------------------------
    def _check_in_call(self, what: str) -> None:
        if not self._in_call:
            raise RuntimeError(f"FSDP: a unit's {what} ran outside the FSDP wrapper; call "
                               f"fsdp(x) and fsdp.backward(grad), not fsdp.module directly")

    def _unit_forward(self, u: _FSDPUnit, args: tuple, kwargs: dict) -> Any:
        self._check_in_call("forward")
        if u not in self._fwd_order_cur:
            self._fwd_order_cur.append(u)
        grad = nn.is_grad_enabled()
        _col.gather_unit(self, u)
        _col.prefetch(self, u, backward=False)
        ok = False
        try:
            out = getattr(u, "_modules")[_WRAPPED](*args, **kwargs)
            ok = True
        finally:
            if ok and grad:
                object.__setattr__(u, "fwd_pending", u.fwd_pending + 1)
            if u.fwd_pending == 0 or (self.reshard_after_forward and not u.is_root):
                for fg in u.flat_groups:
                    _col.free_full(self, fg)
        return out

    def _unit_backward(self, u: _FSDPUnit, grad_output: Any) -> Any:
        self._check_in_call("backward")
        if u.fwd_pending == 0:
            raise RuntimeError(f"FSDP: backward of unit '{u.unit_name or '<root>'}' without a "
                               f"matching forward (it ran under no_grad(), or backward was "
                               f"called more often than forward)")
        if u not in self._bwd_order_cur:
            self._bwd_order_cur.append(u)
        # At most one earlier unit's reduction stays in flight while this unit
        # allocates its gradient (none without overlap_reduce): full gradients
        # never exceed two units (one).
        _col.progress(self, block=True, keep=1 if self.overlap_reduce else 0)
        _col.gather_unit(self, u)
        _col.prefetch(self, u, backward=True)
        for fg in u.flat_groups:
            if fg.requires_grad:
                _col.prepare_grads(self, fg)
        gin = getattr(u, "_modules")[_WRAPPED].backward(grad_output)
        object.__setattr__(u, "fwd_pending", u.fwd_pending - 1)
        if u.fwd_pending == 0:
            for fg in u.flat_groups:
                if fg.requires_grad:
                    _col.reduce_grads(self, fg)
                _col.free_full(self, fg)
        _col.progress(self, block=False)
        return gin

    # ---- public API -----------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model; units gather their parameters as they run.

        A forward started while no backward is outstanding begins a new
        iteration: parameters left gathered by an abandoned forward are
        dropped first (the optimizer may have changed the shards).
        """
        if self._root.fwd_pending == 0:
            self._start_iteration()
            if self._failed is not None and nn.is_grad_enabled():
                self._check_after_failure()
        if nn.is_grad_enabled():
            self._require_sync = self._no_sync_depth == 0
        if self.broadcast_buffers and self.world_size > 1:
            self._broadcast_buffers_now()
        self._fwd_order_cur = []
        self._in_call += 1
        try:
            out = self._root(*args, **kwargs)
        finally:
            self._in_call -= 1
        self._fwd_order_prev = self._fwd_order_cur
        return out

    def backward(self, grad_output: Any) -> Any:
        """Back-propagate through the oldest outstanding forward; returns the input gradient.

        Gradient reductions overlap the backward pass; this returns once they
        have all finished, so ``fsdp.parameters()`` hold the mean gradient over
        all ranks (added to what they held, as with plain backward).

        If it raises part-way (a layer's error), the failed pass is dropped:
        its saved contexts, the outstanding forwards, and the unit gradients
        not yet reduced, so they never join a later reduction.  Reductions
        already started are completed first and add to the shard gradients,
        as plain backward leaves partial ``.grad``: call ``zero_grad`` before
        redoing the step.
        Where dropping lost more than the failed pass (gradients accumulated
        under ``no_sync`` or by earlier forwards; NO_SHARD's in-place
        gradients), the next forward raises until ``fsdp.zero_grad()``.

        Raises:
            RuntimeError: no forward (with gradients enabled) to back-propagate.
        """
        if self._root.fwd_pending == 0:
            raise RuntimeError("FSDP.backward: no forward to back-propagate (call fsdp(x) "
                               "with gradients enabled first; forwards under no_grad() save "
                               "nothing)")
        # Unreduced gradients from before this backward (no_sync, earlier forwards in flight).
        had_accum = any(fg.grad_full is not None and not fg.permanent for fg in self._groups)
        self._bwd_order_cur = []
        self._in_call += 1
        try:
            gin = self._root.backward(grad_output)
        except BaseException as exc:
            self._in_call -= 1
            self._drop_failed_pass(exc, had_accum)
            raise
        self._in_call -= 1
        self._bwd_order_prev = self._bwd_order_cur
        _col.progress(self, block=True)
        if self._root.fwd_pending == 0:
            for fg in self._groups:  # backward prefetches that found no taker
                _col.free_full(self, fg)
        return gin

    def _drop_failed_pass(self, exc: BaseException, had_accum: bool) -> None:
        # Local: this may be the only rank that failed.  It only completes the
        # reductions already started (every rank started them, in this order).
        self.module.clear_context()  # else the next backward would consume them first
        inplace = []
        for fg in self._groups:
            if fg.grad_full is None:
                continue
            for p in fg.params:
                p.grad = None
            if fg.permanent:  # NO_SHARD: the gradients went straight into the shard's
                inplace.append(fg)
            else:
                self.memory.release(fg.grad_full)
            fg.grad_full = None
        try:
            # Land the reductions already started now, not after the caller's
            # zero_grad(); free the gathered parameters (and unused prefetches).
            self._start_iteration()
        except Exception:  # noqa: BLE001 - a failed group reports it at its next call
            pass
        for u in self._units:
            object.__setattr__(u, "fwd_pending", 0)
        self._failed = f"{type(exc).__name__}: {exc}"[:300]
        self._failed_lost = self._failed_lost or had_accum
        self._failed_inplace = list({id(fg): fg for fg in self._failed_inplace + inplace}
                                    .values())

    def _check_after_failure(self) -> None:
        dirty = [fg.name for fg in self._failed_inplace
                 if fg.shard.grad is not None and fg.shard.grad.any()]
        if not self._failed_lost and not dirty:
            self._failed, self._failed_inplace = None, []
            return
        what = []
        if self._failed_lost:
            what.append("the gradients accumulated before it (under no_sync() or by earlier "
                        "forwards) shared the dropped buffers and are lost")
        if dirty:
            what.append(f"NO_SHARD gradients {dirty} still hold its unreduced partial "
                        f"gradients")
        raise RuntimeError(f"FSDP: the previous backward raised part-way ({self._failed}); "
                           f"its pass was dropped, but {' and '.join(what)}. Call "
                           f"fsdp.zero_grad() on every rank before the next forward, then "
                           f"redo the step")

    def _start_iteration(self) -> None:
        _col.progress(self, block=True)
        for u in self._units:
            object.__setattr__(u, "fwd_pending", 0)
            for fg in u.flat_groups:
                _col.free_full(self, fg)

    def clear_context(self) -> None:
        """Abandon outstanding forwards: drop saved contexts and gathered parameters.

        Accumulated ``no_sync`` gradients are kept.
        """
        self.module.clear_context()
        self._start_iteration()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager: forwards inside it skip gradient reduction (gradient accumulation).

        Their gradients accumulate in each unit's full-size gradient buffer
        (which therefore stays allocated); the first iteration outside reduces
        the sum.  Every rank must use it identically.

        Example::

            with fsdp.no_sync():
                fsdp.backward(nn.mse_loss(fsdp(x0), y0)[1])
            fsdp.backward(nn.mse_loss(fsdp(x1), y1)[1])   # reduces both
            opt.step()
        """
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's shard parameters (flat, 1-D): give these to the optimizer."""
        for fg in self._groups:
            yield fg.shard  # type: ignore[misc]

    def named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        """(name, shard) pairs, e.g. ``("0.flat_param", Parameter(shape=(n,)))``."""
        for fg in self._groups:
            yield fg.name, fg.shard  # type: ignore[misc]

    def zero_grad(self) -> None:
        """Zero the shard gradients (and gradients accumulated under ``no_sync``) in place.

        Also acknowledges a backward that raised part-way (see ``backward``).
        """
        self._failed, self._failed_lost, self._failed_inplace = None, False, []
        for fg in self._groups:
            if fg.shard.grad is not None:
                fg.shard.grad[...] = 0
            if fg.grad_full is not None:
                fg.grad_full[...] = 0

    def train(self, mode: bool = True) -> "FullyShardedDataParallel":
        self.module.train(mode)
        return self

    def eval(self) -> "FullyShardedDataParallel":
        self.module.eval()
        return self

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the shard gradients so their global L2 norm is at most ``max_norm``.

        Collective over the shard group.  Returns the norm before clipping.
        The sum of squares is accumulated in float64, widening at most
        ``_NORM_CHUNK`` elements at a time (no float64 copy of a whole shard).

        Raises:
            ValueError: ``max_norm`` is not a positive number.
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float, np.floating)) \
                or not max_norm > 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be a positive number, got "
                             f"{max_norm!r}")
        _col.progress(self, block=True)
        sq = np.zeros(1, np.float64)
        wide: Optional[np.ndarray] = None  # one float64 chunk, reused
        for fg in self._groups:
            g = fg.shard.grad
            if g is None:
                continue
            if g.dtype == np.float64:  # no copy needed
                sq[0] += float(np.dot(g, g))
                continue
            for lo in range(0, g.size, _NORM_CHUNK):
                c = g[lo:lo + _NORM_CHUNK]
                if wide is None or wide.size < c.size:
                    wide = np.empty(c.size, np.float64)
                w = wide[:c.size]
                np.copyto(w, c, casting="unsafe")
                sq[0] += float(np.dot(w, w))
        if self._shard.size > 1:  # replicas hold identical shards: sum over one copy
            ringlet.all_reduce(sq, ringlet.ReduceOp.SUM, group=self._shard.pg)
        norm = float(np.sqrt(sq[0]))
        scale = float(max_norm) / (norm + 1e-6)
        if scale < 1.0:
            for fg in self._groups:
                if fg.shard.grad is not None:
                    fg.shard.grad *= fg.shard.grad.dtype.type(scale)
        return norm

    # ---- state dicts (``_fsdp_state_dict``) ----------------------------------------------------
    def full_state_dict(self, *, rank0_only: bool = True) -> "OrderedDict[str, np.ndarray]":
        """The whole model's parameters and buffers, keys as the unwrapped model's ``state_dict``.

        Collective.  Gathered one unit at a time into a temporary buffer, so at
        most the result plus one unit's parameters exist at once.

        Args:
            rank0_only: only data-parallel rank 0 gets the arrays (others get
                an empty dict and allocate nothing full-sized).
        Returns:
            OrderedDict name -> array (copies), loadable into the unwrapped model.

        Example::

            sd = fsdp.full_state_dict()
            if ringlet.get_rank() == 0:
                plain_model.load_state_dict(sd)
        """
        return _sd.full_state_dict(self, rank0_only=rank0_only)

    def sharded_state_dict(self) -> "OrderedDict[str, Any]":
        """This rank's part of the model for ``ringlet.checkpoint.save``/``load``.

        Parameters are ``ShardedTensor``s whose local arrays are *views* of the
        shard (``ShardSpec.flat``: this rank's flat range of each parameter,
        empty where the shard misses it), so ``ringlet.checkpoint.load`` fills
        the shards in place.  NO_SHARD gives plain arrays (views too), buffers
        are the live arrays.

        Example::

            ringlet.checkpoint.save({"model": fsdp.sharded_state_dict()}, "ckpt")
            ringlet.checkpoint.load({"model": fsdp.sharded_state_dict()}, "ckpt")
        """
        return _sd.sharded_state_dict(self)

    def load_full_state_dict(self, state_dict: Any, *, rank0_only: bool = False,
                             strict: bool = True) -> nn.IncompatibleKeys:
        """Load a full (unsharded) state dict, e.g. from ``full_state_dict`` or a plain model.

        Every entry is checked before anything changes.  Collective when
        ``rank0_only`` (rank 0's dict is broadcast one unit at a time; other
        ranks may pass None).

        Returns:
            ``IncompatibleKeys(missing_keys, unexpected_keys)``.
        Raises:
            TypeError: not a mapping.  KeyError: key mismatch under ``strict``.
            ValueError: a shape or dtype differs (raised on every rank with
            ``rank0_only``).
        """
        return _sd.load_full_state_dict(self, state_dict, rank0_only=rank0_only, strict=strict)

    def load_sharded_state_dict(self, state_dict: Any, *, strict: bool = True
                                ) -> nn.IncompatibleKeys:
        """Load what ``sharded_state_dict`` describes (e.g. after ``ringlet.checkpoint.load``).

        Parameters may be ``ShardedTensor``s with this rank's specs or full
        arrays (this rank's part is taken).  Not collective.

        Raises:
            TypeError/KeyError/ValueError: wrong type, keys, spec, shape or dtype.
        """
        return _sd.load_sharded_state_dict(self, state_dict, strict=strict)

    # ---- statistics ----------------------------------------------------------------------------
    def memory_stats(self) -> Dict[str, int]:
        """Bytes in FSDP's buffers by category, current and peak (see ``_flat.CATEGORIES``)."""
        return self.memory.stats()

    def reset_peak_memory_stats(self) -> None:
        self.memory.reset_peak()

    def reset_stats(self) -> None:
        """Zero the communication counters: ``gather_wait_s`` (time blocked on all-gathers,
        i.e. exposed gather time), ``reduce_wait_s``, operation counts, and
        ``prefetches`` (all-gathers issued ahead of their unit)."""
        self.stats = {"gather_wait_s": 0.0, "reduce_wait_s": 0.0, "all_gathers": 0,
                      "prefetches": 0, "reduce_scatters": 0, "all_reduces": 0}

    @property
    def units(self) -> List[str]:
        """Names of the units ("" is the root), in registration order."""
        return [u.unit_name for u in self._units]

    def __repr__(self) -> str:
        n = sum(fg.layout.numel for fg in self._groups)
        return (f"FullyShardedDataParallel(strategy={self.strategy.name}, world_size="
                f"{self.world_size}, shard_size={self.shard_world_size}, units={len(self._units)}, "
                f"numel={n}, prefetch={self.prefetch})")


FSDP = FullyShardedDataParallel
