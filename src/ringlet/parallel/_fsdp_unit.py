"""The module FSDP puts in place of each unit: gathers around its forward and backward."""

from __future__ import annotations

from typing import Any, List

from ringlet import nn

__all__: List[str] = []

_WRAPPED = "_fsdp_wrapped_module"


class _FSDPUnit(nn.Module):
    """Wrapper that replaces a unit in its parent: gathers around forward and backward.

    Attribute lookups it cannot answer fall through to the wrapped module, so
    ``model.layer.weight`` still works (its ``.data`` is only the full value
    while the unit runs).
    """

    def __init__(self, owner: Any, module: nn.Module, name: str,
                 is_root: bool) -> None:
        super().__init__()
        self.add_module(_WRAPPED, module)
        object.__setattr__(self, "_fsdp_owner", owner)
        object.__setattr__(self, "unit_name", name)
        object.__setattr__(self, "is_root", is_root)
        object.__setattr__(self, "flat_groups", [])
        object.__setattr__(self, "fwd_pending", 0)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fsdp_owner._unit_forward(self, args, kwargs)

    def backward(self, grad_output: Any) -> Any:
        return self._fsdp_owner._unit_backward(self, grad_output)

    def __setattr__(self, name: str, value: Any) -> None:
        # Assignments reach the wrapped module (``layer.weight = ...`` must not
        # silently register a new parameter on the wrapper).
        mods = self.__dict__.get("_modules")
        if mods is not None and mods.get(_WRAPPED) is not None:
            setattr(mods[_WRAPPED], name, value)
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            mods = self.__dict__.get("_modules")
            if mods is not None and mods.get(_WRAPPED) is not None:
                return getattr(mods[_WRAPPED], name)
            raise

    def extra_repr(self) -> str:
        n = sum(fg.layout.numel for fg in self.flat_groups)
        return f"unit={self.unit_name or '<root>'!r}, numel={n}"
