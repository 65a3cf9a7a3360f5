"""The table of functions that may be called over RPC.

Only functions registered here can be run by a remote caller; a call naming
anything else is refused.  The table is per process (decorators run at import
time, before ``init_rpc``), so in thread-mode tests all ranks share it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional

__all__ = ["register", "unregister", "lookup", "name_of", "registered_names"]

_lock = threading.Lock()
_by_name: Dict[str, Callable[..., Any]] = {}
_MAX_NAME = 256


def _default_name(fn: Callable[..., Any]) -> str:
    qual = getattr(fn, "__qualname__", None)
    mod = getattr(fn, "__module__", None)
    if not isinstance(qual, str) or not isinstance(mod, str):
        raise ValueError(f"cannot derive a name for {fn!r}; pass name=... to register()")
    if mod == "__mp_main__":  # a spawned child sees the launcher's script under this name
        mod = "__main__"
    return f"{mod}.{qual}"


def _check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"RPC function name must be a str, got {type(name).__name__}")
    if not name or len(name) > _MAX_NAME or not name.isprintable():
        raise ValueError(f"RPC function name must be 1..{_MAX_NAME} printable characters, got {name!r}")
    return name


def register(fn: Optional[Callable[..., Any]] = None, name: Optional[str] = None, *, replace: bool = False) -> Any:
    """Allow ``fn`` to be called remotely under ``name``.

    Usable as ``register(fn)``, ``register(fn, "name")``, ``@register`` or
    ``@register(name="name")``.  Register the same functions on every rank
    (typically at import time), since a caller names the function and the
    callee looks it up in its own table.

    Args:
        fn: any callable (a function, a class to construct remotely, ...).
        name: the name callers use; defaults to ``"module.qualname"``.
        replace: allow rebinding a name already bound to a different callable.

    Returns:
        ``fn`` itself (so decorating leaves the function unchanged), or a
        decorator when ``fn`` is omitted.

    Raises:
        TypeError: ``fn`` is not callable or ``name`` is not a str.
        ValueError: ``name`` is empty/too long, or already bound to another
            callable and ``replace`` is false.

    Example::

        @ringlet.rpc.register
        def add(a, b):
            return a + b

        ringlet.rpc.rpc_sync(1, add, args=(2, 3))   # or "module.add"
    """
    if fn is None:
        return lambda f: register(f, name, replace=replace)
    if not callable(fn):
        raise TypeError(f"register() needs a callable, got {type(fn).__name__}")
    key = _check_name(name) if name is not None else _default_name(fn)
    with _lock:
        old = _by_name.get(key)
        if old is not None and old is not fn and old != fn and not replace:
            raise ValueError(
                f"RPC name {key!r} is already registered to {old!r}; "
                "use a different name or register(..., replace=True)")
        _by_name[key] = fn
    return fn


def unregister(name_or_fn: Any) -> None:
    """Remove a registration (by name or by the registered callable).

    Raises:
        ValueError: nothing is registered under that name / for that callable.
    """
    key = name_or_fn if isinstance(name_or_fn, str) else name_of(name_or_fn)
    with _lock:
        if _by_name.pop(key, None) is None:
            raise ValueError(f"no RPC function is registered as {key!r}")


def lookup(name: str) -> Optional[Callable[..., Any]]:
    """The callable registered as ``name``, or None."""
    with _lock:
        return _by_name.get(name)


def name_of(fn: Any) -> str:
    """The name a call should carry for ``fn`` (a name, or a registered callable).

    Raises:
        TypeError: ``fn`` is neither a str nor callable.
        ValueError: ``fn`` is a callable that is not registered.
    """
    if isinstance(fn, str):
        return _check_name(fn)
    if not callable(fn):
        raise TypeError(f"function must be a registered name (str) or callable, got {type(fn).__name__}")
    with _lock:
        for k, v in _by_name.items():
            if v is fn:
                return k
        for k, v in _by_name.items():  # equal bound methods are distinct objects
            if v == fn:
                return k
    raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} is not registered for RPC; "
                     "decorate it with @ringlet.rpc.register or call register(fn) on every rank")


def registered_names() -> List[str]:
    """Sorted names of every registered function."""
    with _lock:
        return sorted(_by_name)
