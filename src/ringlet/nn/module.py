"""``Parameter``, ``Module`` and gradient mode: the skeleton every layer builds on.

There is no tape.  Each layer's ``forward`` saves what its ``backward`` needs in
a per-module queue of contexts, and ``backward(grad_output)`` returns the
gradient with respect to the input while accumulating parameter gradients.

Contexts and several forwards in flight
---------------------------------------
Every outermost module call (``model(x)`` from user code, not from inside
another module's ``forward``) opens a new *forward pass*.  A module's
``backward`` consumes the contexts of the oldest pass it still holds, and
within that pass the most recent one.  So a pipeline schedule can run forward
on micro-batches 0, 1, 2 and then backward on 0, 1, 2, and a module used twice
inside one forward (a shared activation, a weight-tied block) is
back-propagated in reverse order of its calls.

Gradient-ready hooks
--------------------
Each forward use of a parameter is counted; each gradient accumulated during
backward counts one use down.  When the count reaches zero the parameter's
gradient is final for this backward and its hooks fire (``DistributedDataParallel``
starts reducing its bucket at that moment).  A parameter used twice (tied
weights) or in several in-flight forwards fires once, after the last use.

A call that raises leaves no trace: a forward that raises drops the contexts
saved during that call (even when an enclosing forward catches the exception),
and when the outermost backward ends (returning or raising) it releases every
use taken with ``_pop()`` whose gradient was never accumulated (every
subclass's ``backward`` is wrapped for that when the class is defined).
Otherwise the parameter's next backward would wait for one use too many and
its hooks would not fire.

Gradients are accumulated in place into an existing ``param.grad`` array, never
rebinding it, because data-parallel wrappers replace ``param.grad`` with a view
into one flat buffer.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import threading
import types
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Parameter", "Module", "no_grad", "enable_grad", "is_grad_enabled", "HookHandle",
           "IncompatibleKeys"]

_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


class _GradMode(threading.local):
    # Thread-local: under ringlet.testing's thread mode every rank is a thread,
    # and one rank's evaluation under no_grad must not switch off another's.
    enabled = True
    depth = 0       # nesting of Module.__call__ on this thread
    pass_id = 0     # forward pass the current outermost call belongs to
    journal: Optional[list] = None  # (module, entry) saved in the current pass, in order
    owed: Optional[list] = None  # params popped by the running backward, in order (see _pop)


_mode = _GradMode()
_pass_ids = itertools.count(1)  # global so passes from different threads never collide


def is_grad_enabled() -> bool:
    """True when forwards on this thread save contexts for backward."""
    return _mode.enabled


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Context manager: forwards inside it save no context (inference, evaluation).

    Example::

        with ringlet.nn.no_grad():
            logits = model(x_test)   # no memory kept for backward
    """
    prev = _mode.enabled
    _mode.enabled = False
    try:
        yield
    finally:
        _mode.enabled = prev


@contextlib.contextmanager
def enable_grad() -> Iterator[None]:
    """Context manager: re-enable context saving inside a ``no_grad`` block."""
    prev = _mode.enabled
    _mode.enabled = True
    try:
        yield
    finally:
        _mode.enabled = prev


class HookHandle:
    """Returned by ``register_grad_ready_hook``; ``remove()`` unregisters the hook."""

    __slots__ = ("_removers",)

    def __init__(self, removers: Sequence[Callable[[], None]]) -> None:
        self._removers = list(removers)

    def remove(self) -> None:
        """Unregister the hook(s); calling it again is harmless."""
        removers, self._removers = self._removers, []
        for r in removers:
            r()

    def __enter__(self) -> "HookHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class Parameter:
    """A trainable array: ``.data`` (the values) and ``.grad`` (None until the first backward).

    Both are plain numpy arrays.  Code that updates a parameter writes into
    ``.data`` in place (optimizers do), so views of it held elsewhere (flat
    shards, checkpoints loaded in place) stay valid.

    Args:
        data: floating numpy array (float16, float32 or float64), used as is (not copied).
        requires_grad: False freezes it: layers compute no gradient for it and
            data-parallel wrappers leave it out of their buffers.
    Raises:
        TypeError: ``data`` is not a floating numpy array.

    Example::

        w = Parameter(np.zeros((3, 4), np.float32))
        w.accumulate_grad(np.ones((3, 4), np.float32))   # w.grad is now all ones
    """

    def __init__(self, data: np.ndarray, requires_grad: bool = True) -> None:
        if isinstance(data, Parameter):
            raise TypeError("Parameter(data): data is already a Parameter; pass its .data")
        if not isinstance(data, np.ndarray):
            raise TypeError(f"Parameter data must be a numpy.ndarray, got {type(data).__name__}")
        if data.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"Parameter data must be float16, float32 or float64, got {data.dtype}")
        self.data = data
        self.grad: Optional[np.ndarray] = None
        self.requires_grad = bool(requires_grad)
        self._hooks: Dict[int, Callable[["Parameter"], None]] = {}
        self._pre_hooks: Dict[int, Callable[["Parameter"], None]] = {}
        self._hook_ids = itertools.count()
        self._pending = 0  # forward uses whose gradient has not been accumulated yet
        self._owed = 0  # of those, uses popped by the running backward (_guard_backward)

    def __getstate__(self) -> dict:
        # Hooks belong to the wrappers of this process (and may be lambdas):
        # a pickled or deep-copied parameter starts without hooks or pending uses.
        return {"data": self.data, "grad": self.grad, "requires_grad": self.requires_grad}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["data"], state["requires_grad"])
        self.grad = state["grad"]

    # ---- array-like conveniences -------------------------------------------
    @property
    def shape(self) -> Tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __repr__(self) -> str:
        return (f"Parameter(shape={self.data.shape}, dtype={self.data.dtype}"
                f"{'' if self.requires_grad else ', requires_grad=False'})")

    # ---- gradients -----------------------------------------------------------
    def accumulate_grad(self, g: np.ndarray) -> None:
        """Add ``g`` into ``.grad`` in place (allocating it on first use); fire ready hooks.

        The hooks fire when every forward use of this parameter counted since
        the last time it was ready has had its gradient accumulated.

        Args:
            g: array of the parameter's shape (cast to its dtype).
        Raises:
            ValueError: ``g`` has the wrong shape.
        """
        if not self.requires_grad:
            return
        g = np.asarray(g)
        if g.shape != self.data.shape:
            raise ValueError(f"gradient of shape {g.shape} does not match parameter shape "
                             f"{self.data.shape}")
        self._before_accumulate()
        if self.grad is None:
            self.grad = np.array(g, dtype=self.data.dtype, copy=True, order="C")
        else:
            # In place: .grad may be a view into a data-parallel flat buffer.
            np.add(self.grad, g, out=self.grad, casting="unsafe")
        self._use_done()

    def _accumulate_rows(self, index: np.ndarray, rows: np.ndarray) -> None:
        """Scatter-add ``rows`` into ``.grad[index]`` (embedding backward) and count one use."""
        if not self.requires_grad:
            return
        self._before_accumulate()
        if self.data.dtype == np.float16:
            # Repeated rows are summed in float32 first: a float16 running sum of
            # terms of similar size stalls after about 2048 of them.
            index, where = np.unique(index, return_inverse=True)
            acc = np.zeros((index.size,) + rows.shape[1:], np.float32)
            np.add.at(acc, where.reshape(-1), rows)
            rows = acc
        if self.grad is None:
            self.grad = np.zeros_like(self.data, order="C")
        np.add.at(self.grad, index, rows.astype(self.data.dtype, copy=False))
        self._use_done()

    def _before_accumulate(self) -> None:
        # A pre-accumulate hook that raises refuses the gradient before .grad changes.
        for fn in list(self._pre_hooks.values()):
            fn(self)

    def _note_use(self) -> None:
        self._pending += 1

    def _release_use(self) -> None:
        # A saved context was dropped without backward (clear_context).
        if self._pending > 0:
            self._pending -= 1

    def _use_done(self) -> None:
        if self._owed:
            self._owed -= 1
        if self._pending > 0:
            self._pending -= 1
        if self._pending == 0:
            for fn in list(self._hooks.values()):
                fn(self)

    def register_grad_ready_hook(self, fn: Callable[["Parameter"], None]) -> HookHandle:
        """Call ``fn(param)`` each time this parameter's gradient becomes final in a backward.

        Args:
            fn: callable taking the parameter.
        Returns:
            A ``HookHandle``; ``handle.remove()`` unregisters ``fn``.
        Raises:
            TypeError: ``fn`` is not callable.

        Example::

            h = layer.weight.register_grad_ready_hook(lambda p: print("ready", p.shape))
            ...
            h.remove()
        """
        return self._add_hook(self._hooks, fn)

    def register_grad_pre_accumulate_hook(self, fn: Callable[["Parameter"], None]) -> HookHandle:
        """Call ``fn(param)`` before each gradient is added into ``.grad`` in backward.

        If ``fn`` raises, the gradient is refused: ``.grad`` is left untouched
        and the exception propagates out of the layer's backward.
        ``DistributedDataParallel`` uses it to refuse a gradient for a
        parameter whose bucket is already being reduced.

        Args:
            fn: callable taking the parameter.
        Returns:
            A ``HookHandle``; ``handle.remove()`` unregisters ``fn``.
        Raises:
            TypeError: ``fn`` is not callable.

        Example::

            def frozen(p):
                raise RuntimeError("no gradients for this one")
            h = layer.weight.register_grad_pre_accumulate_hook(frozen)
        """
        return self._add_hook(self._pre_hooks, fn)

    def _add_hook(self, table: Dict[int, Callable[["Parameter"], None]],
                  fn: Callable[["Parameter"], None]) -> HookHandle:
        if not callable(fn):
            raise TypeError(f"hook must be callable, got {type(fn).__name__}")
        key = next(self._hook_ids)
        table[key] = fn
        return HookHandle([lambda: table.pop(key, None)])

    def zero_grad(self) -> None:
        """Set ``.grad`` to zero in place (no-op while it is None)."""
        if self.grad is not None:
            self.grad[...] = 0


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` found missing from / unexpected in a state dict."""

    missing_keys: List[str]
    unexpected_keys: List[str]


class _Saved(NamedTuple):
    pass_id: int
    ctx: Any
    params: Tuple[Parameter, ...]


def _roll_back(journal: list, mark: int) -> None:
    """Drop the contexts saved since ``journal[mark]`` and release their parameter uses."""
    undo = journal[mark:]
    del journal[mark:]
    drop = {id(e) for _, e in undo}  # by identity: contexts may hold arrays (no ==)
    seen: set = set()
    for m, _ in undo:
        if id(m) in seen:
            continue
        seen.add(id(m))
        keep = []
        for e in m._contexts:
            if id(e) in drop:  # a backward run inside the forward may have popped it
                for p in e.params:
                    p._release_use()
            else:
                keep.append(e)
        m._contexts.clear()
        m._contexts.extend(keep)


def _guard_backward(fn: Callable) -> Callable:
    """Wrap a subclass's ``backward``: uses popped and never accumulated are released."""

    @functools.wraps(fn)
    def backward(self: "Module", *args: Any, **kwargs: Any) -> Any:
        mode = _mode
        if mode.owed is not None:  # inside another backward: the outermost settles
            return fn(self, *args, **kwargs)
        owed = mode.owed = []
        try:
            return fn(self, *args, **kwargs)
        finally:
            mode.owed = None
            # A context popped whose gradient never arrived (a backward raised, or
            # skipped it): else the next backward of that parameter waits for one
            # use too many.
            for p in owed:
                if p._owed:
                    p._owed -= 1
                    p._release_use()

    backward._ringlet_guarded = True  # type: ignore[attr-defined]
    return backward


def _float_dtype(dtype: Any, what: str) -> np.dtype:
    try:
        d = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{what}: {dtype!r} is not a numpy dtype") from None
    if d not in _FLOAT_DTYPES:
        raise TypeError(f"{what}: dtype must be float16, float32 or float64, got {d}")
    return d


class Module:
    """Base class of layers and models.

    Subclasses set ``Parameter``, ``Module`` and buffer attributes in
    ``__init__`` (after ``super().__init__()``), and implement ``forward`` and
    ``backward``.  A leaf layer saves its context with ``self._save(ctx,
    params)`` in forward and takes it back with ``self._pop()`` in backward;
    a composite module calls its children and, in backward, their
    ``backward`` in reverse order.

    Example::

        class MLP(Module):
            def __init__(self):
                super().__init__()
                self.fc1, self.act, self.fc2 = Linear(4, 8), ReLU(), Linear(8, 2)
            def forward(self, x):
                return self.fc2(self.act(self.fc1(x)))
            def backward(self, g):
                return self.fc1.backward(self.act.backward(self.fc2.backward(g)))
    """

    training: bool

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fn = cls.__dict__.get("backward")
        if isinstance(fn, types.FunctionType) and not getattr(fn, "_ringlet_guarded", False):
            cls.backward = _guard_backward(fn)  # type: ignore[method-assign]

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", collections.OrderedDict())
        object.__setattr__(self, "_buffers", collections.OrderedDict())
        object.__setattr__(self, "_modules", collections.OrderedDict())
        object.__setattr__(self, "_contexts", collections.deque())
        object.__setattr__(self, "training", True)

    # ---- attribute registration ----------------------------------------------
    def _check_init(self) -> None:
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}: call super().__init__() before "
                               f"assigning parameters, buffers or submodules")

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Parameter):
            self._check_init()
            self._forget(name)
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._check_init()
            self._forget(name)
            self._modules[name] = value
        elif "_parameters" in self.__dict__ and name in self._parameters:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} to parameter '{name}' "
                                f"(expected a Parameter or None)")
            self._parameters[name] = None
        elif "_buffers" in self.__dict__ and name in self._buffers:
            if value is not None and not isinstance(value, np.ndarray):
                raise TypeError(f"cannot assign {type(value).__name__} to buffer '{name}' "
                                f"(expected a numpy array or None)")
            self._buffers[name] = value
        elif "_modules" in self.__dict__ and name in self._modules:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} to submodule '{name}' "
                                f"(expected a Module or None)")
            self._modules[name] = None
        else:
            object.__setattr__(self, name, value)

    def _forget(self, name: str) -> None:
        for d in (self._parameters, self._buffers, self._modules):
            d.pop(name, None)
        self.__dict__.pop(name, None)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails.
        d = self.__dict__
        for key in ("_parameters", "_buffers", "_modules"):
            table = d.get(key)
            if table is not None and name in table:
                return table[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        for d in (self._parameters, self._buffers, self._modules):
            if name in d:
                del d[name]
                return
        object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Optional[Parameter]) -> None:
        """Register ``param`` (or None, e.g. an absent bias) under ``name``."""
        self._check_init()
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"register_parameter('{name}'): expected a Parameter or None, "
                            f"got {type(param).__name__}")
        self._forget(name)
        self._parameters[name] = param

    def register_buffer(self, name: str, array: Optional[np.ndarray]) -> None:
        """Register a non-trainable array saved in ``state_dict`` (e.g. running statistics).

        Buffers are updated in place by the layers that own them.
        """
        self._check_init()
        if array is not None and not isinstance(array, np.ndarray):
            raise TypeError(f"register_buffer('{name}'): expected a numpy array or None, "
                            f"got {type(array).__name__}")
        self._forget(name)
        self._buffers[name] = array

    def add_module(self, name: str, module: Optional["Module"]) -> None:
        """Register a submodule under ``name``."""
        self._check_init()
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"add_module('{name}'): expected a Module, got {type(module).__name__}")
        self._forget(name)
        self._modules[name] = module

    # ---- traversal ------------------------------------------------------------
    def named_children(self) -> Iterator[Tuple[str, "Module"]]:
        """Direct submodules as (name, module), in registration order."""
        for name, m in self._modules.items():
            if m is not None:
                yield name, m

    def children(self) -> Iterator["Module"]:
        """Direct submodules, in registration order."""
        for _, m in self.named_children():
            yield m

    def named_modules(self, prefix: str = "", *, memo: Optional[set] = None
                      ) -> Iterator[Tuple[str, "Module"]]:
        """This module and all descendants as (dotted name, module), each once, pre-order."""
        if memo is None:
            memo = set()
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, m in self.named_children():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name, memo=memo)

    def modules(self) -> Iterator["Module"]:
        """This module and all descendants, each once."""
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix: str = "", recurse: bool = True
                         ) -> Iterator[Tuple[str, Parameter]]:
        """Parameters as (dotted name, Parameter), e.g. ``"0.weight"``; a shared one once.

        Args:
            prefix: prepended to every name.
            recurse: include submodules' parameters.
        """
        seen: set = set()
        mods = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for mname, m in mods:
            for pname, p in m._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                yield (f"{mname}.{pname}" if mname else pname), p

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        """Parameters (a shared one once), in ``named_parameters`` order."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True
                      ) -> Iterator[Tuple[str, np.ndarray]]:
        """Buffers as (dotted name, array), e.g. ``"1.running_mean"``; a shared one once."""
        seen: set = set()
        mods = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for mname, m in mods:
            for bname, b in m._buffers.items():
                if b is None or id(b) in seen:
                    continue
                seen.add(id(b))
                yield (f"{mname}.{bname}" if mname else bname), b

    def buffers(self, recurse: bool = True) -> Iterator[np.ndarray]:
        """Buffers, in ``named_buffers`` order."""
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    # ---- modes -------------------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        """Set training mode (dropout active, batch norm uses batch statistics); returns self."""
        if not isinstance(mode, bool):
            raise TypeError(f"train(mode): mode must be a bool, got {type(mode).__name__}")
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        """Set evaluation mode; returns self.

        Evaluation mode changes layer behaviour only.  Forwards still save
        contexts for backward unless run under ``no_grad()``, so wrap pure
        inference in ``with ringlet.nn.no_grad():``.
        """
        return self.train(False)

    # ---- forward / backward ------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement forward()")

    def backward(self, grad_output: Any) -> Any:
        """Back-propagate ``grad_output`` through the oldest saved forward; return grad_input."""
        raise NotImplementedError(f"{type(self).__name__} does not implement backward(); "
                                  f"composite modules call their children's backward in "
                                  f"reverse order")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outermost = _mode.depth == 0
        if outermost:
            _mode.pass_id = next(_pass_ids)
            _mode.journal = []
        journal = _mode.journal
        mark = len(journal)
        _mode.depth += 1
        ok = False
        try:
            out = self.forward(*args, **kwargs)
            ok = True
            return out
        finally:
            _mode.depth -= 1
            if not ok:
                # A call that raised returns nothing to back-propagate, also when an
                # enclosing forward catches the exception: drop what it saved.
                _roll_back(journal, mark)
            if outermost:
                _mode.journal = None

    def _save(self, ctx: Any, params: Sequence[Optional[Parameter]] = ()) -> None:
        """Keep ``ctx`` for backward and count a use of each trainable parameter in ``params``.

        Arrays in ``ctx`` are kept by reference, not copied (docs/nn.md, "Saved
        arrays are references").  Does nothing under ``no_grad()``.
        """
        if not _mode.enabled:
            return
        used = tuple(p for p in params if p is not None and p.requires_grad)
        for p in used:
            p._note_use()
        pass_id = _mode.pass_id if _mode.depth > 0 else next(_pass_ids)
        entry = _Saved(pass_id, ctx, used)
        self._contexts.append(entry)
        if _mode.depth > 0 and _mode.journal is not None:
            _mode.journal.append((self, entry))

    def _pop(self) -> Any:
        """Take the context for this backward: the oldest pass, latest call within it."""
        q = self._contexts
        if not q:
            raise RuntimeError(
                f"{type(self).__name__}.backward: no saved forward context (forward ran under "
                f"no_grad(), its context was cleared, or backward was called more often than "
                f"forward)")
        first = q[0].pass_id
        i = 0
        n = len(q)
        while i + 1 < n and q[i + 1].pass_id == first:
            i += 1
        entry = q[i]
        del q[i]
        owed = _mode.owed
        if owed is not None:  # owed by the running backward until it accumulates them
            owed.extend(entry.params)
            for p in entry.params:
                p._owed += 1
        return entry.ctx

    def num_saved_contexts(self) -> int:
        """Forward contexts this module (not its children) holds for backward."""
        return len(self._contexts)

    def saved_bytes(self) -> int:
        """Bytes of the arrays held in saved contexts by this module and its descendants.

        Each array object is counted once (the activation memory a pending
        backward keeps alive, as pipeline schedules report it).
        """
        seen: set = set()
        total = 0
        stack: list = [e.ctx for m in self.modules() for e in m._contexts]
        while stack:
            obj = stack.pop()
            if isinstance(obj, np.ndarray):
                if id(obj) not in seen:
                    seen.add(id(obj))
                    total += obj.nbytes
            elif isinstance(obj, (tuple, list)):
                stack.extend(obj)
        return total

    def clear_context(self) -> None:
        """Drop every saved forward context of this module and its descendants.

        Use it after a forward whose backward will never run (evaluation
        without ``no_grad()``, an abandoned step); it also resets the
        parameters' outstanding-use counts so ready hooks fire normally later.
        """
        for m in self.modules():
            while m._contexts:
                for p in m._contexts.popleft().params:
                    p._release_use()

    # ---- gradients ----------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero every parameter's gradient in place (views into flat buffers stay valid)."""
        for p in self.parameters():
            p.zero_grad()

    def register_grad_ready_hook(self, fn: Callable[[Parameter], None]) -> HookHandle:
        """Register ``fn(param)`` as a ready hook on every trainable parameter.

        Returns:
            One ``HookHandle`` whose ``remove()`` unregisters all of them.
        """
        handles = [p.register_grad_ready_hook(fn) for p in self.parameters() if p.requires_grad]
        return HookHandle([h.remove for h in handles])

    # ---- state --------------------------------------------------------------------
    def _state_items(self, prefix: str) -> Iterator[Tuple[str, np.ndarray]]:
        # Like torch: a parameter shared by two modules appears under both names.
        for name, p in self._parameters.items():
            if p is not None:
                yield prefix + name, p.data
        for name, b in self._buffers.items():
            if b is not None:
                yield prefix + name, b
        for name, m in self._modules.items():
            if m is not None:
                yield from m._state_items(prefix + name + ".")

    def state_dict(self, *, copy: bool = False) -> "collections.OrderedDict[str, np.ndarray]":
        """Parameters and buffers by dotted name.

        Args:
            copy: return copies; by default the arrays are the module's own
                (like torch), so later training changes them.
        Returns:
            OrderedDict name -> numpy array.

        Example::

            sd = model.state_dict(copy=True)
            other.load_state_dict(sd)
        """
        out: "collections.OrderedDict[str, np.ndarray]" = collections.OrderedDict()
        for k, v in self._state_items(""):
            out[k] = v.copy() if copy else v
        return out

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Copy arrays from ``state_dict`` into the parameters and buffers, in place.

        The existing arrays are kept (optimizer state and views into flat
        buffers stay valid).  Every entry is checked before anything is
        copied, so a failed load changes nothing.

        Args:
            state_dict: mapping dotted name -> array (same shape and dtype).
            strict: require exactly the module's keys.
        Returns:
            ``IncompatibleKeys(missing_keys, unexpected_keys)``.
        Raises:
            TypeError: ``state_dict`` is not a mapping.
            KeyError: ``strict`` and keys are missing or unexpected (both listed).
            ValueError: an entry's shape or dtype differs (the key is named).
        """
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise TypeError(f"load_state_dict expects a mapping of name -> array, got "
                            f"{type(state_dict).__name__}")
        own = list(self._state_items(""))
        own_keys = {k for k, _ in own}
        missing = [k for k, _ in own if k not in state_dict]
        unexpected = [k for k in state_dict.keys() if k not in own_keys]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict(strict=True): missing keys {missing}, "
                           f"unexpected keys {unexpected}")
        plan = []
        for k, dst in own:
            if k not in state_dict:
                continue
            src = state_dict[k]
            src = src.data if isinstance(src, Parameter) else np.asarray(src)
            if src.shape != dst.shape:
                raise ValueError(f"load_state_dict: '{k}' has shape {src.shape}, the module "
                                 f"expects {dst.shape}")
            if src.dtype != dst.dtype:
                raise ValueError(f"load_state_dict: '{k}' has dtype {src.dtype}, the module "
                                 f"expects {dst.dtype}")
            plan.append((dst, src))
        for dst, src in plan:
            np.copyto(dst, src)
        return IncompatibleKeys(missing, unexpected)

    def to(self, dtype: Any) -> "Module":
        """Cast floating parameters and buffers to ``dtype``; returns self.

        This replaces the arrays (a dtype cannot change in place): call it
        before creating optimizers or data-parallel wrappers.  Gradients of
        cast parameters are reset to None and saved contexts are dropped.
        """
        d = _float_dtype(dtype, "Module.to")
        self.clear_context()
        for m in self.modules():
            for name, p in m._parameters.items():
                if p is not None and p.data.dtype != d:
                    p.data = p.data.astype(d)
                    p.grad = None
            for name, b in m._buffers.items():
                if b is not None and b.dtype in _FLOAT_DTYPES and b.dtype != d:
                    m._buffers[name] = b.astype(d)
            if "_dtype" in m.__dict__:  # layers without parameters compute in it
                object.__setattr__(m, "_dtype", d)
        return self

    # ---- printing -------------------------------------------------------------------
    def extra_repr(self) -> str:
        """One-line description of this module's settings (shown by ``repr``)."""
        return ""

    def __repr__(self) -> str:
        head = f"{type(self).__name__}({self.extra_repr()}"
        kids = list(self.named_children())
        if not kids:
            return head + ")"
        lines = [head]
        for name, m in kids:
            body = repr(m).replace("\n", "\n  ")
            lines.append(f"  ({name}): {body}")
        return "\n".join(lines) + "\n)"
