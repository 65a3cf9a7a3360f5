"""State dicts: flattening to dotted keys, value encoding, rebuilding on load.

A state dict is a (nested) dict whose leaves are
* ``numpy.ndarray``: a full tensor;
* ``ShardedTensor``: this rank's piece of a tensor;
* a *value*: None, bool, int, float, str, or a list/tuple of values (and
  dicts with str keys inside such lists), stored in the manifest as JSON.
  numpy scalars (``np.float32(1)``) are stored as the Python number.

Nested dicts flatten to dotted keys: ``{"optim": {"state": {0: {...}}}}`` ->
``"optim.state.0...."``; int keys become their decimal string.  Two paths that
flatten to the same key (``{"a.b": 1, "a": {"b": 2}}``) are rejected.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Iterator, Tuple

import numpy as np

from .shard import ShardedTensor

MAX_DEPTH = 64

Leaf = Any  # np.ndarray | ShardedTensor | value


def _key_str(k: Any, prefix: str) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)):
        return str(int(k))
    raise TypeError(f"state_dict key {k!r} under {prefix or 'the top level'!r} must be a str "
                    f"or int, got {type(k).__name__}")


def walk(state: Any, prefix: str = "", depth: int = 0) -> Iterator[Tuple[str, Any, Any]]:
    """Yield (dotted key, original key path tuple, leaf) for every leaf."""
    if depth > MAX_DEPTH:
        raise ValueError(f"state_dict nesting under {prefix!r} is deeper than {MAX_DEPTH}")
    for k, v in state.items():
        name = _key_str(k, prefix)
        if name == "":
            raise ValueError(f"empty key under {prefix or 'the top level'!r}")
        full = f"{prefix}.{name}" if prefix else name
        if isinstance(v, dict):
            yield from walk(v, full, depth + 1)
        else:
            yield full, v


def flatten(state: Any, what: str = "state_dict") -> Dict[str, Leaf]:
    """Dotted key -> leaf, validating every leaf.  Raises TypeError/ValueError."""
    if not isinstance(state, dict):
        raise TypeError(f"{what} must be a dict, got {type(state).__name__}")
    out: Dict[str, Leaf] = {}
    for key, leaf in walk(state):
        if key in out:
            raise ValueError(f"{what}: two entries flatten to the same key {key!r}")
        if isinstance(leaf, (np.ndarray, ShardedTensor)):
            out[key] = leaf
        else:
            out[key] = encode_value(leaf, key)
    return out


# ---- values (stored as JSON) ------------------------------------------------------
# JSON has no NaN/Infinity; they are tagged so the manifest stays strict JSON.
_FLOAT_TAG = "$float"


def encode_value(v: Any, key: str, depth: int = 0) -> Any:
    """A JSON-ready copy of a value; TypeError naming ``key`` when unsupported."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value {key!r} is nested deeper than {MAX_DEPTH}")
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        f = float(v)
        if math.isfinite(f):
            return f
        return {_FLOAT_TAG: "nan" if math.isnan(f) else ("inf" if f > 0 else "-inf")}
    if isinstance(v, (list, tuple)):
        return [encode_value(x, f"{key}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, dict) and depth > 0:  # dicts inside lists stay JSON objects
        if not all(isinstance(k, str) for k in v):
            raise TypeError(f"value {key!r}: dicts inside lists need str keys")
        if _FLOAT_TAG in v:
            raise ValueError(f"value {key!r}: the key {_FLOAT_TAG!r} is reserved")
        return {k: encode_value(x, f"{key}.{k}", depth + 1) for k, x in v.items()}
    if isinstance(v, np.ndarray):  # only reachable inside a list
        raise TypeError(f"value {key!r} is a numpy array inside a list; put arrays directly in "
                        f"a dict so they are stored as tensors")
    raise TypeError(f"state_dict[{key!r}] has unsupported type {type(v).__name__}; a state "
                    f"dict holds numpy arrays, ShardedTensors, nested dicts, and None/bool/int/"
                    f"float/str or lists of those")


def decode_value(v: Any) -> Any:
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {_FLOAT_TAG}:
            return float(v[_FLOAT_TAG])
        return {k: decode_value(x) for k, x in v.items()}
    return v


def canonical(v: Any) -> str:
    """A string that is equal for equal encoded values (for cross-rank comparison)."""
    return json.dumps(v, sort_keys=True, allow_nan=False, separators=(",", ":"))


def rebuild(template: dict, values: Dict[str, Any], prefix: str = "") -> dict:
    """A copy of ``template``'s structure: arrays kept (same objects), values replaced.

    ``values`` maps dotted keys to decoded values; keys not in it keep the
    template's value.
    """
    out = {}
    for k, v in template.items():
        name = _key_str(k, prefix)
        full = f"{prefix}.{name}" if prefix else name
        if isinstance(v, dict):
            out[k] = rebuild(v, values, full)
        elif isinstance(v, (np.ndarray, ShardedTensor)):
            out[k] = v
        else:
            out[k] = values.get(full, v)
    return out
