"""DeviceMesh: group membership and collectives along every dimension.

Oracle: the grid is rebuilt with numpy (``np.arange(n).reshape(shape)`` or
the custom layout), so the expected members of every line, and the sum of
any per-rank value over a line, are known on each rank without
communication.  Values are small integers: sums are exact.
"""

from __future__ import annotations

import numpy as np
import pytest

from ringlet.mesh import DeviceMesh
from ringlet.testing import WorldError, run_world


def _line(grid: np.ndarray, coord, d: int):
    idx = list(coord)
    idx[d] = slice(None)
    return [int(r) for r in grid[tuple(idx)]]


def _check_mesh(rank, n, shape, names, ranks=None):
    mesh = DeviceMesh(shape, names, ranks=ranks)
    grid = (np.arange(n) if ranks is None else np.asarray(ranks)).reshape(shape)
    coord = tuple(int(c) for c in np.argwhere(grid == rank)[0])
    assert mesh.coordinate == coord
    assert mesh.shape == tuple(shape) and mesh.ndim == len(shape)
    assert mesh.size() == n
    for d, name in enumerate(names):
        line = _line(grid, coord, d)
        g = mesh.get_group(name)
        assert g is mesh[d] is mesh[name] is mesh.get_group(d - len(names))
        assert g.ranks == sorted(line)
        assert g.size == shape[d] == mesh.size(name)
        assert mesh.get_local_rank(name) == coord[d]
        assert mesh.ranks_along(name) == line
        # line_order maps coordinate -> group rank.
        assert [g.ranks[o] for o in mesh.line_order(name)] == line
        # A collective over each group: sum of (world rank + 1) * 10**d over the line.
        v = np.array([(rank + 1) * 10 ** d], np.int64)
        g.all_reduce(v)
        assert int(v[0]) == sum((r + 1) * 10 ** d for r in line)
        # all_gather in group-rank order.
        out = np.zeros(g.size, np.int64)
        g.all_gather(out, np.array([rank], np.int64))
        assert out.tolist() == sorted(line)
    return coord


@pytest.mark.parametrize("shape,names", [
    ((2, 2), ("dp", "tp")),
    ((4,), ("dp",)),
])
def test_mesh_groups_4_ranks(shape, names):
    coords = run_world(_check_mesh, 4, args=(shape, names))
    assert sorted(coords) == sorted(np.ndindex(*shape))


@pytest.mark.parametrize("shape,names", [
    ((2, 4), ("dp", "tp")),
    ((2, 2, 2), ("pp", "dp", "tp")),
    ((8,), ("world",)),
])
def test_mesh_groups_8_ranks(shape, names):
    coords = run_world(_check_mesh, 8, args=(shape, names))
    assert sorted(coords) == sorted(np.ndindex(*shape))


def test_mesh_custom_layout_out_of_order():
    # Ranks not increasing along the lines: group rank != coordinate.
    layout = [[5, 2, 7, 0], [1, 6, 3, 4]]
    run_world(_check_mesh, 8, args=((2, 4), ("a", "b"), layout))


def _submesh(rank, n):
    mesh = DeviceMesh((2, 2, 2), ("pp", "dp", "tp"))
    grid = np.arange(8).reshape(2, 2, 2)
    pp, dp, tp = mesh.coordinate
    sub = mesh["dp", "tp"]
    assert sub.dim_names == ("dp", "tp") and sub.shape == (2, 2)
    assert sub.mesh.tolist() == grid[pp].tolist()
    assert sub.coordinate == (dp, tp)
    assert sub["tp"] is mesh["tp"] and sub["dp"] is mesh["dp"]
    rev = mesh.submesh(("tp", "pp"))          # reordered
    assert rev.mesh.tolist() == grid[:, dp, :].T.tolist()
    assert rev.coordinate == (tp, pp)
    one = mesh[("pp",)]
    assert one.ndim == 1 and one.get_group() is mesh["pp"]
    # Sub-meshes share groups: a collective over the sub-mesh's dims still works.
    v = np.array([rank], np.int64)
    sub.get_group("dp").all_reduce(v)
    assert int(v[0]) == sum(_line(grid, (pp, dp, tp), 1))
    return True


def test_submesh_shares_groups():
    assert all(run_world(_submesh, 8))


def _subgroup(rank, n):
    mesh = DeviceMesh((4, 2), ("pp", "dp"))
    grid = np.arange(8).reshape(4, 2)
    pp, dp = mesh.coordinate
    g = mesh.get_subgroup("pp", (0, 3))        # collective: every rank calls
    again = mesh.get_subgroup("pp", [3, 0])    # cached, order-insensitive
    assert g is again
    whole = mesh.get_subgroup("pp", range(4))  # whole dimension: the dim's group
    assert whole is mesh["pp"]
    if pp in (0, 3):
        assert g.ranks == [int(grid[0, dp]), int(grid[3, dp])]
        v = np.array([rank], np.int64)
        g.all_reduce(v)
        assert int(v[0]) == int(grid[0, dp] + grid[3, dp])
    else:
        assert g is None
    return True


def test_get_subgroup_first_last_stages():
    assert all(run_world(_subgroup, 8))


def _partial_mesh(rank, n):
    # A mesh over ranks 1..4 of a 6-rank world: ranks 0 and 5 take part in
    # construction (collective) but are not in the mesh.
    mesh = DeviceMesh((2, 2), ("dp", "tp"), ranks=[1, 2, 3, 4])
    if rank in (0, 5):
        assert mesh.coordinate is None
        with pytest.raises(ValueError, match="not in the mesh"):
            mesh.get_group("dp")
        return None
    v = np.array([rank], np.int64)
    mesh["tp"].all_reduce(v)
    return int(v[0])


def test_mesh_over_subset_of_world():
    out = run_world(_partial_mesh, 6)
    assert out == [None, 3, 3, 7, 7, None]


def _new_groups(before):
    """The groups this rank's world made since ``before`` (a set of ids), strongly held."""
    from ringlet import _world

    return [g for g in list(_world._current()._groups) if id(g) not in before]


def _close(rank, n):
    from ringlet import _world

    import ringlet
    from ringlet.dtensor import Shard, distribute
    from ringlet.errors import RingletError

    before = {id(g) for g in _world._current()._groups}
    # Ranks 0 and 5 hold only non-member handles; they close them too.
    mesh = DeviceMesh((2, 2), ("dp", "tp"), ranks=[1, 2, 3, 4])
    sub = mesh.get_subgroup("dp", (1,))
    made = _new_groups(before)
    assert len(made) == 2 + 2 + 2        # the lines of both dims, get_subgroup's
    assert all(not g._closed for g in made)
    if mesh.coordinate is not None:
        tp = mesh["tp"]
        inner = mesh["dp", "tp"]
        with pytest.raises(ValueError, match="sub-mesh"):
            inner.close()                # it owns nothing
        v = np.array([rank], np.int64)
        tp.all_reduce(v)
    ringlet.barrier()                    # nobody is still in an operation on the groups
    assert not mesh.closed
    mesh.close()
    assert mesh.closed and all(g._closed for g in made)
    mesh.close()                         # idempotent
    if mesh.coordinate is not None:
        for use in (lambda: mesh.get_group("tp"), lambda: mesh["dp"],
                    lambda: mesh.submesh(("dp",)), lambda: mesh.get_subgroup("tp", (0,)),
                    lambda: inner.get_group("dp"),
                    lambda: distribute(np.zeros((4, 2)), mesh, [Shard(0), Shard(1)])):
            with pytest.raises(RingletError, match="was closed"):
                use()
        with pytest.raises(RingletError):
            tp.all_reduce(np.zeros(1))  # a handle taken before fails on use
        assert sub is None or sub._closed
    # The world and new meshes are unaffected; the context manager closes on exit.
    before = {id(g) for g in _world._current()._groups}
    with DeviceMesh((6,), ("x",)) as m2:
        made = _new_groups(before)       # held here: closed groups are dropped
        v = np.array([rank], np.int64)
        m2["x"].all_reduce(v)
        ringlet.barrier()
    assert len(made) == 1 and made[0]._closed and m2.closed
    w = np.array([1], np.int64)
    ringlet.all_reduce(w)
    return int(v[0]), int(w[0])


def test_close_releases_every_group_the_mesh_made():
    assert run_world(_close, 6) == [(15, 6)] * 6


def _bad(rank, n):
    with pytest.raises(ValueError, match="holds 6 ranks"):
        DeviceMesh((2, 3))
    with pytest.raises(ValueError, match="positive"):
        DeviceMesh((2, 0))
    with pytest.raises(TypeError, match="shape"):
        DeviceMesh("ab")
    with pytest.raises(ValueError, match="distinct"):
        DeviceMesh((2, 2), ("a", "a"))
    with pytest.raises(ValueError, match="2 dim_names"):
        DeviceMesh((4,), ("a", "b"))
    with pytest.raises(ValueError, match="distinct"):
        DeviceMesh((2, 2), ranks=[0, 0, 1, 2])
    with pytest.raises(ValueError, match="not in the parent"):
        DeviceMesh((2, 2), ranks=[0, 1, 2, 9])
    with pytest.raises(TypeError, match="integers"):
        DeviceMesh((2, 2), ranks=[0.0, 1.0, 2.0, 3.0])
    mesh = DeviceMesh((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="no dimension named 'pp'"):
        mesh.get_group("pp")
    with pytest.raises(ValueError, match="out of range"):
        mesh.get_group(2)
    with pytest.raises(ValueError, match="needs a dimension"):
        mesh.get_group()
    with pytest.raises(ValueError, match="repeated"):
        mesh.submesh(("dp", "dp"))
    with pytest.raises(ValueError, match="out of range"):
        mesh.get_subgroup("dp", (0, 2))
    assert "dp=2" in repr(mesh)
    return True


def test_bad_arguments_raise_before_any_group():
    assert all(run_world(_bad, 4))


def _ragged(rank, n):
    # Before, numpy's "inhomogeneous shape" error named neither ranks nor the rows.
    with pytest.raises(ValueError, match=r"ranks is a ragged nested list \(ranks\[0\] has 3 "
                                         r"entries but ranks\[1\] has 1 entry\).*shape \(2, 2\)"):
        DeviceMesh((2, 2), ranks=[[0, 1, 2], [3]])
    with pytest.raises(ValueError, match=r"ragged.*ranks\[0\]\[0\] has 2 entries but "
                                         r"ranks\[0\]\[1\] has 1 entry"):
        DeviceMesh((1, 2, 2), ranks=[[[0, 1], [2]]])
    with pytest.raises(ValueError, match=r"ragged.*ranks\[0\] is a single rank but ranks\[1\] "
                                         r"has 2 entries"):
        DeviceMesh((4,), ranks=(0, (1, 2), 3))
    # Rows of numpy arrays are nested lists too; a well-formed grid still builds.
    with pytest.raises(ValueError, match=r"ragged.*ranks\[1\] has 1 entry"):
        DeviceMesh((2, 2), ranks=[np.array([0, 1]), np.array([3])])
    mesh = DeviceMesh((2, 2), ranks=[np.array([3, 1]), (0, 2)])
    assert mesh.mesh.tolist() == [[3, 1], [0, 2]]
    mesh.close()
    return True


def test_ragged_ranks_name_the_rows():
    assert all(run_world(_ragged, 4))


def test_mesh_desync_is_detected():
    # Rank 1 builds a different layout: new_group reports the mismatch.
    def fn(rank, n):
        shape = (2, 2) if rank != 1 else (4, 1)
        DeviceMesh(shape)

    with pytest.raises(WorldError) as ei:
        run_world(fn, 4, timeout=30)
    assert "DesyncError" in str(ei.value) or "desync" in str(ei.value).lower()


def test_mesh_in_process_mode():
    # Real processes: the launch path a job uses.
    coords = run_world(_check_mesh, 4, mode="process", timeout=120,
                       args=((2, 2), ("dp", "tp")))
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]


def _pp_dp_from_mesh(rank, P):
    import numpy as np

    import ringlet
    from ringlet.pipeline import pipeline_data_groups

    mesh = ringlet.DeviceMesh((2, 2), ("dp", "pp"))
    pp, dp, stage, replica = pipeline_data_groups(mesh=mesh)
    x = np.array([rank], np.int64)
    pp.all_reduce(x)
    y = np.array([rank], np.int64)
    dp.all_reduce(y)
    return stage, replica, int(x[0]), int(y[0])


def test_pipeline_data_groups_accept_a_mesh():
    from ringlet.testing import run_world

    res = run_world(_pp_dp_from_mesh, 4, mode="thread", timeout=60)
    # row-major (dp, pp): world rank = dp * 2 + pp
    for r, (stage, replica, pp_sum, dp_sum) in enumerate(res):
        assert (replica, stage) == divmod(r, 2)
        assert pp_sum == sum(replica * 2 + s for s in range(2))
        assert dp_sum == sum(d * 2 + stage for d in range(2))
