"""Optimizers: ``SGD`` and ``AdamW`` with torch's update rules, in place on numpy arrays.

A parameter is any object with a numpy ``data`` array and a ``grad`` attribute
(``ringlet.nn.Parameter``, or a shard object of a sharded wrapper).  Updates
are written into ``param.data`` in place, never rebinding it, so parameters
that are views into a flat buffer keep working.  Parameters whose ``grad`` is
None are skipped; a ``grad`` of another shape than the parameter is refused.

``param_groups`` is a list of dicts, like torch: ``{"params": [...], "lr": ...}``;
change a group's hyper-parameters between steps (learning-rate schedules).
``state_dict()`` numbers the parameters 0, 1, ... across groups in order, so
parameters come in an ordered collection (a list, not a set).

Example::

    opt = ringlet.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches:
        opt.zero_grad()
        loss, g = nn.cross_entropy(model(x), y)
        model.backward(g)
        opt.step()
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Tuple

import numpy as np

__all__ = ["Optimizer", "SGD", "AdamW"]


def _check_param(p: Any, where: str) -> Any:
    data = getattr(p, "data", None)
    if not isinstance(data, np.ndarray) or not hasattr(p, "grad"):
        raise TypeError(f"{where}: expected a Parameter (an object with numpy .data and .grad), "
                        f"got {type(p).__name__}")
    if data.dtype.kind != "f":
        raise TypeError(f"{where}: parameter data must be floating, got {data.dtype}")
    if not data.flags.writeable:
        raise ValueError(f"{where}: parameter data is read-only; the optimizer updates it in place")
    return p


def _check_ordered(params: Any, where: str) -> None:
    # A set's order changes from one process to the next, and state_dict()
    # numbers the parameters in order: a resumed run would pair each state with
    # another parameter (silently when the shapes agree).
    if isinstance(params, (set, frozenset)):
        raise TypeError(f"{where}: params must be an ordered collection (a list), not a "
                        f"{type(params).__name__}: the order numbers the parameters in "
                        f"state_dict() and changes between runs")


def _nonneg(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    v = float(v)
    if not v >= 0.0 or math.isinf(v):
        raise ValueError(f"{name} must be a finite number >= 0, got {v}")
    return v


class Optimizer:
    """Base class: parameter groups, per-parameter state, ``zero_grad`` and state dicts.

    Subclasses implement ``_check_group(group)`` and ``step()``.
    """

    # Per-parameter state: arrays shaped like the parameter, and counts.
    _STATE_ARRAYS: frozenset = frozenset()
    _STATE_COUNTS: frozenset = frozenset()

    def __init__(self, params: Iterable[Any], defaults: Dict[str, Any]) -> None:
        if isinstance(params, np.ndarray) or hasattr(params, "data"):
            raise TypeError(f"{type(self).__name__}: params must be an iterable of Parameters or "
                            f"of dicts, got a single {type(params).__name__}")
        _check_ordered(params, type(self).__name__)
        try:
            items = list(params)
        except TypeError:
            raise TypeError(f"{type(self).__name__}: params must be an iterable of Parameters or "
                            f"of dicts, got {type(params).__name__}") from None
        if not items:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        self.defaults = dict(defaults)
        self.param_groups: List[Dict[str, Any]] = []
        self.state: Dict[int, Dict[str, Any]] = {}  # id(param) -> state
        groups = items if isinstance(items[0], dict) else [{"params": items}]
        for g in groups:
            self.add_param_group(g)

    def add_param_group(self, group: Dict[str, Any]) -> None:
        """Add a group ``{"params": [...], **hyper-parameters}``; missing ones take the defaults.

        Raises:
            TypeError/ValueError: bad parameters, a parameter already in another
                group, unknown or invalid hyper-parameters.
        """
        if not isinstance(group, dict):
            raise TypeError(f"a parameter group must be a dict, got {type(group).__name__}")
        if "params" not in group:
            raise ValueError("a parameter group needs a 'params' entry")
        ps = group["params"]
        where = f"{type(self).__name__} group {len(self.param_groups)}"
        _check_ordered(ps, where)
        ps = [ps] if hasattr(ps, "data") else list(ps)
        for p in ps:
            _check_param(p, where)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if len({id(p) for p in ps}) != len(ps) or any(id(p) in seen for p in ps):
            raise ValueError(f"{where}: a parameter appears more than once")
        unknown = set(group) - set(self.defaults) - {"params"}
        if unknown:
            raise ValueError(f"{where}: unknown hyper-parameters {sorted(unknown)}; "
                             f"known: {sorted(self.defaults)}")
        new = dict(self.defaults)
        new.update(group)
        new["params"] = ps
        self._check_group(new)
        self.param_groups.append(new)

    def _check_group(self, group: Dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _params(self) -> List[Any]:
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self) -> None:
        """Zero every gradient in place (views into flat gradient buffers stay valid)."""
        for p in self._params():
            if p.grad is not None:
                p.grad[...] = 0

    def step(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _check_grads(self) -> None:
        """Check every gradient before ``step()`` changes anything.

        ``.grad`` is a plain attribute (wrappers and parameter servers assign
        it): a gradient of another shape would broadcast into the update.
        """
        kind = type(self).__name__
        index = 0
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                grad = p.grad
                if grad is not None:
                    if not isinstance(grad, np.ndarray):
                        raise TypeError(f"{kind}.step: parameter {index} (group {gi}) has a "
                                        f".grad of type {type(grad).__name__}, expected a numpy "
                                        f"array; nothing was updated")
                    if grad.shape != p.data.shape:
                        raise ValueError(f"{kind}.step: parameter {index} (group {gi}) has shape "
                                         f"{p.data.shape}, its .grad has shape {grad.shape}; "
                                         f"nothing was updated")
                index += 1

    def _state_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype of the per-parameter state arrays of a parameter of ``dtype``."""
        return dtype

    # ---- state dicts --------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """``{"state": {index: {name: array or scalar}}, "param_groups": [...]}``.

        Parameters are numbered 0, 1, ... across groups in order; each group
        lists its indices under "params".  Arrays are the optimizer's own (not
        copies).
        """
        index = {}
        groups = []
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                index[id(p)] = len(index)
                ids.append(index[id(p)])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        state = {index[pid]: dict(s) for pid, s in self.state.items() if pid in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore hyper-parameters and state saved by ``state_dict`` (arrays are copied).

        Raises:
            TypeError/ValueError: the structure, group sizes or array shapes do
                not match this optimizer's parameters.
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict \
                or "param_groups" not in state_dict:
            raise TypeError("optimizer state_dict must be a dict with 'state' and 'param_groups'")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved)} parameter groups, the optimizer "
                             f"has {len(self.param_groups)}")
        kind = type(self).__name__
        # Everything is checked before anything changes: a failed load leaves
        # the optimizer as it was.
        groups = []
        for i, (sg, g) in enumerate(zip(saved, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"state_dict group {i} has {len(sg['params'])} parameters, the "
                                 f"optimizer's group has {len(g['params'])}")
            hp = {k: v for k, v in sg.items() if k != "params"}
            unknown = set(hp) - set(self.defaults)
            if unknown:
                raise ValueError(f"state_dict group {i} has hyper-parameters {sorted(unknown)} "
                                 f"that {kind} does not know (the state of another optimizer?)")
            candidate = {**g, **hp}
            self._check_group(candidate)
            groups.append(candidate)
        new_state: Dict[int, Dict[str, Any]] = {}
        by_saved_index = {}
        for sg, g in zip(saved, self.param_groups):
            for si, p in zip(sg["params"], g["params"]):
                by_saved_index[int(si)] = p
        for key, s in state_dict["state"].items():
            key = int(key)
            if key not in by_saved_index:
                raise ValueError(f"state_dict has state for parameter {key}, which no group lists")
            p = by_saved_index[key]
            entry = {}
            for name, v in s.items():
                if name in self._STATE_ARRAYS:
                    # A scalar parameter's buffers are 0-d arrays: kept arrays, so
                    # that step() goes on updating them in place.
                    v = np.asarray(v)
                    if v.shape != p.data.shape:
                        raise ValueError(f"state_dict: state '{name}' of parameter {key} has "
                                         f"shape {v.shape}, the parameter has {p.data.shape}")
                    v = np.array(v, dtype=self._state_dtype(p.data.dtype), copy=True)
                elif name in self._STATE_COUNTS:
                    c = v.item() if isinstance(v, np.ndarray) and v.ndim == 0 else v
                    if isinstance(c, bool) or not isinstance(c, (int, np.integer, float)) \
                            or c < 0 or c != int(c):
                        raise ValueError(f"state_dict: state '{name}' of parameter {key} must "
                                         f"be a count >= 0, got {v!r}")
                    v = int(c)
                else:
                    raise ValueError(f"state_dict: state '{name}' of parameter {key} is not "
                                     f"{kind} state (known: "
                                     f"{sorted(self._STATE_ARRAYS | self._STATE_COUNTS)})")
                entry[name] = v
            new_state[id(p)] = entry
        for g, candidate in zip(self.param_groups, groups):
            g.update(candidate)
        self.state = new_state

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, g in enumerate(self.param_groups):
            hp = ", ".join(f"{k}={v}" for k, v in g.items() if k != "params")
            lines.append(f"  group {i}: {len(g['params'])} params, {hp}")
        return "\n".join(lines) + "\n)"


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, dampening, weight decay and Nesterov.

    Per parameter (torch's rule)::

        g = grad + weight_decay * p
        if momentum:  buf = g (first step) or momentum * buf + (1 - dampening) * g
                      g = g + momentum * buf if nesterov else buf
        p -= lr * g

    Args:
        params: Parameters, or a list of group dicts.
        lr: learning rate (>= 0).
        momentum, dampening, weight_decay: >= 0.
        nesterov: needs momentum > 0 and dampening == 0.
    Raises:
        TypeError/ValueError: bad parameters or hyper-parameters.

    Example::

        opt = SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    """

    _STATE_ARRAYS = frozenset({"momentum_buffer"})

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _check_group(self, g: Dict[str, Any]) -> None:
        for k in ("lr", "momentum", "dampening", "weight_decay"):
            g[k] = _nonneg(g[k], f"SGD {k}")
        g["nesterov"] = bool(g["nesterov"])
        if g["nesterov"] and (g["momentum"] <= 0 or g["dampening"] != 0):
            raise ValueError("SGD: nesterov needs momentum > 0 and dampening == 0")

    def step(self) -> None:
        """Update every parameter that has a gradient, in place.

        Raises:
            TypeError/ValueError: a ``.grad`` is not an array of the parameter's
                shape (checked before any parameter changes).
        """
        self._check_grads()
        for g in self.param_groups:
            lr, mom, damp, wd, nest = (g["lr"], g["momentum"], g["dampening"],
                                       g["weight_decay"], g["nesterov"])
            for p in g["params"]:
                if p.grad is None:
                    continue
                data = p.data
                d_p = p.grad.astype(data.dtype, copy=False)
                if wd != 0:
                    d_p = d_p + wd * data
                if mom != 0:
                    st = self.state.setdefault(id(p), {})
                    buf = st.get("momentum_buffer")
                    if buf is None:
                        buf = st["momentum_buffer"] = np.array(d_p, copy=True)
                    else:
                        buf *= mom
                        buf += (1.0 - damp) * d_p
                    d_p = d_p + mom * buf if nest else buf
                np.subtract(data, lr * d_p, out=data)


class AdamW(Optimizer):
    """Adam with decoupled weight decay (torch's ``AdamW`` rule)::

        p *= 1 - lr * weight_decay
        m = m + (1 - beta1) * (grad - m)
        v = beta2 * v + (1 - beta2) * grad**2
        p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    ``amsgrad=True`` uses the running maximum of ``v`` in the denominator.
    For a float16 parameter the moments are float32 arrays and the update is
    computed in float32, then written into the float16 ``data``.

    Args:
        params: Parameters, or a list of group dicts.
        lr: learning rate; betas: (beta1, beta2) in [0, 1); eps: >= 0;
        weight_decay: decoupled decay factor; amsgrad: see above.
    Raises:
        TypeError/ValueError: bad parameters or hyper-parameters.

    Example::

        opt = AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    """

    _STATE_ARRAYS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
    _STATE_COUNTS = frozenset({"step"})

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad))

    def _check_group(self, g: Dict[str, Any]) -> None:
        for k in ("lr", "eps", "weight_decay"):
            g[k] = _nonneg(g[k], f"AdamW {k}")
        try:
            b1, b2 = g["betas"]
        except (TypeError, ValueError):
            raise TypeError(f"AdamW betas must be a pair of floats, got {g['betas']!r}") from None
        b1, b2 = _nonneg(b1, "AdamW betas[0]"), _nonneg(b2, "AdamW betas[1]")
        if not (b1 < 1.0 and b2 < 1.0):
            raise ValueError(f"AdamW betas must be in [0, 1), got ({b1}, {b2})")
        g["betas"] = (b1, b2)
        g["amsgrad"] = bool(g["amsgrad"])

    def _state_dtype(self, dtype: np.dtype) -> np.dtype:
        # In float16, eps and the squared gradients of typical size (|g| < 5e-3)
        # round to zero, and the update divides by zero.
        return np.dtype(np.float32) if dtype == np.float16 else dtype

    def step(self) -> None:
        """Update every parameter that has a gradient, in place.

        Raises:
            TypeError/ValueError: a ``.grad`` is not an array of the parameter's
                shape (checked before any parameter changes).
        """
        self._check_grads()
        for g in self.param_groups:
            lr, (b1, b2), eps, wd, ams = (g["lr"], g["betas"], g["eps"], g["weight_decay"],
                                          g["amsgrad"])
            for p in g["params"]:
                if p.grad is None:
                    continue
                data = p.data
                sdt = self._state_dtype(data.dtype)
                grad = p.grad.astype(sdt, copy=False)
                st = self.state.setdefault(id(p), {})
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = np.zeros(data.shape, sdt)
                    st["exp_avg_sq"] = np.zeros(data.shape, sdt)
                    if ams:
                        st["max_exp_avg_sq"] = np.zeros(data.shape, sdt)
                st["step"] += 1
                t = st["step"]
                m, v = st["exp_avg"], st["exp_avg_sq"]
                if wd != 0:
                    data *= 1.0 - lr * wd
                m += (1.0 - b1) * (grad - m)
                v *= b2
                v += (1.0 - b2) * (grad * grad)
                bc1 = 1.0 - b1 ** t
                bc2_sqrt = math.sqrt(1.0 - b2 ** t)
                if ams:
                    vmax = st.setdefault("max_exp_avg_sq", np.zeros(data.shape, sdt))
                    np.maximum(vmax, v, out=vmax)
                    v = vmax
                denom = np.sqrt(v) / bc2_sqrt
                denom += eps
                np.subtract(data, (lr / bc1) * (m / denom), out=data)
