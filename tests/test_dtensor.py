"""DTensor: every redistribution against a numpy oracle, with uneven shards.

Oracle: the expected piece of a rank is computed here with
``numpy.array_split`` applied mesh dimension by mesh dimension (the
documented nesting), independently of ``ringlet.dtensor``.  After each
redistribution every rank's local array is collected with
``all_gather_object`` (not through DTensor) and checked:

* a rank's local array equals its expected piece when no mesh dimension is
  Partial;
* with Partial dimensions, the SUM (or MAX) over the ranks that differ only
  in Partial coordinates equals the piece;
* ranks that differ only in Replicate coordinates hold identical arrays.

Values are small integers in float64, so sums are exact and comparisons
are exact equality.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import ringlet
from ringlet import ReduceOp
from ringlet.dtensor import (DTensor, Partial, Replicate, Shard, distribute, shard_sizes)
from ringlet.mesh import DeviceMesh
from ringlet.testing import run_world

GLOBAL = np.arange(35, dtype=np.float64).reshape(7, 5) - 11.0  # dims 7 and 5: uneven


def expected_piece(g: np.ndarray, mesh_shape, placements, coord) -> np.ndarray:
    piece = g
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            piece = np.array_split(piece, mesh_shape[i], axis=p.dim)[coord[i]]
    return piece


def check_layout(dt: DTensor, g: np.ndarray) -> None:
    """Collective: verify every rank's piece of ``dt`` against ``g`` (see module doc)."""
    mesh = dt.mesh
    coord = mesh.coordinate
    allv = ringlet.all_gather_object([list(coord), dt.to_local()])
    locals_by = {tuple(c): np.asarray(a) for c, a in allv}
    ps = dt.placements
    partial = [i for i, p in enumerate(ps) if isinstance(p, Partial)]
    replicate = [i for i, p in enumerate(ps) if isinstance(p, Replicate)]
    want = expected_piece(g, mesh.shape, ps, coord)
    mine = dt.to_local()
    assert mine.shape == want.shape == dt.local_shape
    assert dt.shape == g.shape and mine.dtype == g.dtype
    if not partial:
        np.testing.assert_array_equal(mine, want)
    else:
        ops = {ps[i].op for i in partial}
        # Reduce over all coordinates of the Partial dims, others fixed at mine.
        ranges = [range(mesh.shape[i]) if i in partial else [coord[i]]
                  for i in range(mesh.ndim)]
        parts = [locals_by[c] for c in itertools.product(*ranges)]
        if ops == {ReduceOp.SUM}:
            total = np.sum(parts, axis=0)
        elif ops == {ReduceOp.MAX}:
            total = np.max(parts, axis=0)
        elif ops == {ReduceOp.MIN}:
            total = np.min(parts, axis=0)
        elif ops == {ReduceOp.AVG}:
            total = np.mean(parts, axis=0)
        else:
            raise AssertionError(f"oracle does not mix ops {ops}")
        np.testing.assert_array_equal(total, want)
    for i in replicate:
        for c in range(mesh.shape[i]):
            other = list(coord)
            other[i] = c
            np.testing.assert_array_equal(locals_by[tuple(other)], mine)


PLACEMENTS = [Shard(0), Shard(1), Replicate(), Partial()]


def _all_pairs(rank, n, shape, ranks=None):
    mesh = DeviceMesh(shape, tuple("abc"[:len(shape)]), ranks=ranks)
    combos = list(itertools.product(PLACEMENTS, repeat=len(shape)))
    count = 0
    for src in combos:
        x = distribute(GLOBAL, mesh, src)
        check_layout(x, GLOBAL)
        for dst in combos:
            y = x.redistribute(dst)
            assert y.placements == tuple(dst)
            check_layout(y, GLOBAL)
            count += 1
        np.testing.assert_array_equal(x.to_local(), distribute(GLOBAL, mesh, src).to_local(),
                                      err_msg="redistribute modified its input")
    return count


@pytest.mark.parametrize("n", [2, 3])
def test_redistribute_every_pair_1d_uneven(n):
    # 7 and 5 over 2 and 3 ranks: pieces (4,3), (3,2,2), (3,2), (2,2,1).
    assert run_world(_all_pairs, n, args=((n,),)) == [16] * n


def test_redistribute_every_pair_2x3_nested_uneven():
    # 16 placements per 2-D mesh, 256 pairs, including nested shards of one
    # tensor dim (Shard(0) twice: 7 -> (4, 3) -> (2, 1, 1) / (1, 1, 1)).
    assert run_world(_all_pairs, 6, args=((2, 3),), timeout=120) == [256] * 6


def test_redistribute_every_pair_with_out_of_order_lines():
    # Group ranks differ from line coordinates: shards must follow the coordinates.
    assert run_world(_all_pairs, 3, args=((3,), [2, 0, 1])) == [16] * 3
    assert run_world(_all_pairs, 6, args=((2, 3), [[4, 0, 2], [5, 3, 1]]),
                     timeout=120) == [256] * 6


def _empty_pieces(rank, n):
    # 2 rows over 3 ranks: one rank holds an empty piece.
    mesh = DeviceMesh((3,), ("x",))
    g = np.arange(8.0).reshape(2, 4)
    for src in PLACEMENTS:
        x = distribute(g, mesh, [src])
        for dst in PLACEMENTS:
            check_layout(x.redistribute([dst]), g)
    return True


def test_redistribute_with_empty_pieces():
    assert all(run_world(_empty_pieces, 3))


def _reported_hang(rank, n):
    # Issue 29: Shard(0) <-> Shard(1) of a (3, 2) array on 4 ranks.  Rank 3
    # holds an empty piece before and after; it skipped the all_to_all_v the
    # others were in, and they waited until CollectiveTimeout.
    mesh = DeviceMesh((4,), ("x",))
    g = np.arange(6.0).reshape(3, 2)
    for a, b in ((0, 1), (1, 0)):
        y = distribute(g, mesh, [Shard(a)]).redistribute([Shard(b)], timeout=30)
        check_layout(y, g)
    return True


def test_redistribute_shard_to_shard_with_empty_pieces_before_and_after():
    assert all(run_world(_reported_hang, 4, timeout=60))


SMALL_SHAPES = [(3, 2), (2, 3), (1, 1), (1, 5), (5, 1), (0, 3), (3, 0), (2, 2)]


def _small_sweep(rank, n, mesh_shape):
    # Every shape smaller than the world along some dim, every placement pair:
    # pieces are empty on some ranks before, after, or both.
    mesh = DeviceMesh(mesh_shape, tuple("ab"[:len(mesh_shape)]))
    ps = [Shard(0), Shard(1), Replicate()]
    count = 0
    for shape in SMALL_SHAPES:
        g = np.arange(float(np.prod(shape))).reshape(shape) + 1
        for src in itertools.product(ps, repeat=len(mesh_shape)):
            x = distribute(g, mesh, src)
            for dst in itertools.product(ps, repeat=len(mesh_shape)):
                check_layout(x.redistribute(dst, timeout=30), g)
                count += 1
    return count


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_redistribute_small_shapes_on_four_ranks(mesh_shape):
    k = 3 ** len(mesh_shape)
    assert run_world(_small_sweep, 4, args=(mesh_shape,), timeout=120) == \
        [len(SMALL_SHAPES) * k * k] * 4


def _other_ops(rank, n):
    mesh = DeviceMesh((2, 2), ("a", "b"))
    g = GLOBAL
    for op in (ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG):
        for other in (Shard(0), Shard(1), Replicate()):
            for partial_dim in (0, 1):
                src = [other, other]
                src[partial_dim] = Partial(op)
                x = distribute(g, mesh, src)
                check_layout(x, g)
                for dst in itertools.product([Shard(0), Shard(1), Replicate(), Partial(op)],
                                             repeat=2):
                    check_layout(x.redistribute(dst), g)
    # Partial(SUM) -> Partial(MAX): all_reduce(SUM) then keep.
    x = distribute(g, mesh, [Partial(ReduceOp.SUM), Replicate()])
    check_layout(x.redistribute([Partial(ReduceOp.MAX), Replicate()]), g)
    return True


def test_partial_max_min_avg():
    assert all(run_world(_other_ops, 4, timeout=120))


def _integer_dtypes(rank, n):
    # Integer identities (iinfo.min / iinfo.max) for Shard -> Partial(MAX/MIN).
    mesh = DeviceMesh((n,), ("x",))
    for dt in (np.int32, np.int64, np.float32):
        g = (GLOBAL * 3).astype(dt)
        for y in _every_redistribution(g, mesh):
            assert y.dtype == g.dtype
            check_layout(y, g)
    return True


def _every_redistribution(g, mesh):
    # g distributed from, and redistributed to, each of Shard(0), Shard(1), Replicate and
    # Partial(op) for SUM, MAX and MIN (whose fills are the dtype's identities).
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN):
        ps = [Shard(0), Shard(1), Replicate(), Partial(op)]
        for src in ps:
            x = distribute(g, mesh, [src])
            for dst in ps:
                yield x.redistribute([dst])


def test_integer_and_float32_dtypes():
    assert all(run_world(_integer_dtypes, 3))


def _half_floats(rank, n, dtype_name):
    if dtype_name == "bfloat16":
        import ml_dtypes

        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(dtype_name)
    # Shard -> Partial(MAX/MIN) fills with -inf/inf.  Before, bfloat16 (ml_dtypes,
    # dtype kind "V") had no identity: TypeError on every rank.
    mesh = DeviceMesh((n,), ("x",))
    g = (GLOBAL * 3).astype(dt)   # small integers: exact in both
    for y in _every_redistribution(g, mesh):
        assert y.dtype == dt
        # Checked in float64 (exact here): the object codec carries no bfloat16.
        check_layout(DTensor(y.to_local().astype(np.float64), mesh, y.placements,
                             y.shape), g.astype(np.float64))
        np.testing.assert_array_equal(y.full_tensor().astype(np.float64),
                                      g.astype(np.float64))
    return True


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_float16_and_bfloat16(dtype_name):
    if dtype_name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    assert all(run_world(_half_floats, 3, args=(dtype_name,), timeout=60))


def _real_partial(rank, n):
    # A row-parallel matmul: each rank's partial product; Partial -> Shard is a
    # reduce_scatter, Partial -> Replicate an all_reduce.
    mesh = DeviceMesh((n,), ("tp",))
    rng = np.random.default_rng(0)
    a = rng.integers(-3, 4, (5, 9)).astype(np.float64)
    b = rng.integers(-3, 4, (9, 4)).astype(np.float64)
    k = np.array_split(np.arange(9), n)[rank]
    part = DTensor.from_local(a[:, k] @ b[k, :], mesh, [Partial()])
    assert part.shape == (5, 4)
    np.testing.assert_array_equal(part.full_tensor(), a @ b)
    rows = part.redistribute([Shard(0)])
    np.testing.assert_array_equal(rows.to_local(), np.array_split(a @ b, n, axis=0)[rank])
    return True


def test_partial_from_matmul():
    assert all(run_world(_real_partial, 3))


def _from_local_infers_shape(rank, n):
    mesh = DeviceMesh((2, 3), ("a", "b"))
    ps = [Shard(0), Shard(0)]   # nested: 7 -> (4, 3) -> thirds
    piece = expected_piece(GLOBAL, mesh.shape, ps, mesh.coordinate)
    x = DTensor.from_local(piece.copy(), mesh, ps)
    assert x.shape == GLOBAL.shape
    np.testing.assert_array_equal(x.full_tensor(), GLOBAL)
    rows = expected_piece(np.arange(7)[:, None] * np.ones((1, 5), int), mesh.shape, ps,
                          mesh.coordinate)
    assert x.local_offsets() == (int(rows[0, 0]), 0)
    # A wrong explicit shape is caught locally (13 -> (7, 6) -> (3, 2, 2) / (2, 2, 2)).
    with pytest.raises(ValueError, match="local array has shape"):
        DTensor.from_local(piece.copy(), mesh, ps, shape=(13, 5))
    return True


def test_from_local_infers_global_shape():
    assert all(run_world(_from_local_infers_shape, 6))


def _bad_from_local(rank, n):
    mesh = DeviceMesh((2,), ("a",))
    local = np.zeros((2 if rank == 0 else 4, 3))   # not array_split sizes
    with pytest.raises(ValueError, match="array_split"):
        DTensor.from_local(local, mesh, [Shard(0)])
    return True


def test_from_local_rejects_non_array_split_pieces():
    assert all(run_world(_bad_from_local, 2))


def _bad_from_local_2d(rank, n):
    # 2x2 mesh (rank = 2a + b), rows nested over both dims.  Line b of ranks
    # {0, 1} holds (2, 4) rows: not array_split.  Before, ranks 0 and 1 raised
    # there while ranks 2 and 3 (a good line) went on to the all-gather along
    # "a" and waited for them until the timeout.
    mesh = DeviceMesh((2, 2), ("a", "b"))
    local = np.zeros((2 if rank == 0 else 4, 3))
    with pytest.raises(ValueError) as info:
        DTensor.from_local(local, mesh, [Shard(0), Shard(0)], timeout=10)
    msg = str(info.value)
    if rank in (0, 1):
        assert "have sizes [2, 4]" in msg and "array_split" in msg, msg
    else:
        assert "world rank 0" in msg, msg
    # Differing dtypes or other sizes used to give ranks different DTensors;
    # here the failing line ({2, 3} along "b") is not rank 0's.
    dt = np.float32 if rank == 3 else np.float64
    with pytest.raises(ValueError) as info:
        DTensor.from_local(np.zeros((2, 3), dt), mesh, [Replicate(), Shard(0)], timeout=10)
    msg = str(info.value)
    if rank in (2, 3):
        assert "do not fit together" in msg, msg
        assert "world rank 2: float64 (2, 3), world rank 3: float32 (2, 3)" in msg, msg
    else:
        assert "world rank 2" in msg, msg
    mesh1 = DeviceMesh((n,), ("x",))
    with pytest.raises(ValueError) as info:
        DTensor.from_local(np.zeros((2, 3 + rank)), mesh1, [Shard(0)], timeout=10)
    msg = str(info.value)
    assert "do not fit together" in msg, msg
    assert ", ".join(f"world rank {r}: float64 (2, {3 + r})" for r in range(n)) in msg, msg
    # Nothing stale is left: a good call right after agrees everywhere.
    piece = expected_piece(GLOBAL, mesh.shape, [Shard(0), Shard(1)], mesh.coordinate)
    x = DTensor.from_local(piece.copy(), mesh, [Shard(0), Shard(1)], timeout=10)
    assert x.shape == GLOBAL.shape
    np.testing.assert_array_equal(x.full_tensor(), GLOBAL)
    return True


def test_from_local_errors_raise_on_every_rank_of_the_mesh():
    assert all(run_world(_bad_from_local_2d, 4, timeout=60))


def _from_local_ndim_mismatch(rank, n):
    # Pieces of different ndim.  Before, a rank whose piece lacked the sharded
    # dimension raised alone and the others waited in the shape inference's
    # all-gather until their timeout.
    mesh = DeviceMesh((n,), ("x",))
    # (rank 0's piece shape, the other ranks', placements)
    cases = [((3,), (4, 3), [Shard(1)]),    # rank 0's piece has no dimension 1
             ((4, 3), (3,), [Shard(0)]),    # every piece has dimension 0
             ((3,), (4, 3), [Shard(-1)])]   # -1 is another dimension by ndim
    for first, rest, ps in cases:
        with pytest.raises(ValueError) as info:
            DTensor.from_local(np.zeros(first if rank == 0 else rest), mesh, ps, timeout=10)
        msg = str(info.value)
        assert "do not fit together" in msg, msg
        for r in range(n):
            assert f"world rank {r}: float64 {first if r == 0 else rest}" in msg, msg
    # Every rank's piece lacks the dimension: every rank raises alike.
    with pytest.raises(ValueError, match="do not fit together"):
        DTensor.from_local(np.zeros(3), mesh, [Shard(1)], timeout=10)
    # On a 2-D mesh the ranks off the failing line name its first world rank.
    mesh2 = DeviceMesh((2, n // 2), ("a", "b"))
    local = np.zeros(2) if rank == 3 else np.zeros((2, 3))
    with pytest.raises(ValueError) as info:
        DTensor.from_local(local, mesh2, [Shard(0), Shard(1)], timeout=10)
    msg = str(info.value)
    if rank in (2, 3):
        assert "world rank 2: float64 (2, 3), world rank 3: float64 (2,)" in msg, msg
    else:
        assert "world rank 2" in msg and "see the error there" in msg, msg
    # A Shard dim missing on a mesh dimension of one rank: no line to tell, the
    # final agreement over the other dimensions does.
    mesh3 = DeviceMesh((1, n), ("one", "x"))
    local = np.zeros(4) if rank == 1 else np.zeros((4, 3))
    with pytest.raises(ValueError) as info:
        DTensor.from_local(local, mesh3, [Shard(1), Shard(0)], timeout=10)
    msg = str(info.value)
    assert ("out of range" in msg) if rank == 1 else ("world rank 1" in msg), msg
    # Nothing stale is left: a good call right after agrees everywhere.
    piece = np.array_split(GLOBAL, n, axis=1)[rank]
    x = DTensor.from_local(piece.copy(), mesh, [Shard(1)], timeout=10)
    assert x.shape == GLOBAL.shape
    np.testing.assert_array_equal(x.full_tensor(), GLOBAL)
    return True


def test_from_local_pieces_of_different_ndim_raise_on_every_rank():
    assert all(run_world(_from_local_ndim_mismatch, 4, timeout=60))


def _distribute_src_errors(rank, n):
    mesh = DeviceMesh((2, 2), ("a", "b"), ranks=[3, 1, 0, 2])   # out-of-order lines
    # The source passes no array, a dtype the collectives cannot carry, or a
    # byte-swapped one: before, it alone raised and the others waited in
    # broadcast_object.  Sources at every mesh position carry the error on.
    bad = {0: None, 1: np.zeros(3, np.complex128), 2: np.zeros(3, ">f4"), 3: [1.0, 2.0]}
    for src, what in ((0, "numpy.ndarray"), (1, "unsupported dtype complex128"),
                      (2, "non-native byte order"), (3, "numpy.ndarray")):
        with pytest.raises(TypeError) as info:
            distribute(bad[src] if rank == src else None, mesh, [Shard(0), Replicate()],
                       src=src, timeout=10)
        msg = str(info.value)
        assert what in msg, msg
        assert (f"world rank {src}" in msg) == (rank != src), msg
    # The mesh is still usable afterwards.
    g = GLOBAL.astype(np.float32)
    x = distribute(g if rank == 1 else None, mesh, [Shard(0), Shard(1)], src=1, timeout=10)
    check_layout(x, g)
    return True


def test_distribute_src_errors_raise_on_every_rank():
    assert all(run_world(_distribute_src_errors, 4, timeout=60))


def _distribute_bfloat16(rank, n):
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    mesh = DeviceMesh((2, 2), ("a", "b"), ranks=[3, 1, 0, 2])
    g = GLOBAL.astype(bf16)   # small integers: exact in bfloat16
    for src in (0, 3):
        # Before, the dtype travelled as dtype.str ('<V2') and came back as void.
        x = distribute(g if rank == src else None, mesh, [Shard(0), Replicate()], src=src,
                       timeout=10)
        assert x.dtype == bf16
        full = x.full_tensor(timeout=10)
        assert full.dtype == bf16
        np.testing.assert_array_equal(full.astype(np.float64), GLOBAL)
    return True


def test_distribute_from_src_keeps_bfloat16():
    pytest.importorskip("ml_dtypes")
    assert all(run_world(_distribute_bfloat16, 4, timeout=60))


def _distribute_from_src(rank, n):
    mesh = DeviceMesh((2, 2), ("a", "b"), ranks=[3, 1, 0, 2])   # out-of-order lines
    g = GLOBAL.astype(np.float32)
    for src_rank in range(n):
        for ps in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Partial(), Replicate()]):
            x = distribute(g if rank == src_rank else None, mesh, ps, src=src_rank)
            check_layout(x, g)
            np.testing.assert_array_equal(x.full_tensor(), g)
    return True


def test_distribute_from_one_rank_with_custom_layout():
    assert all(run_world(_distribute_from_src, 4))


def _spy_received(mesh, dtype, log):
    """Record, on every group of ``mesh``, the element count of each ``dtype`` array this
    rank receives through broadcast, scatter or scatter_v (not the metadata's)."""
    for k in range(mesh.ndim):
        if mesh.shape[k] == 1:
            continue
        g = mesh.get_group(k)

        def broadcast(array, src=0, *a, _g=g, _real=g.broadcast, **kw):
            if array.dtype == dtype and _g.rank != src:
                log.append(array.size)
            return _real(array, src, *a, **kw)

        def scatter_v(output, input, counts, src=0, *a, _g=g, _real=g.scatter_v, **kw):
            if output.dtype == dtype and _g.rank != src:
                log.append(output.size)
            return _real(output, input, counts, src, *a, **kw)

        def scatter(output, input, src=0, *a, _g=g, _real=g.scatter, **kw):
            if output.dtype == dtype and _g.rank != src:
                log.append(output.size)
            return _real(output, input, src, *a, **kw)

        g.broadcast, g.scatter_v, g.scatter = broadcast, scatter_v, scatter


def _distribute_scatters(rank, n, mesh_shape, ranks):
    # distribute(src=) sends each rank its piece, not the whole array: a rank
    # receives one array, the piece the Shard dimensions before its turn leave
    # (its own piece when one mesh dimension shards).  Results equal src=None.
    mesh = DeviceMesh(mesh_shape, tuple("ab"[:len(mesh_shape)]), ranks=ranks)
    log: list = []
    _spy_received(mesh, np.dtype(np.float32), log)
    one = [Shard(0), Shard(1)]
    if len(mesh_shape) == 1:
        combos = [[p] for p in one]
    else:
        combos = [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)],
                  [Replicate(), Shard(0)], [Shard(1), Replicate()], [Shard(1), Partial()],
                  [Partial(ReduceOp.MAX), Shard(0)], [Replicate(), Replicate()]]
    for shape in ((7, 5), (2, 3), (0, 3), (8, 4)):
        g = np.arange(float(np.prod(shape)), dtype=np.float32).reshape(shape) - 3
        for src in range(n):
            for ps in combos:
                del log[:]
                x = distribute(g if rank == src else None, mesh, ps, src=src, timeout=30)
                check_layout(x, g)
                ref = distribute(g, mesh, ps)
                assert x.to_local().dtype == ref.to_local().dtype
                np.testing.assert_array_equal(x.to_local(), ref.to_local())
                if rank == src:
                    assert log == [], (ps, log)
                    continue
                if g.size == 0:  # a line with nothing to scatter skips the collective
                    assert set(log) <= {0}, (ps, log)
                    continue
                assert len(log) == 1, (ps, log)     # one array, whatever the mesh
                shards = [i for i, p in enumerate(ps)
                          if isinstance(p, Shard) and mesh.shape[i] > 1]
                if not shards:
                    assert log == [g.size]
                    continue
                # At most the piece of the first Shard dimension: never the whole array.
                first = expected_piece(g, mesh.shape, [ps[i] if i == shards[0] else Replicate()
                                                       for i in range(mesh.ndim)],
                                       mesh.coordinate)
                assert log[0] <= first.size < g.size, (ps, log, first.shape)
                if len(shards) == 1:
                    assert log[0] == x.to_local().size, (ps, log)
    return True


@pytest.mark.parametrize("mesh_shape,ranks", [((4,), None), ((2, 2), None),
                                              ((2, 2), [3, 1, 0, 2])])
def test_distribute_from_src_scatters_pieces(mesh_shape, ranks):
    assert all(run_world(_distribute_scatters, 4, args=(mesh_shape, ranks), timeout=120))


def _bad_args(rank, n):
    mesh = DeviceMesh((2,), ("a",))
    with pytest.raises(ValueError, match="1 entries but the mesh has"):
        distribute(GLOBAL, DeviceMesh((1, 2)), [Shard(0)])
    with pytest.raises(ValueError, match="out of range"):
        distribute(GLOBAL, mesh, [Shard(2)])
    with pytest.raises(TypeError, match="placement"):
        distribute(GLOBAL, mesh, ["shard"])
    with pytest.raises(TypeError, match="numpy.ndarray"):
        distribute([1, 2], mesh, [Shard(0)])
    with pytest.raises(ValueError, match="not in the mesh"):
        distribute(GLOBAL, mesh, [Shard(0)], src=5)
    with pytest.raises(ValueError, match="op must be one of"):
        Partial(ReduceOp.BAND)
    with pytest.raises(TypeError, match="dim must be an int"):
        Shard(1.5)
    x = distribute(GLOBAL, mesh, [Shard(-1)])
    assert x.placements == (Shard(1),)
    assert x.redistribute([Shard(1)]) is x
    return True


def test_bad_arguments():
    assert all(run_world(_bad_args, 2))


def test_shard_sizes_is_array_split():
    for length in range(0, 12):
        for n in range(1, 6):
            assert shard_sizes(length, n) == [len(a) for a in np.array_split(np.arange(length), n)]


def _draws(rank):
    rng = np.random.default_rng(rank)
    return rng.standard_normal((4, 3)), rng.standard_normal((5, 3))


def _scalars(rank, n):
    # A 0-d array (a loss, a scalar parameter).  Before, numpy.ascontiguousarray
    # made the local array 1-D: shape () with a (1,) piece, and distribute(src=)
    # gave the global shape (1,).
    mesh = DeviceMesh((2, n // 2), ("a", "b"))
    g = np.array(-3.0)
    for ps in ([Replicate(), Replicate()], [Partial(), Replicate()],
               [Partial(ReduceOp.MAX), Partial(ReduceOp.MAX)],
               [Replicate(), Partial(ReduceOp.MIN)]):
        for x in (distribute(g, mesh, ps), distribute(g if rank == 3 else None, mesh, ps, src=3),
                  DTensor.from_local(distribute(g, mesh, ps).to_local(), mesh, ps),
                  DTensor(distribute(g, mesh, ps).to_local(), mesh, ps, ())):
            assert x.shape == () and x.local_shape == (), (ps, x.shape, x.local_shape)
            check_layout(x, g)
            full = x.full_tensor()
            assert full.shape == () and full == g, (ps, full)
    return True


def test_zero_dimensional_arrays():
    assert all(run_world(_scalars, 4))


def _partial_to_shard_without_staging(rank, n):
    # Partial -> Shard(0) with equal pieces reduces straight from the local array:
    # the padded staging copy is only for uneven or reordered pieces.
    mesh = DeviceMesh((n,))
    g = mesh.get_group(0)
    seen = []
    real = g.reduce_scatter
    outs = []
    for x in _draws(rank):  # 4 rows: equal pieces; 5: uneven, staged

        def spy(out, inp, *a, _x=x, **k):
            seen.append(np.shares_memory(inp, _x))
            return real(out, inp, *a, **k)

        g.reduce_scatter = spy
        outs.append(DTensor.from_local(x, mesh, [Partial()]).redistribute([Shard(0)]).to_local())
    return seen, outs


def test_partial_to_shard_reduces_equal_pieces_in_place_of_a_copy():
    res = run_world(_partial_to_shard_without_staging, 2)
    totals = [a + b for a, b in zip(_draws(0), _draws(1))]
    for r, (seen, outs) in enumerate(res):
        assert seen == [True, False]
        for got, total in zip(outs, totals):
            np.testing.assert_allclose(got, np.array_split(total, 2)[r], rtol=1e-12)


def _gather_and_all_to_all_buffers(rank, n, ranks):
    # The collectives read the local piece and write the result in place when the
    # layout allows: Shard(0) -> Replicate gathers into the result, Shard(1) ->
    # Replicate sends the piece itself (before: a transposed copy, padded when
    # uneven, then one or two copies of the output); Shard(1) -> Shard(0) sends
    # the local array itself and Shard(0) -> Shard(1) receives into the result
    # (before: block copies, a concatenation and a concatenated output).
    mesh = DeviceMesh((n,), ("x",), ranks=ranks)
    in_order = ranks is None or list(ranks) == sorted(ranks)
    g = mesh.get_group(0)
    calls = []
    for name in ("all_gather", "all_gather_v", "all_to_all_v"):
        real = getattr(g, name)

        def spy(out, *a, _real=real, _name=name, **k):
            inp = a[1] if _name != "all_gather" else a[0]
            calls.append((_name, out, inp))
            return _real(out, *a, **k)

        setattr(g, name, spy)
    for shape in ((8, 6), (7, 5)):       # equal pieces on 2 ranks, then uneven
        glob = np.arange(float(np.prod(shape))).reshape(shape)
        for src, dst in ((Shard(0), Replicate()), (Shard(1), Replicate()),
                         (Shard(1), Shard(0)), (Shard(0), Shard(1))):
            x = distribute(glob, mesh, [src])
            del calls[:]
            y = x.redistribute([dst])
            check_layout(y, glob)
            (name, out, inp), = calls
            uneven = shape[src.dim] % n != 0
            if dst == Replicate():
                assert name == ("all_gather_v" if uneven else "all_gather")
                assert np.shares_memory(inp, x.to_local()), (src, dst)
                assert np.shares_memory(out, y.to_local()) == (src.dim == 0 and in_order)
            elif src == Shard(1):
                assert np.shares_memory(inp, x.to_local()) == in_order, (src, dst)
            else:
                assert np.shares_memory(out, y.to_local()) == in_order, (src, dst)
    return True


@pytest.mark.parametrize("n,ranks", [(2, None), (3, None), (3, [2, 0, 1])])
def test_gather_and_all_to_all_use_the_arrays_in_place(n, ranks):
    assert all(run_world(_gather_and_all_to_all_buffers, n, args=(ranks,)))


def _mixed_partials(rank, n):
    # Partial on two mesh dimensions with different ops.  With pieces x[a][b], SUM
    # over "a" and MAX over "b" is max_b(sum_a x) or sum_a(max_b x) by which
    # dimension is reduced first.  Before, both were accepted: full_tensor() reduced
    # "a" first, redistribute([Partial(SUM), Replicate()]) reduced "b" first, and
    # [Replicate(), Partial(SUM)] -> [Partial(PROD), Partial(SUM)] filled ones that
    # the SUM over "b" then added up: values silently wrong.
    mesh = DeviceMesh((2, 2), ("a", "b"))
    a, b = mesh.coordinate
    pieces = np.arange(4 * 15, dtype=np.float64).reshape(2, 2, 5, 3) % 7 - 3
    mine = pieces[a, b].copy()
    S, M, N, P, A = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD, ReduceOp.AVG)
    for ops in ((S, M), (M, S), (M, N), (P, S), (A, P), (A, M)):
        ps = [Partial(ops[0]), Partial(ops[1])]
        with pytest.raises(ValueError, match="do not commute") as info:
            DTensor.from_local(mine, mesh, ps)
        assert all(op.name in str(info.value) for op in ops), str(info.value)
        with pytest.raises(ValueError, match="do not commute"):
            DTensor.from_local(mine, mesh, ps, shape=(5, 3))
        with pytest.raises(ValueError, match="do not commute"):
            DTensor(mine, mesh, ps, (5, 3))
        with pytest.raises(ValueError, match="do not commute"):
            distribute(pieces[0, 0], mesh, ps)
        with pytest.raises(ValueError, match="do not commute"):
            distribute(pieces[0, 0] if rank == 0 else None, mesh, ps, src=0, timeout=10)
        x = DTensor.from_local(mine, mesh, [Partial(ops[0]), Replicate()])
        with pytest.raises(ValueError, match="do not commute"):
            x.redistribute(ps)
    # Ops that commute: the same op twice, or SUM with AVG.  numpy oracle: reduce the
    # piece grid over "a" with the first op, then over "b" with the second; every
    # redistribution (through either order) must give that value.
    red = {S: np.sum, A: np.mean, M: np.max, N: np.min, P: np.prod}
    count = 0
    for ops in ((S, A), (A, S), (A, A), (M, M), (N, N), (P, P)):
        want = red[ops[1]](red[ops[0]](pieces, axis=0), axis=0)
        x = DTensor.from_local(mine, mesh, [Partial(ops[0]), Partial(ops[1])])
        np.testing.assert_allclose(x.full_tensor(), want, rtol=1e-12)
        choices = [Shard(0), Shard(1), Replicate(), Partial(ops[0]), Partial(ops[1])]
        for dst in itertools.product(choices, repeat=2):
            y = x.redistribute(dst)
            np.testing.assert_allclose(y.full_tensor(), want, rtol=1e-12, err_msg=str(dst))
            count += 1
        # From the logical value: distribute fills each Partial dimension with op's rule.
        z = distribute(want, mesh, [Partial(ops[0]), Partial(ops[1])])
        np.testing.assert_allclose(z.full_tensor(), want, rtol=1e-12)
    return count


def test_partial_ops_that_do_not_commute_are_refused():
    # 25 targets per op pair, all allowed: each Partial op in `choices` commutes.
    assert run_world(_mixed_partials, 4, timeout=120) == [6 * 25] * 4


def _given_shape(rank, n):
    mesh = DeviceMesh((2, 2), ("a", "b"))
    a, b = mesh.coordinate
    ps = [Shard(0), Shard(1)]
    piece = expected_piece(GLOBAL, mesh.shape, ps, mesh.coordinate)   # uneven: (4|3, 3|2)
    # A shape the pieces do not fit: the error names this rank, its piece, the
    # placements and the shape (before, neither the rank nor its coordinate).
    with pytest.raises(ValueError) as info:
        DTensor.from_local(piece.copy(), mesh, ps, shape=(9, 5))
    msg = str(info.value)
    for part in (f"world rank {rank} (mesh coordinate ({a}, {b}))",
                 f"local array has shape {piece.shape}", "(Shard(0), Shard(1))", "(9, 5)"):
        assert part in msg, msg
    with pytest.raises(ValueError, match="negative"):
        DTensor.from_local(np.zeros((0, 5)), mesh, [Replicate(), Replicate()], shape=(-1, 5))
    # Valid uneven and empty pieces are accepted, checked or not.
    for check in (False, True):
        x = DTensor.from_local(piece.copy(), mesh, ps, shape=(7, 5), run_check=check)
        np.testing.assert_array_equal(x.full_tensor(), GLOBAL)
        tiny = GLOBAL[:1, :3]   # 1 row over 2 ranks, then 3 cols: some pieces are empty
        tp = expected_piece(tiny, mesh.shape, [Shard(0), Shard(0)], mesh.coordinate)
        y = DTensor.from_local(tp.copy(), mesh, [Shard(0), Shard(0)], shape=(1, 3),
                               run_check=check)
        np.testing.assert_array_equal(y.full_tensor(), tiny)
    # Each rank computing the shape from its own piece: (8, 5) on b=0, (6, 5) on b=1.
    # Each fits its own rank; run_check finds that the ranks disagree.
    rows = expected_piece(GLOBAL, mesh.shape, [Replicate(), Shard(0)], mesh.coordinate)
    own = (rows.shape[0] * 2, 5)
    with pytest.raises(ValueError) as info:
        DTensor.from_local(rows.copy(), mesh, [Replicate(), Shard(0)], shape=own,
                           run_check=True, timeout=10)
    msg = str(info.value)
    assert "different global shapes" in msg, msg
    assert "world ranks [0, 2]: shape (8, 5), float64" in msg, msg
    assert "world ranks [1, 3]: shape (6, 5), float64" in msg, msg
    # Dtypes differing along a Replicate dimension: the inferred shape compares
    # nothing there; run_check does.
    dt = np.float32 if rank == 3 else np.float64
    with pytest.raises(ValueError) as info:
        DTensor.from_local(np.zeros((2, 3), dt), mesh, [Replicate(), Replicate()],
                           run_check=True, timeout=10)
    assert "world ranks [3]: shape (2, 3), float32" in str(info.value), str(info.value)
    # One rank's piece does not fit: with run_check every rank raises, naming it.
    bad = np.zeros((9, 9)) if rank == 2 else piece.copy()
    with pytest.raises(ValueError) as info:
        DTensor.from_local(bad, mesh, ps, shape=(7, 5), run_check=True, timeout=10)
    msg = str(info.value)
    assert "world rank 2 (mesh coordinate (1, 0)): local array has shape (9, 9)" in msg, msg
    assert "every rank of the mesh raises" in msg, msg
    # Nothing stale is left: a good checked call right after agrees everywhere.
    x = DTensor.from_local(piece.copy(), mesh, ps, shape=(7, 5), run_check=True, timeout=10)
    np.testing.assert_array_equal(x.full_tensor(), GLOBAL)
    return True


def test_from_local_with_a_given_shape():
    assert all(run_world(_given_shape, 4, timeout=60))
