"""torch tensors and other buffer objects through every ringlet collective, in place, zero copy."""

from __future__ import annotations

import array

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

import ringlet  # noqa: E402
from ringlet import ReduceOp  # noqa: E402
from ringlet._buffers import as_array  # noqa: E402
from ringlet.testing import run_world  # noqa: E402


def test_views_share_memory():
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8,
               torch.uint8, torch.bool, torch.float64, torch.int32):
        t = torch.zeros(5, dtype=dt)
        v = as_array(t, "array", True)
        assert v.ctypes.data == t.data_ptr() and v.size == 5, dt
    bf = as_array(torch.ones(3, dtype=torch.bfloat16), "array", True)
    assert bf.dtype == np.dtype(ml_dtypes.bfloat16)
    p = torch.nn.Parameter(torch.ones(3))  # tracks gradients: a detached view, same storage
    assert as_array(p, "array", True).ctypes.data == p.data_ptr()
    a = array.array("d", [1.0, 2.0])
    v = as_array(a, "array", True)
    assert v.dtype == np.float64 and v.ctypes.data == a.buffer_info()[0]
    m = memoryview(bytearray(8)).cast("i")
    assert as_array(m, "array", True).dtype == np.int32
    # Any DLPack producer (here a shim that is not a torch tensor) is viewed in place.
    class Producer:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, **kw):
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()
    t = torch.arange(4, dtype=torch.float32)
    assert as_array(Producer(t), "array", True).ctypes.data == t.data_ptr()


def test_clear_errors_before_any_byte():
    with pytest.raises(TypeError, match=r"array must be a numpy.ndarray, a CPU torch tensor.*"
                                        r"got list"):
        as_array([1.0, 2.0], "array", True)
    with pytest.raises(ValueError, match=r"output is a non-contiguous torch tensor.*"
                                         r"output.contiguous\(\)"):
        as_array(torch.zeros(4, 4).t(), "output", True)
    with pytest.raises(ValueError, match=r"array is a read-only memoryview"):
        as_array(memoryview(b"12345678"), "array", True)
    assert as_array(memoryview(b"12345678"), "input", False).size == 8  # inputs may be read-only


def test_off_cpu_tensor_named():
    # A CUDA tensor takes this path; the test hosts have no GPU, and a meta tensor is
    # off the CPU in the same way.
    with pytest.raises(TypeError, match=r"array is a torch tensor on meta.*array.cpu\(\)"):
        as_array(torch.zeros(2, device="meta"), "array", True)
    if torch.cuda.is_available():
        with pytest.raises(TypeError, match=r"torch tensor on cuda"):
            as_array(torch.zeros(2, device="cuda"), "array", True)


def _every_op(rank, P):
    out = {}
    # Bad arguments fail at the call, naming the argument, and leave the group usable.
    with pytest.raises(TypeError, match=r"array has unsupported dtype complex64"):
        ringlet.all_reduce(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"output is a non-contiguous torch tensor"):
        ringlet.all_gather(torch.zeros(P, 2).t(), torch.zeros(2))
    with pytest.raises(ValueError, match=r"array is a read-only bytes"):
        ringlet.recv(b"\0" * 4, (rank + 1) % P)
    # all_reduce / broadcast / reduce on tensors of several dtypes, in place
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int16,
               torch.uint16, torch.uint32, torch.uint64):
        t = torch.full((7,), rank + 1, dtype=dt)
        ptr = t.data_ptr()
        ringlet.all_reduce(t)
        assert t.data_ptr() == ptr
        assert torch.all(t.float() == P * (P + 1) / 2), (dt, t)
    t = torch.full((5,), float(rank))
    ringlet.all_reduce(t, ReduceOp.MAX)
    assert torch.all(t == P - 1)
    t = torch.full((3,), float(rank))
    ringlet.broadcast(t, src=P - 1)
    assert torch.all(t == P - 1)
    t = torch.full((3,), float(rank + 1))
    ringlet.reduce(t, dst=0)
    if rank == 0:
        assert torch.all(t == P * (P + 1) / 2)
    # all_gather / reduce_scatter / all_to_all / all_to_all_v
    o = torch.empty(P * 2, dtype=torch.int32)
    ringlet.all_gather(o, torch.tensor([rank, -rank], dtype=torch.int32))
    assert o.tolist() == [v for r in range(P) for v in (r, -r)]
    o = torch.empty(2)
    ringlet.reduce_scatter(o, torch.arange(2 * P, dtype=torch.float32))
    assert o.tolist() == [P * (2 * rank), P * (2 * rank + 1)]
    o = torch.empty(P, dtype=torch.int64)
    ringlet.all_to_all(o, torch.arange(P, dtype=torch.int64) + 100 * rank)
    assert o.tolist() == [100 * r + rank for r in range(P)]
    ic = [r + 1 for r in range(P)]           # rank sends r+1 elements to rank r
    oc = [rank + 1] * P                      # and gets rank+1 from everyone
    o = torch.empty(sum(oc), dtype=torch.float64)
    ringlet.all_to_all_v(o, oc, torch.full((sum(ic),), float(rank), dtype=torch.float64), ic)
    assert o.tolist() == [float(r) for r in range(P) for _ in range(rank + 1)]
    o = torch.empty(sum(ic), dtype=torch.bfloat16)  # all_gather_v: rank r gives r+1 values
    ringlet.all_gather_v(o, ic, torch.full((rank + 1,), float(rank), dtype=torch.bfloat16))
    assert o.tolist() == [float(r) for r in range(P) for _ in range(r + 1)]
    # gather_v / scatter_v: rank r's block is r + 1 values
    o = torch.empty(sum(ic), dtype=torch.int16) if rank == 0 else None
    ringlet.gather_v(o, ic if rank == 0 else None, torch.full((rank + 1,), rank, dtype=torch.int16))
    if rank == 0:
        assert o.tolist() == [r for r in range(P) for _ in range(r + 1)]
    o = torch.empty(rank + 1, dtype=torch.float32)
    ringlet.scatter_v(o, torch.arange(sum(ic), dtype=torch.float32) if rank == 0 else None,
                      ic if rank == 0 else None)
    start = sum(ic[:rank])
    assert o.tolist() == [float(v) for v in range(start, start + rank + 1)]
    # gather / scatter with tensors
    o = torch.empty(P, dtype=torch.float32) if rank == 0 else None
    ringlet.gather(o, torch.tensor([float(rank)]), dst=0)
    if rank == 0:
        assert o.tolist() == [float(r) for r in range(P)]
    o = torch.empty(1)
    ringlet.scatter(o, torch.arange(P, dtype=torch.float32) * 3 if rank == 1 else None, src=1)
    assert o.item() == 3 * rank
    # point to point: tensor out, array.array / memoryview in, plus an async pair
    right, left = (rank + 1) % P, (rank - 1) % P
    buf = array.array("f", [0.0, 0.0])
    w = ringlet.isend(torch.tensor([rank, rank * 2], dtype=torch.float32), right, tag=3)
    ringlet.recv(memoryview(buf), left, tag=3)
    w.wait()
    assert list(buf) == [left, left * 2]
    back = torch.zeros(2, dtype=torch.bfloat16)
    w = ringlet.irecv(back, right, tag=4)
    ringlet.send(torch.tensor([1.5, rank], dtype=torch.bfloat16), left, tag=4)
    w.wait()
    assert back.tolist() == [1.5, float(right)]
    # async collective on a tensor: the result lands in the tensor
    t = torch.ones(1000)
    ringlet.all_reduce(t, async_op=True).wait()
    assert torch.all(t == P)
    # array.array and writable memoryview through a collective
    a = array.array("i", [rank] * 4)
    ringlet.all_reduce(a, ReduceOp.MAX)
    assert list(a) == [P - 1] * 4
    out["ok"] = True
    return out


@pytest.mark.parametrize("P", [2, 3])
def test_every_op_takes_tensors(P):
    res = run_world(_every_op, P, timeout=60)
    assert all(r["ok"] for r in res)
