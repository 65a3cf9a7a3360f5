"""torch tensors and other buffer objects through every ringlet collective, in place, zero copy."""

from __future__ import annotations

import array
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

import torch.distributed as dist  # noqa: E402

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


# ---- the torch backend's list forms: on the caller's storage, no needless temporary ----
# RingletProcessGroup is built over a recorder of the ringlet group, which notes each
# collective's tensors (data pointer, bytes): a list form that ran on one temporary hands
# ringlet a buffer other than the caller's.  Values are checked against a numpy oracle.

_GATHER_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int8,
                  torch.bool)
_REDUCE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64,
                  torch.int8)


class _Seen:
    """A ringlet group that records the tensors each of its methods is handed."""

    def __init__(self, g):
        self._g, self.calls = g, []

    def __getattr__(self, name):
        attr = getattr(self._g, name)
        if not callable(attr):
            return attr

        def call(*args, **kw):
            self.calls.append((name, [(a.data_ptr(), a.nbytes) for a in args
                                      if isinstance(a, torch.Tensor)]))
            return attr(*args, **kw)
        return call

    def last(self, name):
        return next(bufs for op, bufs in reversed(self.calls) if op == name)


def _pg():
    from ringlet.torch._process_group import RingletProcessGroup, _world_group

    seen = _Seen(_world_group())
    return RingletProcessGroup(seen, seen.timeout), seen


def _block(q, n, dt):
    """Block ``q`` of n values: the numpy oracle (float64) and the tensor of ``dt``."""
    v = (np.arange(n) % 7 + 3 * q).astype(np.float64)
    if dt is torch.bool:
        v = v % 2
    return v, torch.from_numpy(v).to(dt)


def _f64(t):
    return t.reshape(-1).to(torch.float64).numpy()


def _storage(t):
    return (t.data_ptr(), t.nbytes)


def _all_gather_one_storage(rank, P):
    from torch._C._distributed_c10d import AllgatherOptions

    pg, seen = _pg()
    for dt in _GATHER_DTYPES:
        for asynchronous in (True, False):
            opts = AllgatherOptions()
            opts.asyncOp = asynchronous
            what = (dt, asynchronous)
            # Even: list(out.chunk(P)) of a 2-D tensor.
            want = np.concatenate([_block(q, 6, dt)[0] for q in range(P)])
            out = torch.zeros(2 * P, 3, dtype=dt)
            pg.allgather([list(out.chunk(P))], [_block(rank, 6, dt)[1].view(2, 3)], opts).wait()
            assert seen.last("all_gather")[0] == _storage(out), what
            np.testing.assert_array_equal(_f64(out), want, err_msg=str(what))
            # Uneven: out.split(sizes), rank q gives 2(q + 1) values, none padded.
            sizes = [2 * (q + 1) for q in range(P)]
            want = np.concatenate([_block(q, sizes[q], dt)[0] for q in range(P)])
            out = torch.zeros(sum(sizes), dtype=dt)
            pg.allgather([list(out.split(sizes))], [_block(rank, sizes[rank], dt)[1]],
                         opts).wait()
            assert seen.last("all_gather_v")[0] == _storage(out), what
            np.testing.assert_array_equal(_f64(out), want, err_msg=str(what))
            # In place, even and uneven: the input is this rank's own view.
            for sz in ([4] * P, sizes):
                want = np.concatenate([_block(q, sz[q], dt)[0] for q in range(P)])
                out = torch.zeros(sum(sz), dtype=dt)
                outs = list(out.split(sz))
                outs[rank].copy_(_block(rank, sz[rank], dt)[1])
                pg.allgather([outs], [outs[rank]], opts).wait()
                assert seen.last("all_gather_v" if sz is sizes else "all_gather")[0] == \
                    _storage(out), what
                np.testing.assert_array_equal(_f64(out), want, err_msg=str(what))
            # Uneven with the input inside the output elsewhere than its block: the
            # input is copied (all_gather_v refuses that overlap), the output is not.
            want = np.concatenate([_block(q, sizes[q], dt)[0] for q in range(P)])
            out = torch.zeros(sum(sizes), dtype=dt)
            x = out[sum(sizes) - sizes[rank]:] if rank == 0 else out[:sizes[rank]]
            x.copy_(_block(rank, sizes[rank], dt)[1])
            pg.allgather([list(out.split(sizes))], [x], opts).wait()
            assert seen.last("all_gather_v")[0] == _storage(out), what
            np.testing.assert_array_equal(_f64(out), want, err_msg=str(what))
    return True


@pytest.mark.parametrize("P", [2, 3])
def test_list_all_gather_runs_on_one_storage(P):
    # The list form gathered into a temporary of P x the largest block (uneven sizes
    # padded to it) and copied every block out; views of one tensor, in order, now
    # receive in place.
    assert run_world(_all_gather_one_storage, P, timeout=120) == [True] * P


def _all_gather_apart(rank, P):
    pg, seen = _pg()
    for dt in _GATHER_DTYPES:
        item = torch.empty(0, dtype=dt).element_size()
        sizes = [q + 2 for q in range(P)]
        outs = [torch.zeros(s, dtype=dt) for s in sizes]
        pg.allgather([outs], [_block(rank, sizes[rank], dt)[1]]).wait()
        # One temporary of the blocks' total: no block padded to the largest.
        assert seen.last("all_gather_v")[0][1] == sum(sizes) * item, dt
        for q, o in enumerate(outs):
            np.testing.assert_array_equal(_f64(o), _block(q, sizes[q], dt)[0], err_msg=str(dt))
        # Even: tensors apart, views out of order (not one span), non-contiguous ones.
        base = torch.zeros(6 * P, dtype=dt)
        for outs in ([torch.zeros(6, dtype=dt) for _ in range(P)],
                     list(base.chunk(P))[::-1],
                     [torch.zeros(3, 2, dtype=dt).t() for _ in range(P)]):
            pg.allgather([outs], [_block(rank, 6, dt)[1]]).wait()
            assert seen.last("all_gather")[0][1] == 6 * P * item, dt
            for q, o in enumerate(outs):
                np.testing.assert_array_equal(_f64(o), _block(q, 6, dt)[0], err_msg=str(dt))
    return True


@pytest.mark.parametrize("P", [2, 3])
def test_list_all_gather_apart_uses_one_unpadded_temporary(P):
    assert run_world(_all_gather_apart, P, timeout=120) == [True] * P


def _gather_scatter_one_storage(rank, P):
    pg, seen = _pg()
    root = P - 1
    for dt in _GATHER_DTYPES:
        gopts = dist.GatherOptions()
        gopts.rootRank = root
        want = np.concatenate([_block(q, 4, dt)[0] for q in range(P)])
        x = _block(rank, 4, dt)[1]
        if rank == root:
            out = torch.zeros(4 * P, dtype=dt)
            pg.gather([list(out.chunk(P))], [x], gopts).wait()
            assert seen.last("gather")[0] == _storage(out), dt
            np.testing.assert_array_equal(_f64(out), want, err_msg=str(dt))
            outs = [torch.zeros(4, dtype=dt) for _ in range(P)]  # apart: correct too
            pg.gather([outs], [x], gopts).wait()
            np.testing.assert_array_equal(np.concatenate([_f64(o) for o in outs]), want)
        else:
            pg.gather([], [x], gopts).wait()
            pg.gather([], [x], gopts).wait()
        sopts = dist.ScatterOptions()
        sopts.rootRank = 0
        out = torch.zeros(4, dtype=dt)
        if rank == 0:
            inp = torch.cat([_block(q, 4, dt)[1] for q in range(P)])
            pg.scatter([out], [list(inp.chunk(P))], sopts).wait()
            assert seen.last("scatter")[1] == _storage(inp), dt
        else:
            pg.scatter([out], [], sopts).wait()
        np.testing.assert_array_equal(_f64(out), _block(rank, 4, dt)[0], err_msg=str(dt))
        # The root's output is its own block of the input (in place).
        if rank == 0:
            inp = torch.cat([_block(q, 4, dt)[1] for q in range(P)])
            ins = list(inp.chunk(P))
            out = ins[0]
            pg.scatter([out], [ins], sopts).wait()
            assert seen.last("scatter")[1] == _storage(inp), dt
        else:
            out = torch.zeros(4, dtype=dt)
            pg.scatter([out], [], sopts).wait()
        np.testing.assert_array_equal(_f64(out), _block(rank, 4, dt)[0], err_msg=str(dt))
    return True


@pytest.mark.parametrize("P", [2, 3])
def test_list_gather_scatter_run_on_one_storage(P):
    assert run_world(_gather_scatter_one_storage, P, timeout=120) == [True] * P


def _reductions_one_storage(rank, P):
    pg, seen = _pg()
    for dt in _REDUCE_DTYPES:
        # reduce_scatter: rank r's block q holds _block(r + q); rank q gets the sum over r.
        want = sum(_block(r + rank, 4, dt)[0] for r in range(P))
        inp = torch.cat([_block(rank + q, 4, dt)[1] for q in range(P)])
        ins = list(inp.chunk(P))
        o = torch.zeros(4, dtype=dt)
        pg.reduce_scatter([o], [ins]).wait()
        assert seen.last("reduce_scatter")[1] == _storage(inp), dt
        np.testing.assert_array_equal(_f64(o), want, err_msg=str(dt))
        o = torch.zeros(4, dtype=dt)
        pg.reduce_scatter([o], [[t.clone() for t in ins]]).wait()  # apart
        np.testing.assert_array_equal(_f64(o), want, err_msg=str(dt))
        o = ins[rank]  # the output among the inputs: copied first, as reduce_scatter refuses
        pg.reduce_scatter([o], [ins]).wait()
        np.testing.assert_array_equal(_f64(o), want, err_msg=str(dt))
        # all_to_all: rank r's block j is _block(r * P + j); rank j keeps it as block r.
        inp = torch.cat([_block(rank * P + j, 3, dt)[1] for j in range(P)])
        out = torch.zeros(3 * P, dtype=dt)
        pg.alltoall(list(out.chunk(P)), list(inp.chunk(P))).wait()
        assert seen.last("all_to_all_v")[:2] == [_storage(out), _storage(inp)], dt
        want = np.concatenate([_block(s * P + rank, 3, dt)[0] for s in range(P)])
        np.testing.assert_array_equal(_f64(out), want, err_msg=str(dt))
        outs = [torch.zeros(3, dtype=dt) for _ in range(P)]  # apart
        pg.alltoall(outs, [t.clone() for t in inp.chunk(P)]).wait()
        np.testing.assert_array_equal(np.concatenate([_f64(x) for x in outs]), want)
        # all_reduce_coalesced over out.split: reduced in place.
        buf = torch.cat([_block(rank, 3, dt)[1], _block(rank + 1, 5, dt)[1]])
        want = sum(_f64(torch.cat([_block(r, 3, dt)[1], _block(r + 1, 5, dt)[1]]))
                   for r in range(P))
        pg.allreduce_coalesced(list(buf.split([3, 5]))).wait()
        assert seen.last("all_reduce")[0] == _storage(buf), dt
        np.testing.assert_array_equal(_f64(buf), want, err_msg=str(dt))
    return True


@pytest.mark.parametrize("P", [2, 3])
def test_list_reduce_scatter_all_to_all_coalesced_run_on_one_storage(P):
    # reduce_scatter's list form concatenated its inputs into a temporary (and
    # all_to_all's both sides); views of one tensor, in order, are now used as they are.
    assert run_world(_reductions_one_storage, P, timeout=120) == [True] * P


def test_span_finds_back_to_back_views_only():
    from ringlet.torch._process_group import _span

    out = torch.arange(12, dtype=torch.float32)
    s = _span(list(out.chunk(4)), torch.float32)
    assert s is not None and _storage(s) == _storage(out)
    part = out[2:10]  # a span that starts inside its storage
    s = _span(list(part.split([3, 0, 5])), torch.float32)  # an empty piece holds no bytes
    assert s is not None and _storage(s) == _storage(part) and s.tolist() == part.tolist()
    m = torch.zeros(4, 3)
    assert _storage(_span(list(m.chunk(2)), torch.float32)) == _storage(m)
    assert _span(list(out.chunk(4))[::-1], torch.float32) is None         # out of order
    assert _span(list(out.chunk(4))[::2], torch.float32) is None          # a gap
    assert _span([out[:3], out[:3]], torch.float32) is None               # the same twice
    assert _span([out[:3], torch.zeros(3)], torch.float32) is None        # two storages
    assert _span(list(out.chunk(4)), torch.float64) is None               # another dtype
    assert _span(list(m.chunk(3, dim=1)), torch.float32) is None          # non-contiguous
    assert _span([torch.zeros(0)], torch.float32) is None                 # nothing to span


# ---- the in-place tensor forms: output sharing memory with input -----------------------------
# reduce_scatter_single with output = input.chunk(P)[rank] (in place, as NCCL and gloo take
# it) and all_to_all_single with one tensor on both sides were refused ("output must not
# overlap input").  Checked against numpy, the reduce_scatter also against gloo.

def _gloo(store, rank, P):
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, P, timedelta(seconds=60))


def _in_place(rank, P, store):
    pg, seen = _pg()
    gloo = _gloo(store, rank, P)
    for dt in _REDUCE_DTYPES:
        for asynchronous in (True, False):
            what = (dt, asynchronous)
            ropts = dist.ReduceScatterOptions()
            ropts.asyncOp = asynchronous
            # rank r's block q is _block(r + q); rank q's result is their sum over r.
            inp = torch.cat([_block(rank + q, 4, dt)[1] for q in range(P)])
            want = sum(_block(r + rank, 4, dt)[0] for r in range(P))
            ref = inp.clone()
            pg.reduce_scatter_single(inp.chunk(P)[rank], inp, ropts).wait()
            np.testing.assert_array_equal(_f64(inp.chunk(P)[rank]), want, err_msg=str(what))
            gloo._reduce_scatter_base(ref.chunk(P)[rank], ref, ropts).wait()
            np.testing.assert_array_equal(_f64(ref.chunk(P)[rank]), want, err_msg=f"gloo {what}")
            # Coalesced, one pair in place, one apart: only the first through a temporary.
            inp = torch.cat([_block(rank + q, 4, dt)[1] for q in range(P)])
            other = inp.clone()
            apart = torch.zeros(4, dtype=dt)
            pg.reduce_scatter_single_coalesced([inp.chunk(P)[rank], apart], [inp, other],
                                               ropts).wait()
            assert seen.last("reduce_scatter")[0] == _storage(apart), what
            for o in (inp.chunk(P)[rank], apart):
                np.testing.assert_array_equal(_f64(o), want, err_msg=str(what))
            # An output overlapping the input elsewhere than its own block.
            buf = torch.cat([_block(rank + q, 4, dt)[1] for q in range(P)])
            pg.reduce_scatter_single(buf[2:6], buf, ropts).wait()
            np.testing.assert_array_equal(_f64(buf[2:6]), want, err_msg=str(what))

            # all_to_all in place: rank s's block j is _block(s * P + j), rank j keeps it as
            # block s.  Against numpy only: gloo's in-place all_to_all overwrites blocks
            # before it sends them.
            aopts = dist.AllToAllOptions()
            aopts.asyncOp = asynchronous
            want = np.concatenate([_block(s * P + rank, 3, dt)[0] for s in range(P)])
            buf = torch.cat([_block(rank * P + j, 3, dt)[1] for j in range(P)])
            pg.all_to_all_single(buf, buf, None, None, aopts).wait()
            assert seen.last("all_to_all")[0] == _storage(buf), what  # the output in place
            np.testing.assert_array_equal(_f64(buf), want, err_msg=str(what))
            # Uneven splits (rows of 2), in place: rank s sends (s + j) % P + 1 rows to j,
            # each row (10 s + j, j); as many rows come in as go out.
            rows = [(rank + j) % P + 1 for j in range(P)]
            buf = torch.cat([torch.tensor([[10 * rank + j, j]] * rows[j], dtype=dt)
                             for j in range(P)])
            want = np.concatenate([np.array([[10 * s + rank, rank]] * rows[s], np.float64)
                                   for s in range(P)]).reshape(-1)
            pg.all_to_all_single(buf, buf, rows, rows, aopts).wait()
            np.testing.assert_array_equal(_f64(buf), want, err_msg=str(what))
    return True


@pytest.mark.parametrize("P", [2, 3])
def test_in_place_reduce_scatter_and_all_to_all_single(P):
    assert run_world(_in_place, P, timeout=180, args=(dist.HashStore(),)) == [True] * P
