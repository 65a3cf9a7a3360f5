"""The wire layer is one: one dtype registry that agrees with the C core."""

import os
import re

import numpy as np
import pytest

from ringlet import _core, _dtypes
from ringlet.checkpoint import format as ckpt_format
from ringlet.pipeline import runtime as pp_runtime
from ringlet.rpc import serialization as rpc_ser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def _header_enum(name):
    """{enumerator: value} of ``typedef enum {...} name;`` in csrc/ringlet.h."""
    m = re.search(r"typedef enum \{([^}]*)\}\s*" + name + r"\s*;", _read("csrc/ringlet.h"))
    assert m, f"enum {name} not found in csrc/ringlet.h"
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    return {k: int(v) for k, v in re.findall(r"(RL_\w+)\s*=\s*(\d+)", body)}


def test_registry_matches_ringlet_h():
    enum = _header_enum("rl_dtype")
    ndtypes = enum.pop("RL_NDTYPES")
    core = {e.c_name: e.core for e in _dtypes.REGISTRY if e.c_name is not None}
    assert core == enum, f"registry {core} != csrc/ringlet.h {enum}"
    assert sorted(enum.values()) == list(range(ndtypes))
    assert len(_dtypes.CORE_NAMES) == ndtypes


def test_registry_names_match_kernels_c():
    # rl_dtype_name (flight records, C error messages) says the numpy name.
    names = dict(re.findall(r"case (RL_\w+):\s*return \"(\w+)\";", _read("csrc/kernels.c")))
    for e in _dtypes.REGISTRY:
        if e.c_name is not None:
            assert names.get(e.c_name) == e.name, (e.c_name, names.get(e.c_name), e.name)


def test_reduce_ops_match_ringlet_h():
    enum = _header_enum("rl_redop")
    enum.pop("RL_NOPS")
    assert {f"RL_{op.name}": int(op) for op in _dtypes.ReduceOp} == enum


@pytest.mark.parametrize("name", _dtypes.CORE_NAMES)
def test_binding_maps_every_core_dtype_to_its_code(name):
    # _core maps numpy's built-in types itself, by type number; the registry
    # handles the rest (bfloat16).  Both must give the header's code.
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(name)
    want = _dtypes.CORE_NAMES.index(name)
    assert _core.array_code(np.zeros(3, dt), "x", False, _dtypes.dtype_code) == want
    assert _dtypes.dtype_code(dt) == want
    assert pp_runtime._dtype_code(dt) == want
    assert pp_runtime._dtype_of(want) == dt


def test_other_tables_are_the_registry():
    assert pp_runtime._DTYPES is _dtypes.CORE_NAMES
    assert rpc_ser.ALLOWED_DTYPES is _dtypes.CODEC_DTYPES
    assert ckpt_format._ST_CODES is _dtypes.SAFETENSORS_CODES
    # Every core dtype is storable; every codec dtype is a real numpy dtype.
    assert set(_dtypes.CORE_NAMES) <= set(_dtypes.SAFETENSORS_CODES)
    for s in _dtypes.CODEC_DTYPES:
        assert np.dtype(s).kind in "biufc"


def test_unsupported_dtype_named_everywhere():
    with pytest.raises(TypeError, match="uint16"):
        _dtypes.dtype_code(np.dtype(np.uint16))
    with pytest.raises(TypeError, match="uint16"):
        pp_runtime._dtype_code(np.dtype(np.uint16))
    with pytest.raises(TypeError, match="complex64"):
        ckpt_format.dtype_name(np.complex64, "w")
