"""Node-aware (hierarchical) collectives: a group's host layout and the algorithms over it.

A group whose ranks sit on several hosts gets two sub-communicators per
rank, created once, at its first hierarchical operation: ``intra`` (the
group's ranks on this rank's host) and ``inter`` (the ranks with this rank's
local index on every host that has one).  Every algorithm here is a short
composition of flat collectives on those, run inside the parent group's
operation (its lock, its poisoning, one deadline for all phases).  The steps
and the bytes each puts on intra- and inter-host links are in
docs/algorithms.md ("Hierarchical collectives").

The choice between flat and hierarchical (``_Hier.use``) reads only the op,
its byte count, the layout and the cost model parameters rank 0 handed out
at init, so every rank of a group takes the same decision.
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _core
from . import _costmodel as cm
from ._dtypes import ReduceOp, dtype_code
from ._topology import host_groups
from .errors import DesyncError, GroupPoisonedError, RingletError

__all__ = ["Topology"]

# The largest and smallest slice of a pipelined hierarchical all_reduce (of the
# buffer), reduce_scatter (of the input) or all_gather (of the output); an op of N
# bytes takes slices of N/64 within them, or larger where the layout's latencies
# need it (cm.slice_bytes, which the cost model predicts with).
SLICE_BYTES = cm.SLICE_BYTES
SLICE_MIN_BYTES = cm.SLICE_MIN_BYTES
_AVG = 4  # RL_AVG; AVG runs as SUM and is scaled once at the end, as the C core does
_SUM = 0
_MAX = int(ReduceOp.MAX)
_I64 = dtype_code(np.dtype(np.int64))


class Topology:
    """Which ranks of a group share a host.  ``ProcessGroup.topology`` / ``ringlet.get_topology``.

    Attributes:
        host_ids: each group rank's same-host identity (``RINGLET_HOST_ID`` or derived).
        hosts: group ranks per host, hosts in order of their lowest rank.
        num_hosts: ``len(hosts)``.
        ranks_per_host: ``len(h)`` for each host (may differ between hosts).
        host: index into ``hosts`` of this rank's host (-1 for a non-member).
        local_rank: this rank's index within its host (-1 for a non-member).
        local_size: the number of group ranks on this rank's host (0 for a non-member).
        uniform: every host has the same number of ranks.
    """

    def __init__(self, host_ids: Sequence[str], rank: int) -> None:
        self.host_ids: Tuple[str, ...] = tuple(host_ids)
        self.hosts: Tuple[Tuple[int, ...], ...] = tuple(tuple(h) for h in host_groups(host_ids))
        self.num_hosts = len(self.hosts)
        self.ranks_per_host: Tuple[int, ...] = tuple(len(h) for h in self.hosts)
        self.uniform = len(set(self.ranks_per_host)) <= 1
        # Per group rank: its host index and local index.
        self._where: List[Tuple[int, int]] = [(0, 0)] * len(self.host_ids)
        for hi, ranks in enumerate(self.hosts):
            for li, r in enumerate(ranks):
                self._where[r] = (hi, li)
        self.host, self.local_rank = self._where[rank] if rank >= 0 else (-1, -1)
        self.local_size = self.ranks_per_host[self.host] if rank >= 0 else 0

    def where(self, rank: int) -> Tuple[int, int]:
        """(host index, local index) of group rank ``rank``."""
        return self._where[rank]

    def crossing(self) -> int:
        """The most ring edges (r -> r+1 in group rank order) that leave one host."""
        out = [0] * self.num_hosts
        n = len(self.host_ids)
        for r in range(n):
            a, b = self._where[r][0], self._where[(r + 1) % n][0]
            if a != b:
                out[a] += 1
        return max(out) if out else 0

    def __repr__(self) -> str:
        return (f"Topology(num_hosts={self.num_hosts}, ranks_per_host={list(self.ranks_per_host)}, "
                f"host={self.host}, local_rank={self.local_rank})")


# A slice's ring latencies stay below this share of its time on the host link
# (cm.slice_bytes); 0: no such floor (the tests' small slices).
SLICE_LATENCY_SHARE = 0.05


def _deadline(ms: int) -> float:
    return time.monotonic() + ms / 1000.0


def _left(deadline: float) -> int:
    # Each phase gets what remains of the op's one deadline (at least 1 ms,
    # so an expired deadline still ends in the core's CollectiveTimeout).
    return max(1, int((deadline - time.monotonic()) * 1000))


class _Hier:
    """One group's hierarchical plan: layout, chooser and (lazily) sub-communicators."""

    def __init__(self, group: Any, topo: Topology, algo: str, params: cm.ModelParams) -> None:
        self.group = group
        self.topo = topo
        self.params = params
        self.sizes = topo.ranks_per_host
        self.crossing = topo.crossing()
        self._cache: Dict[tuple, bool] = {}
        self.intra: Any = None
        self.inter: Any = None
        # perm[j*H + h] = hosts[h][j]: the group rank whose block sits at
        # position (local index j, host h) of a local-index-major layout.
        if topo.uniform:
            L = self.sizes[0]
            self.perm = np.array([topo.hosts[h][j] for j in range(L)
                                  for h in range(topo.num_hosts)], dtype=np.intp)
            self.perm_is_identity = bool(np.array_equal(self.perm, np.arange(self.perm.size)))
        else:
            self.perm = None
            self.perm_is_identity = False
        self.algo = algo  # "auto" or "hier"; sets the floors below

    @property
    def algo(self) -> str:
        return self._algo

    @algo.setter
    def algo(self, algo: str) -> None:
        self._algo = algo
        self._cache.clear()
        # Per op, the size below which the flat form always wins, so that the
        # group's small ops decide with one comparison (``use`` stays the rule).
        self.floor_all_reduce = self._floor("all_reduce")
        self.floor_broadcast = self._floor("broadcast")
        self.floor_reduce = self._floor("reduce")
        self.floor_all_gather = self._floor("all_gather")
        self.floor_reduce_scatter = self._floor("reduce_scatter")

    # ---- the choice ----------------------------------------------------------
    def use(self, op: str, nbytes: int, count: int, root: int = 0) -> bool:
        """Whether ``op`` of ``nbytes`` runs hierarchically (same answer on every rank).

        ``root`` does not enter the choice: ranks that pass different roots (a bug
        in the program) still take the same form, whose root check (``_agree_root``)
        then raises ``DesyncError``.  A root whose local index some host lacks is
        relayed through local rank 0 (``broadcast``, ``reduce``)."""
        if count == 0:
            return False
        key = (op, nbytes, count)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        ok = cm.hier_applies(op, self.sizes, 0)
        even_ar = op == "all_reduce" and self.topo.uniform
        if even_ar and count < self.sizes[0]:
            ok = False  # not one element per local rank: nothing to split
        if ok and self.algo == "auto":
            tail = even_ar and count % self.sizes[0] != 0
            ok = (cm.hier_time(op, nbytes, self.sizes, self.params, tail)
                  < cm.flat_time(op, nbytes, self.sizes, self.params, self.crossing))
        if len(self._cache) < 4096:
            self._cache[key] = ok
        return ok

    def _floor(self, op: str) -> float:
        """The least ``nbytes`` at which ``use`` can say yes: 0 with ``hier``; with
        ``auto``, the least at which the flat form's predicted time exceeds the
        hierarchical form's at 0 bytes (its least: every byte and every further
        slice adds time), inf where the form never applies."""
        if not cm.hier_applies(op, self.sizes, 0):
            return math.inf
        if self.algo != "auto":
            return 0
        least = cm.hier_time(op, 0, self.sizes, self.params)
        def flat(n: int) -> float:
            return cm.flat_time(op, n, self.sizes, self.params, self.crossing)
        lo, hi = 0, 1
        while not flat(hi) > least:
            if hi >= 1 << 62:
                return math.inf
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # flat_time grows with n: the least hi with flat(hi) > least
            mid = (lo + hi) // 2
            if flat(mid) > least:
                hi = mid
            else:
                lo = mid
        return 0 if flat(0) > least else hi

    def _slice(self, nbytes: int) -> int:
        return cm.slice_bytes(nbytes, self.sizes, self.params, SLICE_BYTES, SLICE_MIN_BYTES,
                              SLICE_LATENCY_SHARE)

    # ---- sub-communicators ---------------------------------------------------
    def _subs(self, ms: int) -> None:
        """Create the intra- and inter-host groups (collective over the parent, once),
        within the calling operation's ``ms`` milliseconds."""
        if self.intra is not None:
            return
        t = self.topo
        g = self.group
        lmax = max(self.sizes)
        # Every rank lists every sub-group in the same order: hosts, then local indices.
        lists = [[g.ranks[r] for r in host] for host in t.hosts]
        lists += [[g.ranks[host[j]] for host in t.hosts if j < len(host)] for j in range(lmax)]
        try:
            made = g._world.sub_groups(g, lists, timeout=ms / 1000.0)
        except RingletError as exc:
            raise type(exc)(f"{exc} [group rank {g.rank}: creating the sub-groups of a "
                            f"hierarchical collective of group {g.comm_id}]",
                            rank=g.rank, peer=None, op=exc.op, seq=exc.seq,
                            waited=exc.waited) from exc
        self.intra = made[t.host]
        self.inter = made[t.num_hosts + t.local_rank]

    def _subgroups(self) -> List[Any]:
        return [s for s in (self.intra, self.inter) if s is not None]

    def cancel(self, status: int, reason: str) -> None:
        """Wake a phase blocked in a sub-group (the parent is closing with work pending)."""
        for sub in self._subgroups():
            if not sub._closed:
                sub._cancel(status, reason)

    def close(self) -> None:
        """Close the sub-groups with their parent (idempotent).  They belong to this
        plan alone: ``_subs`` makes them for this parent group, under a store key of
        its own, and hands them to no other group."""
        g = self.group
        for sub in self._subgroups():
            if not sub._closed:
                sub._closed_by = (f"{g._closed_by} of group {g.comm_id}, whose hierarchical "
                                  f"sub-group it is")
                sub._close()
            g._world._groups.discard(sub)

    def _agree_root(self, coll: Any, op: str, root: int, dl: float) -> None:
        """Raise ``DesyncError`` on every rank when ranks passed different roots.

        The phases of different roots run on different sub-groups, where ranks would
        wait for each other until the deadline; a root-only sender never learns of a
        peer that disagrees (docs/errors.md).  So a rooted op first runs one 16-byte
        all_reduce (MAX) of the group: (root·P + rank, (P−1−root)·P + rank) gives the
        largest and smallest root and a rank that passed each."""
        g = self.group
        P = g.size
        v = np.array([root * P + g.rank, (P - 1 - root) * P + g.rank], dtype=np.int64)
        t0 = time.monotonic()
        try:
            _C.all_reduce(coll, v, _I64, _MAX, _left(dl))
        except RingletError as exc:
            if isinstance(exc, GroupPoisonedError):
                raise
            raise type(exc)(f"{exc} [group rank {g.rank}: comparing the roots of a "
                            f"hierarchical {op} of group {g.comm_id}]", rank=exc.rank,
                            peer=exc.peer, op=exc.op, seq=exc.seq, waited=exc.waited) from exc
        hi, hi_rank = divmod(int(v[0]), P)
        lo, lo_rank = P - 1 - int(v[1]) // P, int(v[1]) % P
        if hi == lo:
            return
        theirs, peer = (hi, hi_rank) if root != hi else (lo, lo_rank)
        seq = coll.seq
        waited = time.monotonic() - t0
        raise DesyncError(
            f"rank {g.rank}: {op} seq={seq} peer {peer} after {waited:.3f}s: desync: ranks "
            f"passed different roots to {op} seq={seq}: root {root} on this rank, root "
            f"{theirs} on the peer [group rank {g.rank}: compared before the phases of a "
            f"hierarchical collective of group {g.comm_id}, over world ranks {g.ranks}; the "
            f"peer is group rank {peer}]", rank=g.rank, peer=peer, op=op, seq=seq,
            waited=waited)

    def _phase(self, sub: Any, op: str, fn: Any, *args: Any) -> Any:
        """Run one phase on a sub-group; its errors name the parent group's ranks."""
        return self._named(sub, op, lambda: sub._call(op, False, fn, *args))

    def _named(self, sub: Any, op: str, run: Any) -> Any:
        """``run()``, a phase on ``sub``; its errors name the parent group's ranks."""
        try:
            return run()
        except RingletError as exc:
            if isinstance(exc, GroupPoisonedError):
                raise
            g = self.group
            peer = exc.peer
            if isinstance(peer, int) and 0 <= peer < len(sub.ranks):
                peer = g.ranks.index(sub.ranks[peer])
            where = "intra-host" if sub is self.intra else "inter-host"
            raise type(exc)(f"{exc} [group rank {g.rank}: the {where} {op} phase of a "
                            f"hierarchical collective of group {g.comm_id}, over world ranks "
                            f"{sub.ranks}; the peer is group rank {peer}]",
                            rank=g.rank, peer=peer, op=exc.op, seq=exc.seq,
                            waited=exc.waited) from exc

    # ---- algorithms ----------------------------------------------------------
    # Each runs as the parent group's operation: fn(coll, *args) under its lock.
    def all_reduce(self, coll: Any, arr: np.ndarray, code: int, op: int, ms: int) -> None:
        dl = _deadline(ms)  # before the sub-groups: their set-up counts against it
        self._subs(_left(dl))
        flat = arr.reshape(-1)
        P = self.group.size
        sop = _SUM if op == _AVG else op
        if not self.topo.uniform:
            self._leader_all_reduce(flat, code, op, sop, P, dl)
            return
        L = self.sizes[0]
        b = flat.size // L
        main = flat[: b * L]
        # Slices of whole blocks (c elements per local rank, c*L of the buffer).
        slices = self._cuts(b, flat.itemsize * L)
        if len(slices) == 1:
            part = np.empty(b, dtype=flat.dtype)
            self._slice_rs(main, part, code, sop, dl)
            self._phase(self.inter, "all_reduce", _C.all_reduce, part, code, sop, _left(dl))
            self._slice_ag(main, part, code, op, P, dl)
        else:
            self._pipelined(main, slices, L, code, op, sop, P, dl)
        if b * L < flat.size:
            # The count % L elements past the last whole block: one small flat all_reduce.
            _C.all_reduce(coll, flat[b * L:], code, op, _left(dl))

    # The three phases of the equal-hosts all_reduce, on one slice ``seg`` (c*L
    # elements) of the buffer: 1. intra reduce_scatter, local rank j gets block j
    # of the slice summed over its host; 2. inter all_reduce of block j among the
    # ranks with local index j (all L local ranks drive their own block at once);
    # 3. intra all_gather of the blocks back into the slice.
    def _slice_rs(self, seg: np.ndarray, part: np.ndarray, code: int, sop: int,
                  dl: float) -> None:
        self._phase(self.intra, "reduce_scatter", _C.reduce_scatter, part, seg, code, sop,
                    _left(dl))

    def _slice_ag(self, seg: np.ndarray, part: np.ndarray, code: int, op: int, P: int,
                  dl: float) -> None:
        if op == _AVG:
            _core.scale_kernel(part, code, 1.0 / P)
        self._phase(self.intra, "all_gather", _C.all_gather, seg, part, code, _left(dl))

    def _pipelined(self, main: np.ndarray, slices: List[Tuple[int, int]], L: int, code: int,
                   op: int, sop: int, P: int, dl: float) -> None:
        """The slices' phases overlapped: slice s's inter all_reduce runs on the inter
        group's executor while this thread runs slice s+1's reduce_scatter and slice
        s's all_gather waits for it; s+1's inter op is queued before s is waited for,
        so the host link goes from one slice to the next without a gap.
        Every element still takes the same three phases: the same sums on every rank."""
        parts = [np.empty(hi - lo, dtype=main.dtype) for lo, hi in slices]
        segs = [main[lo * L: hi * L] for lo, hi in slices]

        def submit(s: int) -> Any:
            return self._async_inter("all_reduce", _C.all_reduce, parts[s], code, sop,
                                     _left(dl))

        self._pipeline("all_reduce", len(slices),
                       lambda s: self._slice_rs(segs[s], parts[s], code, sop, dl), submit,
                       lambda s: self._slice_ag(segs[s], parts[s], code, op, P, dl))

    def _pipeline(self, op: str, k: int, pre: Any, submit: Any, post: Any) -> None:
        """k slices through three stages: ``pre(s)`` in this thread, ``submit(s)`` an
        inter-host op on the inter group's executor (its work returned), ``post(s)`` in
        this thread once that op is done.  Slice s+1's inter op is queued before slice
        s's is waited for, so the link never waits for this thread's intra-host work.
        On an error the queued inter ops still end (their deadline bounds it) before
        the first error propagates: they use the slices' buffers."""
        pending: List[Any] = []
        try:
            pre(0)
            pending.append(submit(0))
            for s in range(k):
                if s + 1 < k:
                    pre(s + 1)
                    pending.append(submit(s + 1))
                w = pending.pop(0)
                self._named(self.inter, op, w.wait)
                post(s)
        except BaseException:
            for w in pending:
                try:
                    w.wait()
                except Exception:  # noqa: BLE001 - the first error is the one raised
                    pass
            raise

    def _leader_all_reduce(self, flat: np.ndarray, code: int, op: int, sop: int, P: int,
                           dl: float) -> None:
        # Hosts of different sizes: reduce to each host's local rank 0, all_reduce
        # among those leaders, broadcast back inside each host.
        self._phase(self.intra, "reduce", _C.reduce, flat, code, sop, 0, _left(dl))
        if self.topo.local_rank == 0:
            self._phase(self.inter, "all_reduce", _C.all_reduce, flat, code, sop, _left(dl))
            if op == _AVG:
                _core.scale_kernel(flat, code, 1.0 / P)
        self._phase(self.intra, "broadcast", _C.broadcast, flat, code, 0, _left(dl))

    def reduce_scatter(self, coll: Any, out: np.ndarray, inp: np.ndarray, code: int, op: int,
                       ms: int) -> None:
        dl = _deadline(ms)  # before the sub-groups: their set-up counts against it
        self._subs(_left(dl))
        P, H = self.group.size, self.topo.num_hosts
        b = out.size
        sop = _SUM if op == _AVG else op
        cuts = self._cuts(b, out.itemsize * P)
        if len(cuts) > 1:
            self._pipelined_rs(out.reshape(-1), inp.reshape(P, b), cuts, code, op, sop, dl)
            return
        src = inp.reshape(-1)
        if not self.perm_is_identity:
            # Blocks in (local index, host) order, so that local rank j's H blocks
            # (those of the ranks with local index j) are contiguous.
            src = src.reshape(P, b)[self.perm].reshape(-1)
        mid = np.empty(H * b, dtype=out.dtype)
        self._phase(self.intra, "reduce_scatter", _C.reduce_scatter, mid, src, code, sop,
                    _left(dl))
        o = out.reshape(-1)
        self._phase(self.inter, "reduce_scatter", _C.reduce_scatter, o, mid, code, sop,
                    _left(dl))
        if op == _AVG:
            _core.scale_kernel(o, code, 1.0 / P)

    def _cuts(self, b: int, row_bytes: int) -> List[Tuple[int, int]]:
        """Column ranges of ``b``-element blocks whose P rows (``row_bytes`` per column)
        make a slice of about ``_slice`` bytes; one range below two slices."""
        c = max(1, self._slice(b * row_bytes) // row_bytes)
        return [(lo, min(b, lo + c)) for lo in range(0, b, c)] if b >= 2 * c else [(0, b)]

    def _async_inter(self, op: str, fn: Any, *args: Any) -> Any:
        return self._named(self.inter, op, lambda: self.inter._call(op, True, fn, *args))

    def _pipelined_rs(self, o: np.ndarray, rows: np.ndarray, cuts: List[Tuple[int, int]],
                      code: int, op: int, sop: int, dl: float) -> None:
        """reduce_scatter by column slices of every rank's block: slice s's inter-host
        reduce_scatter runs on the inter group's executor while this thread copies slice
        s+1's columns (local-index-major) and reduce-scatters them inside the host."""
        H = self.topo.num_hosts
        pick = slice(None) if self.perm_is_identity else self.perm

        def intra(lo: int, hi: int) -> np.ndarray:
            mid = np.empty(H * (hi - lo), dtype=o.dtype)
            src = np.ascontiguousarray(rows[pick, lo:hi])
            self._phase(self.intra, "reduce_scatter", _C.reduce_scatter, mid,
                        src.reshape(-1), code, sop, _left(dl))
            return mid

        mids: List[Optional[np.ndarray]] = [None] * len(cuts)

        def pre(s: int) -> None:
            mids[s] = intra(*cuts[s])

        def submit(s: int) -> Any:
            lo, hi = cuts[s]
            return self._async_inter("reduce_scatter", _C.reduce_scatter, o[lo:hi], mids[s],
                                     code, sop, _left(dl))

        def post(s: int) -> None:
            mids[s] = None  # done with: keep two slices of scratch, not all of them

        self._pipeline("reduce_scatter", len(cuts), pre, submit, post)
        if op == _AVG:
            _core.scale_kernel(o, code, 1.0 / self.group.size)

    def _pipelined_ag(self, out: np.ndarray, inp: np.ndarray, cuts: List[Tuple[int, int]],
                      code: int, dl: float) -> None:
        """all_gather by column slices: slice s+1's inter-host all_gather runs on the inter
        group's executor while this thread gathers slice s inside the host and writes its
        columns of every rank's block (in place too: each slice reads only its own
        columns of ``inp``)."""
        P, H = self.group.size, self.topo.num_hosts
        rows = out.reshape(P, -1)
        dest = slice(None) if self.perm_is_identity else self.perm

        mids: List[Optional[np.ndarray]] = [None] * len(cuts)

        def submit(s: int) -> Any:
            lo, hi = cuts[s]
            mids[s] = np.empty(H * (hi - lo), dtype=out.dtype)
            return self._async_inter("all_gather", _C.all_gather, mids[s], inp[lo:hi], code,
                                     _left(dl))

        def post(s: int) -> None:
            lo, hi = cuts[s]
            big = np.empty(P * (hi - lo), dtype=out.dtype)
            self._phase(self.intra, "all_gather", _C.all_gather, big, mids[s], code, _left(dl))
            rows[dest, lo:hi] = big.reshape(P, hi - lo)
            mids[s] = None

        self._pipeline("all_gather", len(cuts), lambda s: None, submit, post)

    def all_gather(self, coll: Any, out: np.ndarray, inp: np.ndarray, code: int,
                   ms: int) -> None:
        dl = _deadline(ms)  # before the sub-groups: their set-up counts against it
        self._subs(_left(dl))
        P, H = self.group.size, self.topo.num_hosts
        b = inp.size
        cuts = self._cuts(b, out.itemsize * P)
        if len(cuts) > 1:
            i = inp.reshape(-1)
            o = out.reshape(-1)
            if _core.overlap(o, i) and _addr(i) != _addr(o) + self.group.rank * i.nbytes:
                # The slices write columns of every block while later slices still
                # read the input: an input inside the output other than as this
                # rank's block would be overwritten before it is sent.
                i = i.copy()
            self._pipelined_ag(o, i, cuts, code, dl)
            return
        mid = np.empty(H * b, dtype=out.dtype)
        # 1. inter all_gather: the blocks of the ranks with this local index
        # (the whole input is read here, before any block lands in the output).
        self._phase(self.inter, "all_gather", _C.all_gather, mid, inp.reshape(-1), code,
                    _left(dl))
        o = out.reshape(-1)
        if self.perm_is_identity:
            self._phase(self.intra, "all_gather", _C.all_gather, o, mid, code, _left(dl))
            return
        # 2. intra all_gather in (local index, host) order, then into rank order.
        big = np.empty(P * b, dtype=out.dtype)
        self._phase(self.intra, "all_gather", _C.all_gather, big, mid, code, _left(dl))
        o.reshape(P, b)[self.perm] = big.reshape(P, b)

    def _carrier(self, root: int) -> Tuple[int, int, int]:
        """(h0, j0, j): the root's host and local index, and the local index whose
        inter group carries a rooted op between hosts: j0 where every host has a
        rank of that index, else 0 (every host has a local rank 0)."""
        h0, j0 = self.topo.where(root)
        return h0, j0, (j0 if j0 < min(self.sizes) else 0)

    def broadcast(self, coll: Any, arr: np.ndarray, code: int, root: int, ms: int) -> None:
        dl = _deadline(ms)  # before the sub-groups: their set-up counts against it
        self._agree_root(coll, "broadcast", root, dl)  # 0. the roots agree (16 bytes, flat)
        self._subs(_left(dl))
        h0, j0, j = self._carrier(root)
        flat = arr.reshape(-1)
        home = self.topo.host == h0
        # 1. between hosts, among the ranks with local index j, from the root's host
        # (where j is not the root's own index, the root's host first broadcasts
        # inside itself, so that its local rank j holds the data);
        # 2. inside every other host (every host, when j is the root's), from j.
        if j != j0 and home:
            self._phase(self.intra, "broadcast", _C.broadcast, flat, code, j0, _left(dl))
        if self.topo.local_rank == j:
            self._phase(self.inter, "broadcast", _C.broadcast, flat, code, h0, _left(dl))
        if j == j0 or not home:
            self._phase(self.intra, "broadcast", _C.broadcast, flat, code, j, _left(dl))

    def reduce(self, coll: Any, arr: np.ndarray, code: int, op: int, root: int,
               ms: int) -> None:
        dl = _deadline(ms)  # before the sub-groups: their set-up counts against it
        self._agree_root(coll, "reduce", root, dl)  # 0. the roots agree (16 bytes, flat)
        self._subs(_left(dl))
        h0, j0, j = self._carrier(root)
        flat = arr.reshape(-1)
        sop = _SUM if op == _AVG else op
        me_root = self.group.rank == root
        collects = self.topo.local_rank == j
        # Only the root's buffer may change: the other collecting ranks (local
        # index j) reduce into a copy.
        acc = flat if (me_root or not collects) else flat.copy()
        # 1. inside every host, to local rank j; 2. among those, to the root's host.
        self._phase(self.intra, "reduce", _C.reduce, acc, code, sop, j, _left(dl))
        if collects:
            self._phase(self.inter, "reduce", _C.reduce, acc, code, sop, h0, _left(dl))
        if j != j0 and self.topo.host == h0:
            # 3. (a root whose local index some host lacks) local rank j hands the
            # result to the root: a broadcast inside its host, into scratch elsewhere.
            into = flat if me_root else (acc if collects else np.empty_like(flat))
            self._phase(self.intra, "broadcast", _C.broadcast, into, code, j, _left(dl))
        if me_root and op == _AVG:
            _core.scale_kernel(flat, code, 1.0 / self.group.size)


def _addr(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


_C = _core.Comm


def plan(group: Any, host_ids: Sequence[str], algo: str,
         params: cm.ModelParams) -> Tuple[Topology, Optional[_Hier]]:
    """The group's topology, and its hierarchical plan where one can help.

    None (flat always) for non-members, one host, ``RINGLET_ALGO=flat``, or,
    with ``auto``, one rank per host (then both forms move the same bytes).
    """
    topo = Topology(host_ids, group.rank)
    if group.rank < 0 or topo.num_hosts < 2 or algo == "flat":
        return topo, None
    if algo == "auto" and max(topo.ranks_per_host) == 1:
        return topo, None
    return topo, _Hier(group, topo, algo, params)
