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
