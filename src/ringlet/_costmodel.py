"""The alpha-beta cost model that chooses between flat and hierarchical collectives.

A message of N bytes over one link costs ``alpha + N * beta``; reducing N
bytes costs ``N * gamma``; every collective phase (each flat collective an
algorithm runs, on two ranks or more) costs ``phase`` on top: the time its
ranks take to be running at once, which grows when ranks outnumber cores.
Links inside a host (``*_intra``) and between hosts (``*_inter``) have their
own alpha and beta; ``beta_inter`` is per
*host* link, so L ranks of one host sending between hosts at once share it.
Every formula is written out in docs/algorithms.md ("The cost model"); the
functions here are that table, in seconds, and nothing else: no measuring,
no communication.  The choice depends only on (op, bytes, layout, params),
values every rank of a group holds identically, so every rank decides alike.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence

__all__ = ["ModelParams", "ALGO_ENV", "MODEL_ENV", "ALGOS", "OPS", "algo_from_env",
           "params_from_env", "fit", "fit_phase", "predict", "flat_time", "hier_time",
           "hier_applies", "slices", "slice_bytes", "SLICE_BYTES", "SLICE_MIN_BYTES"]

ALGO_ENV = "RINGLET_ALGO"
# Bytes per slice of the pipelined hierarchical all_reduce, reduce_scatter and
# all_gather (``_hier``): N/64, kept within [SLICE_MIN_BYTES, SLICE_BYTES] unless the
# layout's latencies need more (``slice_bytes``).  Small enough that the first slice's
# intra-host phase and the last one's (which the link does not hide) stay short, large
# enough that a slice's own costs do not add up.
SLICE_BYTES = 1 << 20
SLICE_MIN_BYTES = 256 << 10
# The C library's small-message switch point (RINGLET_ALLREDUCE_SMALL_BYTES' default),
# below which (x16 for reduce_scatter) its flat reduce_scatter and all_gather over
# TCP take log2 p steps instead of the ring's p - 1.
SMALL_BYTES = 64 << 10
# Its broadcast over TCP of at most 4 ranks on several hosts: the root sends to every
# rank itself up to this (RINGLET_BCAST_FLAT_BYTES' default), else the binomial tree.
BCAST_FLAT_BYTES = 8 << 10
MODEL_ENV = "RINGLET_MODEL"
ALGOS = ("auto", "flat", "hier")
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")


@dataclass(frozen=True)
class ModelParams:
    """Link and reduction costs, in seconds and seconds per byte.

    The defaults describe loopback TCP inside a host and 1 Gbit/s Ethernet
    between hosts (0.117 GB/s, the plain-TCP rate such a link delivers).
    """

    alpha_intra: float = 10e-6
    beta_intra: float = 1 / 2.5e9
    alpha_inter: float = 30e-6
    beta_inter: float = 1 / 0.117e9
    gamma: float = 1 / 4e9
    phase: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and v >= 0):
                raise ValueError(f"cost model parameter {f.name} must be a finite number "
                                 f">= 0 (seconds or seconds per byte), got {v!r}")

    def as_dict(self) -> Dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "parameters") -> "ModelParams":
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: expected a JSON object of cost model parameters")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown cost model parameter(s) {unknown}; "
                             f"known: {sorted(known)}")
        return cls(**{k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                      for k, v in d.items()})


def algo_from_env(env: Optional[Mapping[str, str]] = None) -> str:
    """``RINGLET_ALGO`` checked: "auto" (unset or empty), "flat" or "hier".

    Raises:
        ValueError: any other value, naming the variable and the valid values.
    """
    e = os.environ if env is None else env
    raw = e.get(ALGO_ENV, "").strip().lower()
    if not raw:
        return "auto"
    if raw not in ALGOS:
        raise ValueError(f"{ALGO_ENV}={e.get(ALGO_ENV)!r} is not a valid algorithm choice; "
                         f"valid values: {', '.join(ALGOS)}")
    return raw


def params_from_env(env: Optional[Mapping[str, str]] = None) -> ModelParams:
    """The parameters in the JSON file ``RINGLET_MODEL`` names, else the defaults.

    The file holds a subset of ``ModelParams``' fields (what ``ringlet bench
    model --save`` writes); missing fields keep their defaults.
    """
    e = os.environ if env is None else env
    path = e.get(MODEL_ENV, "").strip()
    if not path:
        return ModelParams()
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{MODEL_ENV}={path!r}: cannot read cost model parameters: "
                         f"{exc}") from None
    if isinstance(doc, dict) and "params" in doc:
        doc = doc["params"]
    return ModelParams.from_dict(doc, f"{MODEL_ENV}={path!r}")


def fit(intra: Optional[Mapping[str, Any]] = None,
        inter: Optional[Mapping[str, Any]] = None,
        base: Optional[ModelParams] = None) -> ModelParams:
    """Parameters from ``ringlet bench limits`` figures (its ``limits`` JSON object).

    alpha is half the 8-byte blocking round trip of one pair; beta the inverse
    of the per-direction rate of two processes sending both ways at once (the
    pattern of a ring step); gamma the inverse of the in-cache float32 add
    rate of the C kernel.  ``intra`` is measured inside a host, ``inter``
    between two hosts; a part not given keeps ``base``'s (default) values.
    ``phase`` is not in those figures: it keeps ``base``'s (see ``fit_phase``).
    """
    p = (base or ModelParams()).as_dict()

    def take(lim: Mapping[str, Any], level: str) -> None:
        rtt = (lim.get("rtt_us") or {}).get("blocking_1pair")
        rate = lim.get("tcp_both_ways") or lim.get("tcp_one_way")
        if rtt:
            p[f"alpha_{level}"] = float(rtt) / 2 * 1e-6
        if rate:
            p[f"beta_{level}"] = 1 / (float(rate) * 1e9)

    if intra:
        take(intra, "intra")
        add = (intra.get("add_f32_ringlet") or {}).get("256KiB")
        if add:
            p["gamma"] = 1 / (float(add) * 1e9)
    if inter:
        take(inter, "inter")
    return ModelParams(**p)


def fit_phase(measured_s: float, sizes: Sequence[int], m: ModelParams,
              nbytes: float = 8, crossing: int = 1,
              hier_s: Optional[float] = None) -> ModelParams:
    """``m`` with ``phase`` set so that the flat all_reduce of ``nbytes`` (one phase) on
    hosts of ``sizes`` ranks takes ``measured_s`` seconds, as measured there: the cost
    of a phase beyond its messages, fitted where it is paid (0 when the messages
    already explain the time).

    With ``hier_s``, the hierarchical all_reduce of the same bytes measured on the
    same layout, the phase is fitted to the difference between the two forms
    instead: what the hierarchical form's further phases cost beyond their
    messages.  That is what the choice weighs, and an error both forms share (an
    alpha measured while the link was busier) cancels.  Layouts where both forms
    have as many phases (one rank per host) keep the flat fit."""
    zero = replace(m, phase=0.0)
    base = flat_time("all_reduce", nbytes, sizes, zero, crossing)
    if hier_s is not None:
        ones = ModelParams(0.0, 0.0, 0.0, 0.0, 0.0, 1.0)
        more = (hier_time("all_reduce", nbytes, sizes, ones)
                - flat_time("all_reduce", nbytes, sizes, ones, crossing))
        if more > 0:
            gap = float(hier_s) - float(measured_s)
            wire = hier_time("all_reduce", nbytes, sizes, zero) - base
            return replace(m, phase=max(0.0, (gap - wire) / more))
    return replace(m, phase=max(0.0, float(measured_s) - base))


def _ph(p: int, m: ModelParams) -> float:
    """The phase cost of one flat collective over p ranks (none on one rank)."""
    return m.phase if p > 1 else 0.0


# ---- single-level building blocks (P ranks over links of cost a + n*b) -----------
def _log2(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def ring_all_reduce(p: int, n: float, a: float, b: float, g: float) -> float:
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g


def rd_all_reduce(p: int, n: float, a: float, b: float, g: float) -> float:
    # Recursive doubling over Q = 2^floor(log2 p) ranks; the p - Q extra ranks
    # fold in first and get the result back last (two more exchanges).
    if p <= 1:
        return 0.0
    q = 1 << (p.bit_length() - 1)
    steps = (q.bit_length() - 1) + (0 if q == p else 2)
    return steps * (a + n * b) + _log2(p) * n * g


def all_reduce_1(p: int, n: float, a: float, b: float, g: float) -> float:
    return min(ring_all_reduce(p, n, a, b, g), rd_all_reduce(p, n, a, b, g))


def reduce_scatter_flat(p: int, n: float, a: float, b: float, g: float, local: int = 1,
                        bi: Optional[float] = None) -> float:
    """A flat reduce_scatter over TCP as the C library runs it: halving recursively
    in log2 p steps for a power of two p >= 4 up to 16 x SMALL_BYTES of input, else
    the ring.  ``local``: ranks per host, consecutive; a halving step whose partner is
    nearer than that stays inside the host (``bi`` per byte), the others cross with
    all ``local`` ranks of a host sending over its link at once (``local * b``)."""
    if p >= 4 and p & (p - 1) == 0 and n <= 16 * SMALL_BYTES:
        wire = 0.0
        for k in range(1, _log2(p) + 1):  # partner at p >> k, n >> k bytes each way
            cross = (p >> k) >= local
            wire += n / (1 << k) * (local * b if cross or bi is None else bi)
        return _log2(p) * a + wire + (p - 1) / p * n * g
    return reduce_scatter_1(p, n, a, b, g)


def all_gather_flat(p: int, n: float, a: float, b: float, local: int = 1,
                    bi: Optional[float] = None) -> float:
    """A flat all_gather over TCP as the C library runs it: Bruck's algorithm in
    ceil(log2 p) steps from 3 ranks up to SMALL_BYTES of output, else the ring.
    ``local`` and ``bi`` as for ``reduce_scatter_flat``: step k's partner is 2^k
    ranks away."""
    if p > 2 and n <= SMALL_BYTES:
        wire = 0.0
        for k in range(_log2(p)):  # min(2^k, p - 2^k) blocks of n/p
            d = 1 << k
            cross = d >= local
            wire += min(d, p - d) * n / p * (local * b if cross or bi is None else bi)
        return _log2(p) * a + wire
    return all_gather_1(p, n, a, b)


def reduce_scatter_1(p: int, n: float, a: float, b: float, g: float) -> float:
    """Ring reduce_scatter of an n-byte input (n/p bytes out)."""
    if p <= 1:
        return 0.0
    return (p - 1) * a + (p - 1) / p * n * (b + g)


def all_gather_1(p: int, n: float, a: float, b: float) -> float:
    """Ring all_gather into an n-byte output."""
    if p <= 1:
        return 0.0
    return (p - 1) * a + (p - 1) / p * n * b


def broadcast_1(p: int, n: float, a: float, b: float) -> float:
    """The better of a pipelined chain and a binomial tree."""
    if p <= 1:
        return 0.0
    return min((p - 1) * a + n * b, _log2(p) * (a + n * b))


def _binomial_kids(v: int, n: int) -> list:
    """Children of index v in a binomial tree of n indices rooted at 0 (bcast.c)."""
    low = 1
    while low < n and not v & low:
        low <<= 1
    kids, mask = [], low >> 1
    while mask:
        if v + mask < n:
            kids.append(v + mask)
        mask >>= 1
    return kids


def _bcast_kids(hosts: Sequence[int], n: float) -> list:
    """Each rank's children in the TCP broadcast from rank 0 of ranks on ``hosts``, as
    bcast.c builds the tree: up to 4 ranks the root sends to every rank itself (on
    several hosts only up to BCAST_FLAT_BYTES); across hosts the root sends to one
    rank per host (every one itself up to 4 hosts and BCAST_FLAT_BYTES, else a binomial
    tree over the hosts) and that rank to the rest of its host (every one itself up to
    4 ranks, else a binomial tree); on one host a binomial tree."""
    p = len(hosts)
    kids: List[List[int]] = [[] for _ in range(p)]
    order = list(dict.fromkeys(hosts))  # hosts by their lowest rank; rank 0's first
    if p <= 4 and (n <= BCAST_FLAT_BYTES or len(order) == 1):
        kids[0] = list(range(1, p))
        return kids
    if len(order) == 1:
        for v in range(p):
            kids[v] = _binomial_kids(v, p)
        return kids
    members = {h: [r for r in range(p) if hosts[r] == h] for h in order}
    leaders = [members[h][0] for h in order]
    nh = len(order)
    for i, lead in enumerate(leaders):
        if nh <= 4 and n <= BCAST_FLAT_BYTES:
            kids[lead] += leaders[1:] if i == 0 else []
        else:
            kids[lead] += [leaders[j] for j in _binomial_kids(i, nh)]
    for h in order:
        m = members[h]
        if len(m) <= 4:
            kids[m[0]] += m[1:]
        else:
            for v in range(len(m)):
                kids[m[v]] += [m[j] for j in _binomial_kids(v, len(m))]
    return kids


def _top_down(kids: Sequence[Sequence[int]]) -> List[int]:
    """The ranks of the tree rooted at 0, every parent before its children."""
    order, i = [0], 0
    while i < len(order):
        order += kids[order[i]]
        i += 1
    return order


def _bcast_tree(hosts: Sequence[int], n: float, ai: float, bi: float, ae: float,
                be: float) -> float:
    """The tree broadcast the C library runs over TCP (``_bcast_kids``) from rank 0 of
    ranks on ``hosts`` (each rank's host index); a rank sends to all its children at
    once, so its sends share its link (its host's, for the children on other hosts)."""
    kids = _bcast_kids(hosts, n)
    t = [0.0] * len(hosts)
    for v in _top_down(kids):
        out = sum(hosts[c] != hosts[v] for c in kids[v])
        inside = len(kids[v]) - out
        for c in kids[v]:
            t[c] = t[v] + (ae + out * n * be if hosts[c] != hosts[v]
                           else ai + inside * n * bi)
    return max(t)


def _reduce_tree(hosts: Sequence[int], n: float, ai: float, bi: float, ae: float,
                 be: float, g: float) -> float:
    """The tree reduce the C library runs over TCP to rank 0 of ranks on several
    ``hosts``: the broadcast's tree backwards (reduce.c's hosts_reduce), a rank taking
    all its children at once (their sends sharing its link) and adding n bytes per
    child."""
    kids = _bcast_kids(hosts, n)
    done = [0.0] * len(hosts)
    for v in reversed(_top_down(kids)):  # children before their parent
        into = sum(hosts[c] != hosts[v] for c in kids[v])
        inside = len(kids[v]) - into
        arrive = [done[c] + (ae + into * n * be if hosts[c] != hosts[v]
                             else ai + inside * n * bi) for c in kids[v]]
        done[v] = max(arrive, default=0.0) + len(kids[v]) * n * g
    return done[0]


def reduce_tcp(p: int, n: float, a: float, b: float, g: float) -> float:
    """A reduce over TCP among p ranks on p hosts, as the C library runs it: the tree up
    to SMALL_BYTES (``reduce_small_bytes``' default), else the pipelined chain."""
    if p <= 1:
        return 0.0
    if n <= SMALL_BYTES:
        return _reduce_tree(list(range(p)), n, a, b, a, b, g)
    return (p - 1) * a + n * (b + g)


def broadcast_tcp(p: int, n: float, a: float, b: float) -> float:
    """A broadcast over TCP among p ranks as the C library runs it: the tree up to
    SMALL_BYTES (``bcast_small_bytes``' default), else the pipelined chain."""
    if p <= 1:
        return 0.0
    if n <= SMALL_BYTES:
        return _bcast_tree(list(range(p)), n, a, b, a, b)
    return (p - 1) * a + n * b


def reduce_1(p: int, n: float, a: float, b: float, g: float) -> float:
    if p <= 1:
        return 0.0
    return min((p - 1) * a + n * (b + g), _log2(p) * (a + n * (b + g)))


# ---- the two algorithms over a layout of hosts --------------------------------------
def _layout(sizes: Sequence[int]) -> tuple:
    h = len(sizes)
    lmax = max(sizes) if sizes else 1
    return h, lmax, sum(sizes), all(s == lmax for s in sizes)


def slice_bytes(nbytes: float, sizes: Optional[Sequence[int]] = None,
                m: Optional[ModelParams] = None, largest: int = SLICE_BYTES,
                smallest: int = SLICE_MIN_BYTES, latency_share: float = 0.05) -> int:
    """The slice of a pipelined op of ``nbytes`` on hosts of ``sizes`` ranks: nbytes/64
    within [smallest, largest], and never so small that a slice's ring latencies
    (2(H-1) alpha_inter + 2(L-1) alpha_intra) exceed ``latency_share`` of the time
    its bytes take on the host link (many hosts or many ranks per host need larger
    slices; 0 turns that floor off)."""
    lo = min(smallest, largest)
    if sizes and m is not None and latency_share > 0 and len(sizes) > 1:
        h, lmax = len(sizes), max(sizes)
        lat = 2 * (h - 1) * m.alpha_inter + 2 * (lmax - 1) * m.alpha_intra
        per_byte = 2 * (h - 1) / h * m.beta_inter
        if per_byte > 0:
            lo = max(lo, int(lat / latency_share / per_byte))
    return int(min(max(largest, lo), max(lo, nbytes // 64)))


def slices(nbytes: float, sizes: Optional[Sequence[int]] = None,
           m: Optional[ModelParams] = None) -> int:
    """Slices of a pipelined hierarchical all_reduce, reduce_scatter (``nbytes`` of input)
    or all_gather (of output), as ``_hier`` cuts them: ``slice_bytes`` each, one
    slice below two of them."""
    s = slice_bytes(nbytes, sizes, m)
    return max(1, math.ceil(nbytes / s)) if nbytes >= 2 * s else 1


def hier_applies(op: str, sizes: Sequence[int], root_local: int = 0) -> bool:
    """Whether the hierarchical form of ``op`` runs on hosts of ``sizes`` ranks.

    all_reduce always (uneven hosts: the leader form); reduce_scatter and
    all_gather need equal hosts; broadcast and reduce need the root's local
    index on every host.  Needs two hosts or more.
    """
    h, _lmax, _p, even = _layout(sizes)
    if h < 2:
        return False
    if op in ("reduce_scatter", "all_gather"):
        return even
    if op in ("broadcast", "reduce"):
        return root_local < min(sizes)
    return op == "all_reduce"


def flat_time(op: str, nbytes: float, sizes: Sequence[int], m: ModelParams,
              crossing: int = 1) -> float:
    """Predicted seconds of the flat algorithm of ``op`` on hosts of ``sizes`` ranks.

    ``nbytes``: the whole vector (all_reduce/broadcast/reduce buffer,
    reduce_scatter input, all_gather output).  ``crossing``: the most ring
    edges leaving one host (1 when each host's ranks are consecutive).  Ring
    and chain steps wait for the slowest link, a host link shared by
    ``crossing`` edges; a tree or recursive doubling takes log2 L steps inside
    hosts and log2 H between them, where all L ranks of a host share its link.
    """
    h, lmax, p, _even = _layout(sizes)
    n = float(nbytes)
    if h <= 1:
        a, b = m.alpha_intra, m.beta_intra
        return _single(op, p, n, a, b, m.gamma) + _ph(p, m)
    return _flat_wire(op, n, sizes, m, crossing) + _ph(p, m)


def _flat_wire(op: str, n: float, sizes: Sequence[int], m: ModelParams,
               crossing: int) -> float:
    """The flat algorithm's messages and reductions over H >= 2 hosts (no phase cost)."""
    h, lmax, p, _even = _layout(sizes)
    ae, be = m.alpha_inter, m.beta_inter * max(1, crossing)
    g = m.gamma
    li, hi = _log2(lmax), _log2(h)
    tree_step_in = m.alpha_intra + n * m.beta_intra
    tree_step_out = m.alpha_inter + n * m.beta_inter * lmax
    if op == "all_reduce":
        ring = ring_all_reduce(p, n, ae, be, g)
        rd = li * tree_step_in + hi * tree_step_out + _log2(p) * n * g
        return min(ring, rd)
    if op == "reduce_scatter":
        if p >= 4 and p & (p - 1) == 0 and n <= 16 * SMALL_BYTES:
            return reduce_scatter_flat(p, n, ae, m.beta_inter, g, lmax, m.beta_intra)
        return reduce_scatter_flat(p, n, ae, be, g)
    if op == "all_gather":
        if p > 2 and n <= SMALL_BYTES:
            return all_gather_flat(p, n, ae, m.beta_inter, lmax, m.beta_intra)
        return all_gather_flat(p, n, ae, be)
    if op == "broadcast":
        if n > SMALL_BYTES:
            return (p - 1) * ae + n * be
        hosts = [k for k, size in enumerate(sizes) for _ in range(size)]
        return _bcast_tree(hosts, n, m.alpha_intra, m.beta_intra, m.alpha_inter,
                           m.beta_inter)
    if op == "reduce":
        if n > SMALL_BYTES:
            return (p - 1) * ae + n * (be + g)
        hosts = [k for k, size in enumerate(sizes) for _ in range(size)]
        return _reduce_tree(hosts, n, m.alpha_intra, m.beta_intra, m.alpha_inter,
                            m.beta_inter, g)
    raise ValueError(f"unknown op {op!r}; the model knows {', '.join(OPS)}")


def _single(op: str, p: int, n: float, a: float, b: float, g: float) -> float:
    if op == "all_reduce":
        return all_reduce_1(p, n, a, b, g)
    if op == "reduce_scatter":
        return reduce_scatter_1(p, n, a, b, g)
    if op == "all_gather":
        return all_gather_1(p, n, a, b)
    if op == "broadcast":
        return broadcast_1(p, n, a, b)
    if op == "reduce":
        return reduce_1(p, n, a, b, g)
    raise ValueError(f"unknown op {op!r}; the model knows {', '.join(OPS)}")


def hier_time(op: str, nbytes: float, sizes: Sequence[int], m: ModelParams,
              tail: bool = False) -> float:
    """Predicted seconds of the hierarchical form of ``op`` (inf where it does not apply).

    Equal hosts of L ranks: the L inter-host phases run at once and share
    each host's link, so each sees ``L * beta_inter``.  ``tail``: all_reduce's
    count is not a multiple of L, and the remainder takes a small flat
    all_reduce of its own.
    """
    if not hier_applies(op, sizes):
        return math.inf
    h, lmax, p, even = _layout(sizes)
    n = float(nbytes)
    ai, bi, ae, be, g = m.alpha_intra, m.beta_intra, m.alpha_inter, m.beta_inter, m.gamma
    fi, fe = _ph(lmax, m), _ph(h, m)  # each phase inside a host / between hosts
    if op == "all_reduce":
        if not even:  # leader form: reduce to local 0, all_reduce among leaders, broadcast
            return (reduce_1(lmax, n, ai, bi, g) + all_reduce_1(h, n, ae, be, g)
                    + broadcast_1(lmax, n, ai, bi) + 2 * fi + fe)
        k = slices(n, sizes, m)
        m_ = n / k
        rs = reduce_scatter_1(lmax, m_, ai, bi, g) + fi
        ar = all_reduce_1(h, m_ / lmax, ae, lmax * be, g) + fe
        ag = all_gather_1(lmax, m_, ai, bi) + fi
        # Pipelined slices: after the first reduce_scatter, each step lasts as long
        # as the slower of the link (slice s) and the host (RS of s+1, AG of s-1).
        t = rs + (k - 1) * max(ar, rs + ag) + ar + ag
        if tail:
            t += flat_time("all_reduce", 0, sizes, m)
        return t
    k = slices(n, sizes, m)
    m_ = n / k
    # Pipelined like all_reduce: the link works on one slice while the host works on
    # the next (reduce_scatter) or the previous (all_gather).
    if op == "reduce_scatter":
        inner = reduce_scatter_1(lmax, m_, ai, bi, g) + fi
        outer = reduce_scatter_flat(h, m_ / lmax, ae, lmax * be, g) + fe
        return inner + (k - 1) * max(inner, outer) + outer
    if op == "all_gather":
        outer = all_gather_flat(h, m_ / lmax, ae, lmax * be) + fe
        inner = all_gather_1(lmax, m_, ai, bi) + fi
        return outer + (k - 1) * max(inner, outer) + inner
    # Rooted ops first compare the roots: one 16-byte flat all_reduce of the group.
    if op == "broadcast":
        return (broadcast_tcp(h, n, ae, be) + broadcast_1(lmax, n, ai, bi) + fe + fi
                + flat_time("all_reduce", 16, sizes, m))
    if op == "reduce":
        return (reduce_1(lmax, n, ai, bi, g) + reduce_tcp(h, n, ae, be, g) + fi + fe
                + flat_time("all_reduce", 16, sizes, m))
    raise ValueError(f"unknown op {op!r}; the model knows {', '.join(OPS)}")


def predict(op: str, nbytes: float, sizes: Sequence[int], m: ModelParams,
            crossing: int = 1) -> Dict[str, float]:
    """{"flat": seconds, "hier": seconds (inf where it does not apply)}."""
    return {"flat": flat_time(op, nbytes, sizes, m, crossing),
            "hier": hier_time(op, nbytes, sizes, m)}
