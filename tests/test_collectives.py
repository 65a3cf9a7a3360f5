"""Correctness matrix of every collective against numpy.

World sizes 1, 2, 3, 4, 5, 8; counts 0, 1, P-1, P+1 and 3001 (not divisible by
P); every dtype and op; every root of rooted ops.  The tuning knobs are
lowered so that small counts take the latency algorithms (recursive doubling,
binomial trees) and 3001 elements take the pipelined ones with several
segments per chunk.  One world per size runs the whole matrix inside the
ranks, each rank checking its own result.
"""

from __future__ import annotations

import numpy as np
import pytest

import ringlet
from ringlet import ReduceOp, _core
from ringlet.testing import run_world

from _oracle import DTYPES, close, counts_for, data, ops_for, reduce_np, same

# bcast_flat_bytes: across hosts (tests/test_multihost.py) 4 ranks broadcast counts_for's
# 4 bytes by the flat shape and its 12 and 20 by the binomial tree.
SMALL_TUNING = dict(segment_bytes=4096, allreduce_small_bytes=256, bcast_small_bytes=256,
                    reduce_small_bytes=256, bcast_flat_bytes=8)


@pytest.fixture
def small_segments():
    saved = _core.get_tuning()
    _core.set_tuning(**SMALL_TUNING)
    yield
    _core.set_tuning(**saved)


def _matrix(rank, P, dtypes, counts, full_roots=True):
    bad = []

    def check(name, got, want, op=ReduceOp.SUM):
        if not close(got, want, op):
            bad.append(f"rank {rank}: {name}: got {got[:8]} want {want[:8]}")

    def moved(name, got, want):  # ops that only move bytes: bit for bit
        if not same(got, want):
            bad.append(f"rank {rank}: {name}: got {got[:8]} want {want[:8]}")

    def untouched(name, buf, want):  # an input the op must only read
        if not same(buf, want):
            bad.append(f"rank {rank}: {name} changed its input")

    for dt in dtypes:
        dt = np.dtype(dt)
        for n in counts:
            for op in ops_for(dt):
                ins = [data(r, n, dt, op) for r in range(P)]
                # all_reduce
                x = ins[rank].copy()
                ringlet.all_reduce(x, op)
                check(f"all_reduce {dt} {op.name} n={n}", x, reduce_np(ins, op, dt), op)
                # reduce to every root
                for root in (range(P) if full_roots else [P - 1]):
                    x = ins[rank].copy()
                    ringlet.reduce(x, dst=root, op=op)
                    if rank == root:
                        check(f"reduce {dt} {op.name} n={n} root={root}", x,
                              reduce_np(ins, op, dt), op)
                    else:  # a non-root's buffer is only read
                        untouched(f"reduce {dt} {op.name} n={n} root={root}", x, ins[rank])
                # reduce_scatter: input P*n, output n
                big = [data(r, n * P, dt, op, salt=7) for r in range(P)]
                out = np.empty(n, dt)
                ringlet.reduce_scatter(out, big[rank], op)
                check(f"reduce_scatter {dt} {op.name} n={n}", out,
                      reduce_np(big, op, dt)[rank * n:(rank + 1) * n], op)
                untouched(f"reduce_scatter {dt} {op.name} n={n}", big[rank],
                          data(rank, n * P, dt, op, salt=7))
            ins = [data(r, n, dt) for r in range(P)]
            # broadcast from every root
            for root in range(P):
                x = ins[rank].copy()
                ringlet.broadcast(x, src=root)
                moved(f"broadcast {dt} n={n} root={root}", x, ins[root])
            # all_gather
            out = np.empty(n * P, dt)
            ringlet.all_gather(out, ins[rank])
            moved(f"all_gather {dt} n={n}", out, np.concatenate(ins))
            untouched(f"all_gather {dt} n={n}", ins[rank], data(rank, n, dt))
            # gather / scatter, every root
            for root in range(P):
                out = np.empty(n * P, dt) if rank == root else None
                ringlet.gather(out, ins[rank], dst=root)
                if rank == root:
                    moved(f"gather {dt} n={n} root={root}", out, np.concatenate(ins))
                src = [data(r, n * P, dt, salt=3) for r in range(P)]
                out = np.empty(n, dt)
                ringlet.scatter(out, src[rank] if rank == root else None, src=root)
                moved(f"scatter {dt} n={n} root={root}", out, src[root][rank * n:(rank + 1) * n])
            # all_to_all, equal blocks
            blocks = [data(r, n * P, dt, salt=11) for r in range(P)]
            out = np.empty(n * P, dt)
            ringlet.all_to_all(out, blocks[rank])
            want = np.concatenate([blocks[s][rank * n:(rank + 1) * n] for s in range(P)])
            moved(f"all_to_all {dt} n={n}", out, want)
    # all_to_all_v with uneven counts: rank s sends (s + d + n) % 4 elements to d
    for n in counts:
        cnt = [[(s + d + n) % 4 for d in range(P)] for s in range(P)]
        srcs = [data(s, sum(cnt[s]), np.int32, salt=13) for s in range(P)]
        out_counts = [cnt[s][rank] for s in range(P)]
        out = np.empty(sum(out_counts), np.int32)
        ringlet.all_to_all_v(out, out_counts, srcs[rank], cnt[rank])
        pieces = []
        for s in range(P):
            off = sum(cnt[s][:rank])
            pieces.append(srcs[s][off:off + cnt[s][rank]])
        moved(f"all_to_all_v n={n}", out, np.concatenate(pieces))
    # all_gather_v: rank s contributes (3s + n) % 5 elements (some none), from its own
    # array and in place from its block of the output
    for n in counts:
        cnt = [(3 * s + n) % 5 for s in range(P)]
        srcs = [data(s, cnt[s], np.float64, salt=19) for s in range(P)]
        want = np.concatenate(srcs)
        out = np.full(sum(cnt) + 3, -7.0)
        ringlet.all_gather_v(out, cnt, srcs[rank])
        moved(f"all_gather_v n={n}", out[:sum(cnt)], want)
        moved(f"all_gather_v n={n} tail", out[sum(cnt):], np.full(3, -7.0))
        buf = np.zeros(sum(cnt))
        off = sum(cnt[:rank])
        buf[off:off + cnt[rank]] = srcs[rank]
        ringlet.all_gather_v(buf, cnt, buf[off:off + cnt[rank]])
        moved(f"all_gather_v in place n={n}", buf, want)
    # counts as a numpy array, a tuple and a generator
    cnt = [(3 * s + 1) % 5 for s in range(P)]
    srcs = [data(s, cnt[s], np.float64, salt=29) for s in range(P)]
    for kind, c in [("numpy", np.array(cnt)), ("tuple", tuple(cnt)), ("generator", iter(cnt))]:
        out = np.zeros(sum(cnt))
        ringlet.all_gather_v(out, c, srcs[rank])
        moved(f"all_gather_v counts as a {kind}", out, np.concatenate(srcs))
    # gather_v / scatter_v: rank s's block is (2s + n) % 5 elements (some none), every
    # root, from separate arrays and in place from the root's own block
    for n in counts:
        cnt = [(2 * s + n) % 5 for s in range(P)]
        srcs = [data(s, cnt[s], np.int16, salt=23) for s in range(P)]
        whole = np.concatenate(srcs)
        for root in range(P):
            out = np.full(sum(cnt) + 2, -3, np.int16) if rank == root else None
            ringlet.gather_v(out, cnt if rank == root else None, srcs[rank], dst=root)
            if rank == root:
                moved(f"gather_v n={n} root={root}", out[:sum(cnt)], whole)
                moved(f"gather_v n={n} root={root} tail", out[sum(cnt):], np.full(2, -3, np.int16))
            mine = np.full(cnt[rank], -1, np.int16)
            ringlet.scatter_v(mine, whole if rank == root else None,
                              cnt if rank == root else None, src=root)
            moved(f"scatter_v n={n} root={root}", mine, srcs[rank])
        root, off = P - 1, sum(cnt[:P - 1])
        if rank == root:  # in place on the root
            buf = np.zeros(sum(cnt), np.int16)
            buf[off:] = srcs[rank]
            ringlet.gather_v(buf, cnt, buf[off:], dst=root)
            moved(f"gather_v in place n={n}", buf, whole)
            buf = whole.copy()
            ringlet.scatter_v(buf[off:], buf, cnt, src=root)
            moved(f"scatter_v in place n={n}", buf, whole)
        else:
            ringlet.gather_v(None, None, srcs[rank], dst=root)
            mine = np.empty(cnt[rank], np.int16)
            ringlet.scatter_v(mine, None, None, src=root)
            moved(f"scatter_v (root in place) n={n}", mine, srcs[rank])
    # send/recv around the ring, two tags sent in the opposite order they are received
    if P > 1:
        nxt, prv = (rank + 1) % P, (rank - 1) % P
        a = data(rank, 1000, np.float32)
        b = data(rank, 10, np.int64, salt=5)
        w1 = ringlet.isend(a, nxt, tag=1)
        w2 = ringlet.isend(b, nxt, tag=2)
        rb = np.empty(10, np.int64)
        ra = np.empty(1000, np.float32)
        ringlet.recv(rb, prv, tag=2)
        ringlet.recv(ra, prv, tag=1)
        w1.wait()
        w2.wait()
        moved("recv tag 1", ra, data(prv, 1000, np.float32))
        moved("recv tag 2", rb, data(prv, 10, np.int64, salt=5))
    ringlet.barrier()
    return bad


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6, 7, 8])
def test_matrix_threads(P, small_segments):
    dtypes = DTYPES if P <= 4 else [np.float32, np.float16, np.int8, np.bool_]
    results = run_world(_matrix, P, mode="thread", timeout=240,
                        args=(dtypes, counts_for(P)), kwargs={"full_roots": P <= 4})
    bad = [b for r in results for b in r]
    assert not bad, "\n".join(bad[:20])


def test_matrix_sixteen_ranks(small_segments):
    # 16 threads on a few cores: one float and one integer dtype, the edge
    # counts and one that is not divisible, to keep the run short.
    results = run_world(_matrix, 16, mode="thread", timeout=300, init_timeout=120,
                        args=([np.float32, np.int32], [0, 1, 17, 3001]),
                        kwargs={"full_roots": False})
    bad = [b for r in results for b in r]
    assert not bad, "\n".join(bad[:20])


def test_matrix_processes(small_segments):
    # Process mode uses its own defaults in each child; give them the same knobs.
    results = run_world(_process_matrix, 3, mode="process", timeout=240)
    bad = [b for r in results for b in r]
    assert not bad, "\n".join(bad[:20])


def _process_matrix(rank, P):
    _core.set_tuning(**SMALL_TUNING)
    return _matrix(rank, P, [np.float32, np.int32, np.bool_], counts_for(P))


def _big(rank, P):
    """Default tuning, sizes that take the pipelined algorithms with real segments."""
    n = (3 << 20) // 4 + 7  # ~3 MiB of float32: several 512 KiB segments per chunk
    ins = [data(r, n, np.float32) for r in range(P)]
    x = ins[rank].copy()
    ringlet.all_reduce(x)
    ok = np.array_equal(x, reduce_np(ins, ReduceOp.SUM, np.float32))
    y = ins[rank].copy()
    ringlet.broadcast(y, src=1)
    ok &= np.array_equal(y, ins[1])
    z = ins[rank].copy()
    ringlet.reduce(z, dst=2, op=ReduceOp.MAX)
    ok &= np.array_equal(z, reduce_np(ins, ReduceOp.MAX, np.float32) if rank == 2 else ins[rank])
    return bool(ok)


def test_large_default_tuning():
    assert all(run_world(_big, 3, mode="thread", timeout=120))


def _all_gather_ok(ins, rank, lo, n):
    """all_gather of every rank's ins[r][lo:lo+n], checked against numpy."""
    out = np.empty(n * len(ins), np.float32)
    ringlet.all_gather(out, ins[rank][lo:lo + n])
    return np.array_equal(out, np.concatenate([x[lo:lo + n] for x in ins]))


def _all_to_all_ok(ins, rank, n):
    """all_to_all of blocks of n elements, checked against numpy."""
    out = np.empty(n * len(ins), np.float32)
    ringlet.all_to_all(out, ins[rank])
    return np.array_equal(out, np.concatenate([x[rank * n:(rank + 1) * n] for x in ins]))


def _streamed_own_blocks(rank, P):
    """Own blocks of >= 4 MiB are copied with non-temporal stores; an odd
    length and offset exercise the copy's unaligned head and byte tail."""
    n = (4 << 20) // 4 + 5
    ins = [data(r, n * P, np.float32, ReduceOp.SUM, salt=5) for r in range(P)]
    bad = [] if _all_gather_ok(ins, rank, 1, n) else ["all_gather"]
    part = np.empty(n, np.float32)
    ringlet.scatter(part, ins[1] if rank == 1 else None, src=1)
    if not np.array_equal(part, ins[1][rank * n:(rank + 1) * n]):
        bad.append("scatter")
    if not _all_to_all_ok(ins, rank, n):
        bad.append("all_to_all")
    return bad


def test_large_own_blocks_streamed():
    assert run_world(_streamed_own_blocks, 2, mode="thread", timeout=120) == [[], []]


def _streamed_reduce_scatter(rank, P):
    """Output blocks of >= 16 MiB are summed in the cached slot and streamed
    out; an odd length and an output one element into its buffer exercise the
    copy's unaligned head and byte tail, AVG the scaling before the copy."""
    n = (16 << 20) // 4 + 5
    # Each input repeats a short pattern, so a rank builds only its own input
    # and every rank's block r for the oracle (inputs: P x P x 16 MiB in all).
    pats = [data(r, 4099, np.float32, salt=6) for r in range(P)]
    idx = np.arange(rank * n, (rank + 1) * n) % 4099
    want_in = [p[idx] for p in pats]
    bad = []
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        buf = np.full(n + 2, -1.0, np.float32)
        ringlet.reduce_scatter(buf[1:1 + n], np.resize(pats[rank], n * P), op)
        want = reduce_np(want_in, op, np.float32)
        if not (close(buf[1:1 + n], want, op) and buf[0] == -1.0 and buf[-1] == -1.0):
            bad.append(op.name)
    return bad


@pytest.mark.parametrize("P", [2, 3])
def test_large_reduce_scatter_streamed(P):
    assert run_world(_streamed_reduce_scatter, P, mode="thread", timeout=120) == [[]] * P


def _streamed_all_gather(rank, P):
    """2 ranks, blocks of >= 16 MiB: each received segment lands in a slot and
    is streamed into the output, unaligned (one element into its buffer),
    out of place and in place (the input is the rank's own slot)."""
    n = (16 << 20) // 4 + 5
    ins = [np.resize(data(r, 4099, np.float32, salt=7), n) for r in range(P)]
    want = np.concatenate(ins)
    bad = []
    buf = np.full(n * P + 2, -1.0, np.float32)
    ringlet.all_gather(buf[1:1 + n * P], ins[rank])
    if not (np.array_equal(buf[1:1 + n * P], want) and buf[0] == -1.0 and buf[-1] == -1.0):
        bad.append("out of place")
    out = np.full(n * P, -1.0, np.float32)
    out[rank * n:(rank + 1) * n] = ins[rank]
    ringlet.all_gather(out, out[rank * n:(rank + 1) * n])
    if not np.array_equal(out, want):
        bad.append("in place")
    return bad


def test_large_all_gather_streamed():
    assert run_world(_streamed_all_gather, 2, mode="thread", timeout=120) == [[], []]


def _identical(rank, P):
    rng = np.random.default_rng(rank)
    x = rng.standard_normal(50_001).astype(np.float32)  # inexact sums: order matters
    ringlet.all_reduce(x)
    y = rng.standard_normal(5).astype(np.float32)
    ringlet.all_reduce(y, ReduceOp.AVG)
    return x.tobytes() + y.tobytes()


@pytest.mark.parametrize("P", [3, 4])
def test_results_bit_identical_on_every_rank(P):
    results = run_world(_identical, P, mode="thread")
    assert all(r == results[0] for r in results)


def _objects(rank, P):
    obj = {"rank": rank, "name": f"r{rank}", "arr": np.arange(rank + 1), "t": (1, 2.5, None)}
    got = ringlet.broadcast_object(obj if rank == 1 else None, src=1)
    every = ringlet.all_gather_object(obj)
    return got["rank"] == 1 and [e["rank"] for e in every] == list(range(P)) and \
        all(np.array_equal(e["arr"], np.arange(i + 1)) for i, e in enumerate(every))


def test_object_collectives():
    assert all(run_world(_objects, 4, mode="thread"))


def _unencodable(rank, P):
    out = []
    for op in ("broadcast_object", "all_gather_object"):
        try:
            if op == "broadcast_object":
                ringlet.broadcast_object(object() if rank == 1 else None, src=1, timeout=20)
            else:
                ringlet.all_gather_object(object() if rank == 2 else rank, timeout=20)
            out.append(("no error", ""))
        except Exception as exc:  # noqa: BLE001 - compared below
            out.append((type(exc).__name__, str(exc)))
    x = np.ones(3, np.float32)
    ringlet.all_reduce(x, timeout=20)  # nothing was left half-done: the group still works
    return out + [float(x[0])]


def test_an_object_one_rank_cannot_encode_fails_on_every_rank():
    # The failing rank used to raise alone, before sending anything; the others
    # waited for its length until their deadline.
    for bc, ag, total in run_world(_unencodable, 3, mode="thread", timeout=90):
        assert bc[0] == "TypeError" and "broadcast_object: rank 1 " in bc[1], bc
        assert "cannot send object of type builtins.object" in bc[1], bc
        assert ag[0] == "TypeError" and "all_gather_object: rank 2 " in ag[1], ag
        assert total == 3.0


# ---- blocks far larger than the socket buffers --------------------------------
# A pipelined ring must keep every rank's sends moving even when a whole block
# cannot sit in the kernel's buffers: the reduce-scatter once deadlocked here
# (4 ranks, blocks of many segments) while small-block tests passed.
@pytest.fixture
def tiny_buffers():
    saved = _core.get_tuning()
    _core.set_tuning(segment_bytes=4096, sockbuf_bytes=16384, allreduce_small_bytes=256,
                     bcast_small_bytes=256, reduce_small_bytes=256)
    yield
    _core.set_tuning(**saved)


def _big_blocks(rank, P, n):
    ins = [data(r, n * P, np.float32, ReduceOp.SUM, salt=3) for r in range(P)]
    out = np.empty(n, np.float32)
    ringlet.reduce_scatter(out, ins[rank])
    want = reduce_np(ins, ReduceOp.SUM, np.dtype(np.float32))[rank * n:(rank + 1) * n]
    bad = [] if close(out, want, ReduceOp.SUM) else ["reduce_scatter"]
    if not _all_gather_ok(ins, rank, 0, n):
        bad.append("all_gather")
    x = ins[rank].copy()
    ringlet.all_reduce(x)
    if not close(x, reduce_np(ins, ReduceOp.SUM, np.dtype(np.float32)), ReduceOp.SUM):
        bad.append("all_reduce")
    if not _all_to_all_ok(ins, rank, n):
        bad.append("all_to_all")
    return bad


@pytest.mark.parametrize("P", [3, 4, 5])
def test_blocks_larger_than_socket_buffers(tiny_buffers, P):
    n = 64 * 1024  # 256 KiB per block: 64 segments, ~8x what the buffers hold
    results = run_world(_big_blocks, P, timeout=120, init_timeout=60, args=(n,))
    assert results == [[]] * P, results


# A pair that shares one connection (every step at 2 ranks, step P/2 for even
# P) exchanges its blocks as segments kept in step.  The two directions may
# differ in length, down to nothing: the longer one must go on once the
# shorter has arrived.
def _pairs_in_step(rank, P, seg_elems):
    bad = []
    for lens in ((3 * seg_elems + 5, seg_elems + 1), (5 * seg_elems, 0), (1, 4 * seg_elems - 3)):
        # rank s sends lens[0] elements to the rank opposite it when s < P/2,
        # lens[1] when s >= P/2, and 7 + s + d elements to every other rank d
        def cnt(s, d):
            if d == (s + P // 2) % P and P % 2 == 0:
                return lens[0] if s < P // 2 else lens[1]
            return 0 if s == d else 7 + s + d
        counts = [[cnt(s, d) for d in range(P)] for s in range(P)]
        srcs = [data(s, sum(counts[s]), np.float32, salt=17) for s in range(P)]
        out_counts = [counts[s][rank] for s in range(P)]
        out = np.empty(sum(out_counts), np.float32)
        ringlet.all_to_all_v(out, out_counts, srcs[rank], counts[rank])
        want = np.concatenate([srcs[s][sum(counts[s][:rank]):sum(counts[s][:rank + 1])]
                               for s in range(P)])
        if not np.array_equal(out, want):
            bad.append(f"rank {rank}: lens {lens}")
    return bad


@pytest.mark.parametrize("P", [2, 4])
def test_all_to_all_pairs_in_step(tiny_buffers, P):
    results = run_world(_pairs_in_step, P, mode="thread", timeout=120, args=(4096 // 4,))
    assert results == [[]] * P, results


# The ring all-reduce orders its segments segment-major at 2 ranks and
# step-major from 3; chunks whose sizes straddle a segment boundary (one more
# segment than the others) exercise the ragged last row of either order.
def _ragged(rank, P, counts):
    bad = []
    for n in counts:
        for op in (ReduceOp.SUM, ReduceOp.AVG):
            ins = [data(r, n, np.float32, op, salt=9) for r in range(P)]
            x = ins[rank].copy()
            ringlet.all_reduce(x, op)
            if not close(x, reduce_np(ins, op, np.dtype(np.float32)), op):
                bad.append(f"n={n} {op.name}: got {x[:4]} want ...")
    return bad


@pytest.mark.parametrize("P", [2, 3])
def test_all_reduce_segments_straddling_chunks(tiny_buffers, P):
    seg = 4096 // 4  # float32 elements per segment under tiny_buffers
    counts = [P * seg + 1, P * 3 * seg + P - 1, P * 16 * seg + 1]
    results = run_world(_ragged, P, mode="thread", timeout=120, args=(counts,))
    assert results == [[]] * P, results


# Recursive halving (power-of-two P, up to 16 x allreduce_small_bytes in all)
# exchanges half the input at its first step, one connection both ways: with
# buffers of 16 KiB a half of 64 KiB per rank must still flow without deadlock.
def _halving(rank, P, n):
    bad = []
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
        ins = [data(r, n * P, np.float32, op, salt=5) for r in range(P)]
        out = np.empty(n, np.float32)
        ringlet.reduce_scatter(out, ins[rank], op)
        want = reduce_np(ins, op, np.dtype(np.float32))[rank * n:(rank + 1) * n]
        if not close(out, want, op):
            bad.append(f"{op.name}: got {out[:4]} want {want[:4]}")
    return bad


@pytest.mark.parametrize("P", [4, 8])
def test_reduce_scatter_by_recursive_halving(P):
    saved = _core.get_tuning()
    assert P * 8192 * 4 <= 16 * saved["allreduce_small_bytes"]  # the halving path
    _core.set_tuning(sockbuf_bytes=16384)
    try:
        results = run_world(_halving, P, timeout=120, init_timeout=60, args=(8192,))
    finally:
        _core.set_tuning(**saved)
    assert results == [[]] * P, results


# ---- inputs that alias the output ---------------------------------------------
# The own block is copied while the sockets wait; an input that overlaps the
# output must still be read before any receive can overwrite it.
def _aliased(rank, P, n):
    bad = []
    blocks = [np.arange(n, dtype=np.float64) + 1000 * r for r in range(P)]
    want = np.concatenate(blocks)
    out = np.zeros(n * P)
    out[rank * n:(rank + 1) * n] = blocks[rank]
    ringlet.all_gather(out, out[rank * n:(rank + 1) * n])  # in place: own slot
    if not np.array_equal(out, want):
        bad.append("all_gather in own slot")
    out = np.zeros(n * P)
    slot = (rank + 1) % P  # the input sits where a peer's block will land
    out[slot * n:(slot + 1) * n] = blocks[rank]
    ringlet.all_gather(out, out[slot * n:(slot + 1) * n])
    if not np.array_equal(out, want):
        bad.append("all_gather from a peer's slot")
    root_out = np.zeros(n * P) if rank == 0 else None
    if rank == 0:
        root_out[:n] = blocks[0]
    ringlet.gather(root_out, root_out[:n] if rank == 0 else blocks[rank], dst=0)
    if rank == 0 and not np.array_equal(root_out, want):
        bad.append("gather in own slot")
    piece = np.zeros(n)
    ringlet.scatter(piece, want.copy() if rank == 0 else None, src=0)
    if not np.array_equal(piece, blocks[rank]):
        bad.append("scatter")
    # gather at the root from a peer's slot, and from an unaligned view
    # straddling two slots: the input is consumed before any block lands.
    for start in (n, n // 2 + 1):
        root_out = np.zeros(n * P + n) if rank == 0 else None
        if rank == 0:
            root_out[start:start + n] = blocks[0]
        ringlet.gather(root_out[:n * P] if rank == 0 else None,
                       root_out[start:start + n] if rank == 0 else blocks[rank], dst=0)
        if rank == 0 and not np.array_equal(root_out[:n * P], want):
            bad.append(f"gather from offset {start}")
    # scatter in place at the root: its output is its own block of the input.
    src = P - 1
    full = want.copy() if rank == src else None
    piece = full[src * n:(src + 1) * n] if rank == src else np.zeros(n)
    ringlet.scatter(piece, full, src=src)
    if not np.array_equal(piece, blocks[rank]) or (rank == src and not np.array_equal(full, want)):
        bad.append("scatter in place")
    return bad


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("n", [100, 50_000])  # small: Bruck at 3 ranks, the ring's one exchange at 2
def test_aliased_inputs(tiny_buffers, P, n):
    results = run_world(_aliased, P, timeout=120, init_timeout=60, args=(n,))
    assert results == [[]] * P, results


# ---- barrier: nobody leaves before everyone has arrived -----------------------
def _barrier_rounds(rank, P, arrived, rounds):
    early = 0
    late = (rank + 1) % P  # a different rank arrives last in each round ...
    for k in range(rounds):
        if rank == (late + k) % P:
            # ... after some real work, so the others are already waiting
            np.sort(np.random.default_rng(k).random(200_000))
        arrived[k][rank] = True
        ringlet.barrier()
        early += not all(arrived[k])
    return early


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_barrier_releases_no_rank_before_all_arrive(P):
    # 2 and 5 ranks run the dissemination barrier, 3 and 4 the flat one.
    rounds = 12
    arrived = [[False] * P for _ in range(rounds)]
    assert run_world(_barrier_rounds, P, mode="thread", timeout=120,
                     args=(arrived, rounds)) == [0] * P
