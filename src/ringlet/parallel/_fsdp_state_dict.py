"""State dicts of ``FullyShardedDataParallel``: full (gathered unit by unit) and sharded.

Free functions of the wrapper, kept apart from its runtime (``fsdp.py``);
``FullyShardedDataParallel``'s methods of the same names call them.  Keys are
those of the unwrapped model's ``state_dict()`` (a tied parameter under each
of its names), so a full state dict loads into a plain model and back, and a
sharded one goes through ``ringlet.checkpoint`` in any layout
(docs/checkpoint.md, docs/fsdp.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Tuple

import numpy as np

import ringlet
from ringlet import nn

from . import _fsdp_collectives as _col
from ._fsdp_flat_group import _FlatGroup

__all__: List[str] = []


def _between_iterations(fsdp: Any, what: str) -> None:
    if fsdp._root.fwd_pending:
        raise RuntimeError(f"FSDP.{what}: call it between iterations, not while a forward "
                           f"awaits its backward")
    _col.progress(fsdp, block=True)

def _param_keys(fsdp: Any) -> Dict[int, List[str]]:
    keys: Dict[int, List[str]] = {}
    for e in fsdp._entries:
        if e[0] == "param":
            keys.setdefault(id(e[2]), []).append(e[1])
    return keys

def full_state_dict(fsdp: Any, *, rank0_only: bool = True) -> "OrderedDict[str, np.ndarray]":
    """``FullyShardedDataParallel.full_state_dict`` (its docstring has the contract)."""
    _between_iterations(fsdp, "full_state_dict")
    sh, rep = fsdp._shard, fsdp._replicate
    receives = fsdp.rank == 0 or not rank0_only
    values: Dict[int, np.ndarray] = {}
    for fg in fsdp._groups:
        full = None
        if sh.size == 1:
            full = fg.shard.data
        elif not rank0_only:
            full = fsdp.memory.alloc("comm", fg.layout.padded, fg.dtype)
            ringlet.all_gather(full, fg.shard.data, group=sh.pg)
        elif rep is None or rep.rank == 0:  # only the shard group holding rank 0
            if sh.rank == 0:
                full = fsdp.memory.alloc("comm", fg.layout.padded, fg.dtype)
            ringlet.gather(full, fg.shard.data, 0, group=sh.pg)
        if receives and full is not None:
            for p, v in zip(fg.params, fg.layout.views(full)):
                values[id(p)] = v.copy()
        if full is not None and full is not fg.shard.data:
            fsdp.memory.release(full)
    out: "OrderedDict[str, np.ndarray]" = OrderedDict()
    if not receives:
        return out
    for e in fsdp._entries:
        if e[0] == "param":
            out[e[1]] = values[id(e[2])]
        else:
            b = e[2]._buffers.get(e[3])
            if b is not None:
                out[e[1]] = b.copy()
    return out

def sharded_state_dict(fsdp: Any) -> "OrderedDict[str, Any]":
    """``FullyShardedDataParallel.sharded_state_dict`` (its docstring has the contract)."""
    from ringlet.checkpoint import ShardedTensor, ShardSpec

    _between_iterations(fsdp, "sharded_state_dict")
    pieces: Dict[int, Any] = {}
    for fg in fsdp._groups:
        lay = fg.layout
        for i, p in enumerate(fg.params):
            if lay.shards == 1:
                o, n = lay.offsets[i], lay.sizes[i]
                pieces[id(p)] = fg.shard.data[o:o + n].reshape(lay.shapes[i])
            else:
                s, e = lay.param_range(i, fg.shard_rank)
                pieces[id(p)] = ShardedTensor(fg.shard.data[lay.shard_slice(i, fg.shard_rank)],
                                              ShardSpec.flat(lay.shapes[i], s, e))
    out: "OrderedDict[str, Any]" = OrderedDict()
    for e in fsdp._entries:
        if e[0] == "param":
            out[e[1]] = pieces[id(e[2])]
        else:
            b = e[2]._buffers.get(e[3])
            if b is not None:
                out[e[1]] = b
    return out

def _check_keys(fsdp: Any, sd: Any, strict: bool, what: str) -> Tuple[List[str], List[str]]:
    if not hasattr(sd, "keys") or not hasattr(sd, "__getitem__"):
        raise TypeError(f"FSDP.{what}: expected a mapping of name -> array, got "
                        f"{type(sd).__name__}")
    own = [e[1] for e in fsdp._entries]
    own_set = set(own)
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd.keys() if k not in own_set]
    if strict and (missing or unexpected):
        raise KeyError(f"FSDP.{what}(strict=True): missing keys {missing}, unexpected keys "
                       f"{unexpected}")
    return missing, unexpected

def _check_full_entries(fsdp: Any, sd: Any, strict: bool) -> nn.IncompatibleKeys:
    missing, unexpected = _check_keys(fsdp, sd, strict, "load_full_state_dict")
    for e in fsdp._entries:
        if e[1] not in sd:
            continue
        v = sd[e[1]]
        v = v.data if isinstance(v, nn.Parameter) else np.asarray(v)
        if e[0] == "param":
            fg, i = _locate(fsdp, e[2])
            shape, dtype = fg.layout.shapes[i], fg.dtype
        else:
            b = e[2]._buffers.get(e[3])
            shape, dtype = b.shape, b.dtype
        if tuple(v.shape) != tuple(shape) or v.dtype != dtype:
            raise ValueError(f"FSDP.load_full_state_dict: '{e[1]}' is {v.shape} {v.dtype}, "
                             f"the model has {tuple(shape)} {dtype}")
    return nn.IncompatibleKeys(missing, unexpected)

def _locate(fsdp: Any, p: nn.Parameter) -> Tuple[_FlatGroup, int]:
    for fg in fsdp._groups:
        for i, q in enumerate(fg.params):
            if q is p:
                return fg, i
    raise AssertionError("parameter not managed by FSDP")  # pragma: no cover

def load_full_state_dict(fsdp: Any, state_dict: Any, *, rank0_only: bool = False,
                         strict: bool = True) -> nn.IncompatibleKeys:
    """``FullyShardedDataParallel.load_full_state_dict`` (its docstring has the contract)."""
    _between_iterations(fsdp, "load_full_state_dict")
    if rank0_only and fsdp.world_size > 1:
        err, res, names = None, None, None
        if fsdp.rank == 0:
            try:
                res = _check_full_entries(fsdp, state_dict, strict)
                # Only string keys can name an entry; others (strict=False) are ignored.
                names = [k for k in state_dict.keys() if isinstance(k, str)]
            except Exception as exc:  # every rank waits for this verdict
                err = f"{type(exc).__name__}: {exc}"
        verdict = fsdp._bcast_object([err, None if res is None else [res[0], res[1]], names])
        if verdict[0] is not None:
            kind = verdict[0].split(":", 1)[0]
            exc_type = {"TypeError": TypeError, "KeyError": KeyError}.get(kind, ValueError)
            raise exc_type(f"FSDP.load_full_state_dict (checked on rank 0): {verdict[0]}")
        result = nn.IncompatibleKeys(*verdict[1])
        present = set(verdict[2])
    else:
        result = _check_full_entries(fsdp, state_dict, strict)
        present = set(state_dict.keys())
    keys = _param_keys(fsdp)
    bcast = rank0_only and fsdp.world_size > 1
    for fg in fsdp._groups:
        # The key each parameter is read from (a tied one under any of its names).
        srcs = [next((k for k in keys[id(p)] if k in present), None) for p in fg.params]
        if all(k is None for k in srcs):
            continue
        full = fsdp.memory.alloc("comm", fg.layout.padded, fg.dtype, zero=True)
        if not bcast or fsdp.rank == 0:
            _fill_full(fg, full, srcs, state_dict)
        if bcast:  # one unit at a time from rank 0
            fsdp._bcast_array(full)
        lay, cur = fg.layout, fg.shard.data
        for i, k in enumerate(srcs):
            if k is None:  # absent keys (strict=False) keep their values
                continue
            s, e = lay.param_range(i, fg.shard_rank)
            cur[lay.shard_slice(i, fg.shard_rank)] = full[lay.offsets[i] + s: lay.offsets[i] + e]
        fsdp.memory.release(full)
    for e in fsdp._entries:
        if e[0] != "buffer" or e[1] not in present:
            continue
        b = e[2]._buffers.get(e[3])
        if rank0_only and fsdp.world_size > 1:
            tmp = np.ascontiguousarray(state_dict[e[1]]) if fsdp.rank == 0 \
                else np.empty(b.shape, b.dtype)
            tmp = np.array(tmp, dtype=b.dtype, copy=True)
            fsdp._bcast_array(tmp)
            np.copyto(b, tmp)
        else:
            np.copyto(b, np.asarray(state_dict[e[1]]))
    _after_load(fsdp)
    return result

def _fill_full(fg: _FlatGroup, full: np.ndarray, srcs: List[Any], sd: Any) -> None:
    for i, k in enumerate(srcs):
        if k is None:
            continue
        v = sd[k]
        v = v.data if isinstance(v, nn.Parameter) else np.asarray(v)
        o, n = fg.layout.offsets[i], fg.layout.sizes[i]
        full[o:o + n] = v.reshape(-1)

def load_sharded_state_dict(fsdp: Any, state_dict: Any, *, strict: bool = True
                            ) -> nn.IncompatibleKeys:
    """``FullyShardedDataParallel.load_sharded_state_dict`` (its docstring has the contract)."""
    from ringlet.checkpoint import ShardedTensor

    _between_iterations(fsdp, "load_sharded_state_dict")
    missing, unexpected = _check_keys(fsdp, state_dict, strict, "load_sharded_state_dict")
    expected = sharded_state_dict(fsdp)
    plan = []
    for k, mine in expected.items():
        if k not in state_dict:
            continue
        v = state_dict[k]
        dst = mine.local if isinstance(mine, ShardedTensor) else mine
        if isinstance(v, ShardedTensor):
            if not isinstance(mine, ShardedTensor) or v.spec != mine.spec:
                want = mine.spec if isinstance(mine, ShardedTensor) else "a full array"
                raise ValueError(f"FSDP.load_sharded_state_dict: '{k}' has {v.spec!r}, this "
                                 f"rank holds {want}")
            src = v.local
        else:
            v = v.data if isinstance(v, nn.Parameter) else np.asarray(v)
            if isinstance(mine, ShardedTensor):
                if tuple(v.shape) != mine.spec.global_shape:
                    raise ValueError(f"FSDP.load_sharded_state_dict: '{k}' has shape "
                                     f"{v.shape}, the model has {mine.spec.global_shape}")
                s, e = mine.spec.flat_range
                src = v.reshape(-1)[s:e]
            else:
                src = v
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"FSDP.load_sharded_state_dict: '{k}' is {src.shape} "
                             f"{src.dtype}, expected {dst.shape} {dst.dtype}")
        plan.append((dst, src))
    for dst, src in plan:
        if not np.shares_memory(dst, src):
            np.copyto(dst, src)
    _after_load(fsdp)
    return nn.IncompatibleKeys(missing, unexpected)

def _after_load(fsdp: Any) -> None:
    # Cast copies (NO_SHARD mixed precision) and any gathered buffers are stale now.
    for fg in fsdp._groups:
        _col.free_full(fsdp, fg)
