"""FSDP construction: which modules become units, and the state-dict entries of the model."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ringlet import nn

__all__: List[str] = []


def check_policy(auto_wrap: Any) -> Callable[[str, nn.Module], bool]:
    """``auto_wrap`` as a ``policy(name, module) -> bool`` (None: the "sequential" rule)."""
    if auto_wrap is None or auto_wrap is False:
        return lambda name, m: False
    if isinstance(auto_wrap, str):
        if auto_wrap != "sequential":
            raise ValueError(f"FSDP: auto_wrap string must be 'sequential', got "
                             f"{auto_wrap!r}")
        return None  # type: ignore[return-value]  # resolved with the parents in plan_units
    if isinstance(auto_wrap, (tuple, list, set, frozenset)):
        classes = tuple(auto_wrap)
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module)
                                  for c in classes):
            raise TypeError("FSDP: auto_wrap as a collection must hold nn.Module classes")
        return lambda name, m: isinstance(m, classes)
    if callable(auto_wrap):
        return auto_wrap
    raise TypeError(f"FSDP: auto_wrap must be 'sequential', None, a tuple of Module classes "
                    f"or a callable(name, module), got {type(auto_wrap).__name__}")


def state_entries(root: nn.Module) -> List[tuple]:
    """("param", key, p) / ("buffer", key, module, name) in ``root.state_dict()`` order.

    Same keys and order as ``root.state_dict()`` (shared parameters under every name).
    """
    out: List[tuple] = []

    def walk(m: nn.Module, prefix: str) -> None:
        for name, p in m._parameters.items():
            if p is not None:
                out.append(("param", prefix + name, p))
        for name, b in m._buffers.items():
            if b is not None:
                out.append(("buffer", prefix + name, m, name))
        for name, c in m._modules.items():
            if c is not None:
                walk(c, prefix + name + ".")

    walk(root, "")
    return out


def plan_units(root: nn.Module, policy: Optional[Callable]) -> List[Tuple[str, nn.Module]]:
    """(name, module) of every unit below ``root`` that owns parameters, in pre-order."""
    named = list(root.named_modules())
    if policy is None:  # "sequential": children of any Sequential
        kids = set()
        for _, m in named:
            if isinstance(m, nn.Sequential):
                kids.update(id(c) for c in m.children())
        cands = [(n, m) for n, m in named if m is not root and id(m) in kids]
    else:
        cands = []
        for n, m in named:
            if m is root:
                continue
            v = policy(n, m)
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"FSDP: auto_wrap policy returned {type(v).__name__} for "
                                f"'{n}', expected a bool")
            if v:
                cands.append((n, m))
    # Descendants come after ancestors in pre-order: decide them first, so
    # a candidate owns only what no kept descendant owns.
    kept: Dict[int, str] = {}
    for n, m in reversed(cands):
        if own_params(m, kept):
            kept[id(m)] = n
    return [(n, m) for n, m in cands if id(m) in kept]


def own_params(m: nn.Module, units: Dict[int, str]) -> List[Tuple[nn.Module, str, nn.Parameter]]:
    """(module, attribute, parameter) reachable from ``m`` without entering another unit."""
    out: List[Tuple[nn.Module, str, nn.Parameter]] = []
    seen = set()

    def walk(x: nn.Module) -> None:
        if id(x) in seen:
            return
        seen.add(id(x))
        for attr, p in x._parameters.items():
            if p is not None:
                out.append((x, attr, p))
        for c in x._modules.values():
            if c is not None and id(c) not in units:
                walk(c)

    walk(m)
    return out
