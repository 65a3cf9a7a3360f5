"""Bad arguments are refused before any byte is sent, with a message naming the problem."""

from __future__ import annotations

import numpy as np
import pytest

import ringlet
from ringlet import ReduceOp
from ringlet.testing import run_world


def _cases(rank, P):
    """Run every bad call on both ranks; afterwards the group must still work."""
    f = np.zeros(8, np.float32)
    results = []

    def expect(exc_type, words, fn):
        try:
            fn()
        except exc_type as exc:
            msg = str(exc)
            missing = [w for w in words if w not in msg]
            results.append((exc_type.__name__, msg, missing))
        except Exception as exc:  # noqa: BLE001
            results.append(("WRONG " + type(exc).__name__, str(exc), words))
        else:
            results.append(("NO ERROR", "", words))

    expect(ValueError, ["C-contiguous"], lambda: ringlet.all_reduce(np.zeros((4, 4), np.float32)[:, 0]))
    ro = np.zeros(4, np.float32)
    ro.setflags(write=False)
    expect(ValueError, ["read-only"], lambda: ringlet.all_reduce(ro))
    expect(TypeError, ["complex64", "supported"], lambda: ringlet.all_reduce(np.zeros(4, np.complex64)))
    expect(TypeError, ["object"], lambda: ringlet.broadcast(np.array([None, 1], dtype=object)))
    expect(TypeError, ["numpy.ndarray", "list"], lambda: ringlet.all_reduce([1.0, 2.0]))
    expect(ValueError, ["BXOR", "float32"], lambda: ringlet.all_reduce(f, ReduceOp.BXOR))
    expect(ValueError, ["AVG", "int32"], lambda: ringlet.all_reduce(np.zeros(3, np.int32), ReduceOp.AVG))
    expect(ValueError, ["unknown reduction op"], lambda: ringlet.all_reduce(f, 99))
    expect(ValueError, ["src=5", "size 2"], lambda: ringlet.broadcast(f, src=5))
    expect(ValueError, ["dst=-1"], lambda: ringlet.reduce(f, dst=-1))
    expect(TypeError, ["src", "int"], lambda: ringlet.broadcast(f, src="0"))
    expect(TypeError, ["src", "int", "bool"], lambda: ringlet.broadcast(f, src=True))
    expect(ValueError, ["dst=2", "size 2"], lambda: ringlet.gather(None, f, dst=np.int64(2)))
    expect(ValueError, ["all_gather", "16"], lambda: ringlet.all_gather(np.zeros(9, np.float32), f))
    expect(TypeError, ["all_gather", "dtype"], lambda: ringlet.all_gather(np.zeros(16, np.float64), f))
    expect(ValueError, ["reduce_scatter", "16"], lambda: ringlet.reduce_scatter(f, np.zeros(9, np.float32)))
    expect(ValueError, ["overlap"], lambda: ringlet.reduce_scatter(f[:4], f))
    expect(ValueError, ["all_to_all", "divisible"], lambda: ringlet.all_to_all(np.zeros(3, np.float32), np.zeros(3, np.float32)))
    expect(ValueError, ["all_to_all", "4 elements", "input 8"], lambda: ringlet.all_to_all(np.zeros(4, np.float32), f))
    expect(TypeError, ["all_to_all", "int32", "float32"], lambda: ringlet.all_to_all(np.zeros(8, np.int32), f))
    expect(ValueError, ["all_to_all", "overlap"], lambda: ringlet.all_to_all(f, f))
    expect(TypeError, ["reduce_scatter", "float64", "float32"], lambda: ringlet.reduce_scatter(np.zeros(8, np.float64), f))
    expect(ValueError, ["output", "read-only"], lambda: ringlet.all_to_all(ro[:2], np.zeros(2, np.float32)))
    expect(ValueError, ["input", "C-contiguous"], lambda: ringlet.reduce_scatter(f[:2], np.zeros((4, 4), np.float32)[:, 0]))
    expect(ValueError, ["input_counts", "entries"], lambda: ringlet.all_to_all_v(f, [4, 4], f, [8]))
    expect(ValueError, ["negative"], lambda: ringlet.all_to_all_v(f, [4, 4], f, [-1, 9]))
    expect(ValueError, ["output_counts", "entries"], lambda: ringlet.all_gather_v(f, [4], f[:4]))
    expect(ValueError, ["negative"], lambda: ringlet.all_gather_v(f, [-1, 9], f[:1]))
    expect(TypeError, ["all_gather_v", "output_counts", "integers"], lambda: ringlet.all_gather_v(f, [4, None], f[:4]))
    expect(TypeError, ["all_to_all_v", "input_counts", "integers"], lambda: ringlet.all_to_all_v(f, [4, 4], f, 8))
    expect(ValueError, ["sum to 17", "16"], lambda: ringlet.all_gather_v(np.zeros(16, np.float32), [8, 9], np.zeros(9 if rank else 8, np.float32)))
    expect(ValueError, [f"output_counts[{rank}]", "input has 3"], lambda: ringlet.all_gather_v(np.zeros(8, np.float32), [4, 4], np.zeros(3, np.float32)))
    expect(TypeError, ["all_gather_v", "float64", "float32"], lambda: ringlet.all_gather_v(np.zeros(8), [4, 4], np.zeros(4, np.float32)))
    g = np.zeros(16, np.float32)  # an input shifted by one from a block of the output
    expect(ValueError, ["overlaps", "in-place"], lambda: ringlet.all_gather_v(g[:8], [4, 4], g[4 * (1 - rank) + 1:4 * (1 - rank) + 5]))
    expect(ValueError, ["gather_v", "output_counts"], lambda: ringlet.gather_v(f, None, f[:4], dst=rank))
    expect(ValueError, ["output_counts", "3 entries"], lambda: ringlet.gather_v(f, [4, 2, 2], f[:4], dst=rank))
    expect(ValueError, [f"output_counts[{rank}]", "input has 3"], lambda: ringlet.gather_v(f, [4, 4], f[:3], dst=rank))
    expect(TypeError, ["gather_v", "float64", "float32"], lambda: ringlet.gather_v(np.zeros(8), [4, 4], f[:4], dst=rank))
    expect(ValueError, ["gather_v", "overlaps", "in-place"], lambda: ringlet.gather_v(f, [4, 4], f[4 * (1 - rank):4 * (1 - rank) + 4], dst=rank))
    expect(ValueError, ["scatter_v", "input_counts"], lambda: ringlet.scatter_v(f[:4], f, None, src=rank))
    expect(ValueError, ["negative"], lambda: ringlet.scatter_v(f[:4], f, [-1, 9], src=rank))
    expect(ValueError, ["sum to 10", "8"], lambda: ringlet.scatter_v(f[:5], f, [5, 5], src=rank))
    expect(ValueError, [f"input_counts[{rank}]", "output has 2"], lambda: ringlet.scatter_v(f[:2], np.zeros(8, np.float32), [4, 4], src=rank))
    expect(ValueError, ["scatter_v", "overlaps", "in-place"], lambda: ringlet.scatter_v(f[1:5], f, [4, 4], src=rank))
    expect(ValueError, ["gather", "output"], lambda: ringlet.gather(None, f, dst=rank))
    expect(ValueError, ["scatter", "input"], lambda: ringlet.scatter(f, None, src=rank))
    expect(ValueError, ["this rank"], lambda: ringlet.send(f, rank))
    expect(ValueError, ["tag"], lambda: ringlet.send(f, 1 - rank, tag=-3))
    expect(ValueError, ["tag"], lambda: ringlet.recv(f, 1 - rank, tag=2**32))
    expect(ValueError, ["timeout"], lambda: ringlet.all_reduce(f, timeout=0))
    expect(ValueError, ["timeout", "nan"], lambda: ringlet.all_reduce(f, timeout=float("nan")))
    expect(ValueError, ["timeout", "-1"], lambda: ringlet.barrier(timeout=-1))
    expect(TypeError, ["timeout", "str"], lambda: ringlet.broadcast(f, timeout="5"))
    # A root whose output overlaps its input anywhere but its own block would
    # send overwritten data (it copies its own block first): refused.
    for start in (4 * (1 - rank), 2, 4 * rank + 1):  # a peer's block, straddling, shifted own
        buf = np.arange(9, dtype=np.float32)
        expect(ValueError, ["scatter", "overlaps", f"block {rank}"],
               lambda: ringlet.scatter(buf[start:start + 4], buf[:8], src=rank))
    # asynchronous calls refuse bad arrays at the call site, not in Work.wait()
    expect(ValueError, ["C-contiguous"],
           lambda: ringlet.all_reduce(np.zeros((4, 4), np.float32)[:, 0], async_op=True))
    expect(ValueError, ["read-only"], lambda: ringlet.broadcast(ro, async_op=True))
    expect(ValueError, ["input", "C-contiguous"],
           lambda: ringlet.all_gather(np.zeros(8, np.float32), np.zeros((4, 2), np.float32)[:, 0]))
    expect(ValueError, ["read-only"], lambda: ringlet.irecv(ro, 1 - rank))
    # bytes export the buffer protocol (a valid send), but not a writable one.
    expect(ValueError, ["array", "read-only bytes"], lambda: ringlet.irecv(b"abc", 1 - rank))
    expect(TypeError, ["numpy.ndarray", "str"], lambda: ringlet.isend("abc", 1 - rank))
    expect(TypeError, ["dst", "int"], lambda: ringlet.send(f, float(1 - rank)))
    expect(ValueError, ["dst=2", "size 2"], lambda: ringlet.send(f, 2))
    expect(ValueError, ["tag"], lambda: ringlet.send(f, 1 - rank, tag=True))
    # Byte-swapped data (here after native arrays of the same types went
    # through) is refused, never reduced as garbage.
    for t in (">f4", ">f8", ">i4", ">i8", ">f2"):
        sw = np.arange(1, 5).astype(t)
        native = sw.dtype.newbyteorder("=").str
        expect(TypeError, [t, "non-native byte order", native], lambda: ringlet.all_reduce(sw))
        expect(TypeError, [t, "non-native"], lambda: ringlet.broadcast(sw))
        expect(TypeError, [t, "non-native"], lambda: ringlet.reduce(sw, ReduceOp.MAX))
        expect(TypeError, [t, "non-native"], lambda: ringlet.send(sw, 1 - rank))
        expect(TypeError, ["output", t, "non-native"],
               lambda: ringlet.all_gather(np.zeros(8, t), sw))
    expect(ValueError, ["not in the parent"], lambda: ringlet.new_group([0, 7]))
    expect(ValueError, ["timeout", "nan"], lambda: ringlet.new_group([0, 1], timeout=float("nan")))
    expect(ValueError, ["duplicate"], lambda: ringlet.new_group([0, 0]))
    # nothing was sent: the group still works, and a numpy integer is a valid rank
    x = np.ones(4, np.float32)
    ringlet.all_reduce(x)
    for t in ("f4", "f8", "i4", "i8", "f2"):  # native arrays of the same types still reduce
        z = np.full(4, rank + 1, t)
        ringlet.all_reduce(z)
        if not np.all(z == P * (P + 1) // 2):
            results.append(("NO ERROR", f"native {t} all_reduce gave {z}", ["sum"]))
    y = np.full(4, rank, np.float32)
    ringlet.broadcast(y, src=np.int64(1))
    return results, bool(np.all(x == P) and np.all(y == 1))


def test_bad_input_is_refused_with_clear_messages():
    res = run_world(_cases, 2, mode="thread", timeout=60)
    for results, ok in res:
        assert ok
        for kind, msg, missing in results:
            assert not kind.startswith(("WRONG", "NO ERROR")), (kind, msg, missing)
            assert not missing, f"{kind}: message {msg!r} lacks {missing}"


def test_c_dtype_mapping_agrees_with_python():
    # The binding maps numpy's built-in types itself (the collectives' fast
    # path); it must give dtype_code's answer for every spelling of a type.
    from ringlet import _core
    from ringlet._dtypes import dtype_code

    types = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64,
             np.bool_, np.intc, np.int_, np.longlong, np.single, np.double, np.half,
             np.int16, np.uint16, np.uint32, np.uint64, np.uintc, np.uint, np.ulonglong]
    for t in types:
        x = np.zeros(3, t)
        assert _core.array_code(x, "x", True, dtype_code) == dtype_code(x.dtype), t

    def refuse(dtype, what):
        raise TypeError(f"fallback: {what} {dtype}")
    for t in (np.complex64, np.float128 if hasattr(np, "float128") else np.clongdouble):
        with pytest.raises(TypeError, match="fallback: y"):
            _core.array_code(np.zeros(2, t), "y", False, refuse)
    with pytest.raises(TypeError, match="fallback"):  # byte-swapped never maps in C
        _core.array_code(np.zeros(2, ">f4"), "y", False, refuse)
    with pytest.raises(TypeError, match="fallback"):
        _core.array_code(np.zeros(2, ">u2"), "y", False, refuse)
    with pytest.raises(TypeError, match="unsupported dtype complex64"):
        _core.array_code(np.zeros(2, np.complex64), "y", False, dtype_code)
    for t in (np.bool_, np.int8, np.uint8):  # one-byte types have no byte order
        assert _core.array_code(np.zeros(2, np.dtype(t).newbyteorder(">")), "y", False,
                                refuse) == dtype_code(np.dtype(t))


def test_overlap_check_matches_numpy():
    # The collectives' overlap check compares address ranges of C-contiguous
    # arrays; for those it must agree with numpy's exact answer.
    from ringlet import _core

    buf = np.zeros(64, np.float32)
    other = np.zeros(8, np.float32)
    views = [buf[a:b] for a in range(0, 64, 7) for b in (a, a + 1, a + 9, 64)] + [other]
    views.append(buf.view(np.uint8)[5:17])  # unaligned bytes of the same buffer
    for x in views:
        for y in views:
            assert _core.overlap(x, y) == np.shares_memory(x, y), (x.__array_interface__["data"], x.nbytes,
                                                                   y.__array_interface__["data"], y.nbytes)


def test_not_initialized():
    with pytest.raises(RuntimeError, match="init"):
        ringlet.all_reduce(np.zeros(2, np.float32))


def test_world_of_one_without_configuration(monkeypatch):
    for var in ("RINGLET_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID",
                "WORLD_SIZE", "RINGLET_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    g = ringlet.init()
    try:
        assert (ringlet.get_rank(), ringlet.get_world_size()) == (0, 1)
        x = np.arange(5, dtype=np.float32)
        ringlet.all_reduce(x, ReduceOp.AVG)
        out = np.empty(5, np.float32)
        ringlet.all_gather(out, x)
        assert np.array_equal(x, np.arange(5)) and np.array_equal(out, x)
        assert g.broadcast_object({"a": 1}) == {"a": 1}
    finally:
        ringlet.shutdown()
    assert not ringlet.is_initialized()


def _huge_timeouts(rank, P):
    """Huge timeouts (inf too) mean "no practical deadline": ops complete, nothing is poisoned."""
    from ringlet._dtypes import dtype_code
    from ringlet._world import _require

    g = _require(None)
    x = np.ones(4, np.float32)
    for t in (1e10, 1e16, float("inf"), 2**70):
        ringlet.all_reduce(x, timeout=t)
        ringlet.barrier(timeout=t)
        ringlet.all_to_all_v(np.zeros(2, np.float32), [1, 1], np.ones(2, np.float32), [1, 1],
                             timeout=t)
        w = ringlet.broadcast(x, src=0, async_op=True, timeout=t)
        assert w.wait(timeout=t)
        peer = 1 - rank
        (ringlet.send if rank == 0 else ringlet.recv)(x, peer, timeout=t)
    # The C deadline itself is clamped: a timeout of 2**62 ms does not wrap around.
    g._coll.all_reduce(x, dtype_code(x.dtype), 0, 2**62)
    saved = g.timeout
    g.timeout = float("inf")  # the group default too
    ringlet.all_reduce(x)
    g.timeout = saved
    return x.tolist()


def test_huge_timeouts_mean_no_deadline():
    from ringlet._timeout import MAX_TIMEOUT, millis, seconds

    assert seconds(float("inf")) == MAX_TIMEOUT == ringlet.MAX_TIMEOUT
    assert seconds(1e300) == MAX_TIMEOUT and seconds(2.5) == 2.5
    assert millis(1e16) == int(MAX_TIMEOUT * 1000) and millis(1e-9) == 1
    assert seconds(0, zero=True) == 0.0
    for bad in (float("nan"), -1.0, 0):
        with pytest.raises(ValueError, match="timeout"):
            seconds(bad)
    with pytest.raises(ValueError, match="my_timeout"):
        seconds(float("-inf"), "my_timeout", zero=True)
    res = run_world(_huge_timeouts, 2, mode="thread", timeout=60)
    assert res == [[2.0 ** 6] * 4] * 2, res


def test_huge_timeouts_elsewhere():
    # Work.wait, the store client and RPC accept them too (capped, no OverflowError).
    from ringlet.store import Store, StoreServer
    from ringlet.work import Work

    done = Work("x")
    done._finish()
    assert done.wait(float("inf"))
    with pytest.raises(ValueError, match="timeout"):
        done.wait(float("nan"))
    srv = StoreServer("127.0.0.1", 0, secret=b"k" * 32)
    try:
        cli = Store("127.0.0.1", srv.port, secret=b"k" * 32, timeout=float("inf"))
        cli.set("a", b"1")
        assert cli.get("a", timeout=1e16) == b"1"
        cli.close()
    finally:
        srv.close()


def test_count_lists_take_integers_only():
    # int() used to take floats (1.9 -> 1), bools and numeric strings.
    from ringlet import _core

    check = _core.check_counts
    assert check("all_to_all_v", "input_counts", [1, np.int64(2), np.uint8(3)], 3, 6) == [1, 2, 3]
    assert check("all_to_all_v", "input_counts", np.array([2, 2]), 2, 4) == [2, 2]
    for bad, at in (([1, 2.0], 1), ([True, 1], 0), ([1, "2"], 1), ([np.float32(1), 1], 0),
                    ([1, np.bool_(True)], 1), ([1, None], 1)):
        with pytest.raises(TypeError) as ei:
            check("gather_v", "output_counts", bad, 2, 10)
        msg = str(ei.value)
        assert "gather_v" in msg and f"output_counts[{at}]" in msg and "integers" in msg, msg
    with pytest.raises(TypeError, match="output_counts must be a sequence of integers"):
        check("gather_v", "output_counts", 3, 2, 10)


def test_reduce_op_takes_a_reduce_op_or_its_integer_value_only():
    # ReduceOp(True) and ReduceOp(1.0) are PROD; an unhashable op failed in a dict lookup.
    from ringlet import _core
    from ringlet._dtypes import check_op

    f32 = _core.array_code(np.zeros(1, np.float32), "x", False, None)
    assert check_op(ReduceOp.MAX, f32, np.float32) == 3
    assert check_op(1, f32, np.float32) == check_op(np.int64(1), f32, np.float32) == 1
    for bad in (True, False, 1.0, np.float64(3), "SUM", [1], {}, np.bool_(True), None):
        for _ in range(2):  # the second time past the cache of validated pairs
            with pytest.raises(ValueError, match="unknown reduction op"):
                check_op(bad, f32, np.float32)


def _non_member_all_to_all_v(rank, P):
    g = ringlet.new_group([0, 1])
    if rank != 2:
        return None
    f = np.zeros(4, np.float32)
    try:  # counts that would look wrong when read at this rank's index, -1
        g.all_to_all_v(f, [1, 2], f.copy(), [1, 1])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_non_member_all_to_all_v_says_it_is_not_a_member():
    msg = run_world(_non_member_all_to_all_v, 3, mode="thread", timeout=60)[2]
    assert "not a member" in msg, msg
