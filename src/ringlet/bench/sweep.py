"""The measurement loop shared by ringlet and its comparison peers.

Every compared system (ringlet, Open MPI through mpi4py, torch.distributed's
gloo) runs *this* loop through a small ``Backend`` adapter, so buffers, data,
timing method, iteration counts and result checking are identical and only
the library under test differs.  The module needs numpy and the standard
library only: the peer drivers import it without initialising ringlet.

Timing method (per size):
  1. Allocate ``inflight`` sets of buffers and write every page once (a page
     that was never written is the kernel's shared zero page, which reads
     faster than real memory and would flatter the first iterations).
  2. With ``check``: run one iteration on buffers filled with a
     rank-dependent pattern and count the elements that differ from a numpy
     oracle (summed over ranks: the ``#wrong`` column).
  3. One warm-up iteration estimates the cost; the slowest rank's estimate
     (an all-reduce MAX, so every rank derives the same counts) caps warm-up
     and timed iterations to the time budget, never below ``MIN_ITERS``.
  4. Each timed iteration is ``barrier(); t0; op x inflight; wait; t1``.
     The per-iteration time is the maximum over ranks (an element-wise MAX
     all-reduce of every rank's list after the loop), divided by
     ``inflight``.  Reported: median, 10th and 90th percentile.  For
     ``sendrecv`` (ping-pong between ranks 0 and 1) the time is half the
     round trip.  The row also keeps the median of the ranks' mean time
     (``time_rank_mean_us``): what nccl-tests reports by default, where a
     rank that left the barrier late counts for its share only.
  5. With ``in_place``, all_gather's input is the rank's own block of the
     output (nccl-tests' in-place column; what FSDP and ZeRO call): nothing
     to copy locally.  all_reduce, broadcast and reduce have one buffer and
     are in place either way; the ops in ``NOT_IN_PLACE`` are not measured.
  6. Before its first size a driver *settles*: every rank runs barriers for
     ``SETTLE_S`` seconds.  Just after a launch the scheduler is still placing
     the new processes on cores, and the first size measured otherwise paid
     for it on every system (4 ranks, 8 B all_reduce: first-round medians
     1.4-1.6x the later rounds' for ringlet and Open MPI alike).
  7. With ``batch`` > 1 a timed iteration runs ``batch`` such operations
     back to back after its one barrier and the time is divided by
     ``batch`` as well: nccl-tests' method (it times all iterations back to
     back), where consecutive operations may overlap, as in a training
     step.  ``batch`` = 1 measures each operation from a common start, which
     is the latency of one isolated call.  Under a time budget a size whose
     one operation is slow runs fewer operations per batch (at least one), so
     that ``MIN_ITERS`` batches fit the budget: a batch of 20 at 256 MiB would
     otherwise take seconds per sample, and there one barrier more or less is
     lost in the operation's own time.  The row's ``batch`` is the one used.
"""

from __future__ import annotations

import json
import math
import mmap
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["OPS", "NOT_IN_PLACE", "REDOPS", "DTYPES", "SweepConfig", "Backend", "Layout", "layout",
           "busbw_factor", "run_sweep", "parse_size", "size_range", "resolve_dtype",
           "emit", "ROW_PREFIX", "MIN_ITERS", "SETTLE_S", "settle", "ping_pong"]

OPS = ("all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather", "all_to_all",
       "gather", "scatter", "sendrecv", "barrier")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
# Ops without an in-place form in this benchmark (ringlet's reduce_scatter,
# for one, refuses an output that overlaps its input).
NOT_IN_PLACE = ("reduce_scatter", "all_to_all", "gather", "scatter", "sendrecv")
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
REDOPS = ("sum", "prod", "min", "max", "avg")
# Accepted -d names -> numpy dtype name (nccl-tests spellings included).
DTYPES = {
    "float32": "float32", "float": "float32", "f32": "float32",
    "float64": "float64", "double": "float64", "f64": "float64",
    "float16": "float16", "half": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "int8": "int8", "uint8": "uint8", "int32": "int32", "int": "int32",
    "int64": "int64", "int16": "int16", "uint16": "uint16", "uint32": "uint32",
    "uint64": "uint64",
}
MIN_ITERS = 3
SETTLE_S = 0.25
PAGE = mmap.PAGESIZE
_HUGE_MIN = 4 << 20  # numpy's own threshold for madvise(MADV_HUGEPAGE)
ROW_PREFIX = "@@ringlet-bench "  # lines a driver's rank 0 prints for the parent

_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10,
           "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
           "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: Any) -> int:
    """Parse a byte count such as ``8``, ``64K``, ``256M`` or ``1G`` (powers of 1024).

    Raises:
        ValueError: not a non-negative integer with an optional K/M/G suffix.

    Example::

        parse_size("64K")  # 65536
    """
    if isinstance(text, bool):
        raise ValueError(f"size must be a number of bytes, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    s = str(text).strip().upper()
    num = s.rstrip("KMGIB")
    suffix = s[len(num):]
    if suffix not in _SUFFIX or not num:
        raise ValueError(f"size {text!r} is not a byte count like 8, 64K, 256M or 1G")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"size {text!r} is not a byte count like 8, 64K, 256M or 1G") from None
    nbytes = value * _SUFFIX[suffix]
    if not math.isfinite(nbytes) or nbytes < 0 or nbytes != int(nbytes):
        raise ValueError(f"size {text!r} must be a whole, non-negative number of bytes")
    return int(nbytes)


MAX_SIZES = 1000  # rows of one sweep: far more than any plot or table needs


def size_range(minbytes: int, maxbytes: int, factor: float) -> List[int]:
    """Sizes from ``minbytes`` multiplying by ``factor``, ending at ``maxbytes`` exactly.

    Raises:
        ValueError: an empty or unbounded range.
    """
    if minbytes < 1:
        raise ValueError(f"minbytes must be >= 1, got {minbytes}")
    if maxbytes < minbytes:
        raise ValueError(f"maxbytes ({maxbytes}) is smaller than minbytes ({minbytes})")
    if minbytes == maxbytes:
        return [minbytes]
    if not factor > 1:
        raise ValueError(f"stepfactor must be > 1 when minbytes < maxbytes, got {factor}")
    if math.log(maxbytes / minbytes) / math.log(factor) > MAX_SIZES:
        raise ValueError(f"stepfactor {factor} gives more than {MAX_SIZES} sizes from "
                         f"{minbytes} to {maxbytes} bytes; use a larger one")
    out, s = [], float(minbytes)
    while s <= maxbytes * (1 + 1e-12):
        if not out or int(round(s)) != out[-1]:  # a factor near 1 rounds to a size twice
            out.append(int(round(s)))
        s *= factor
    if out[-1] < maxbytes:  # always end at maxbytes (8 B .. 256 MiB by 4 would stop at 128 MiB)
        out.append(maxbytes)
    return out


def resolve_dtype(name: str) -> np.dtype:
    """The numpy dtype of a ``-d`` name; bfloat16 needs ml_dtypes.

    Raises:
        ValueError: unknown name.  ImportError: bfloat16 without ml_dtypes.
    """
    key = str(name).lower()
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from "
                         f"{', '.join(sorted(set(DTYPES.values())))}")
    canon = DTYPES[key]
    if canon == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ImportError("dtype bfloat16 needs ml_dtypes: pip install ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(canon)


@dataclass
class SweepConfig:
    """One op's sweep, as the parent hands it to every driver (JSON-serialisable)."""

    op: str
    sizes: List[int]
    dtype: str = "float32"
    redop: str = "sum"
    root: int = 0
    iters: int = 20
    warmup: int = 5
    check: bool = False
    inflight: int = 1
    budget_s: float = 2.0
    batch: int = 1
    in_place: bool = False
    offset: int = 0

    def validate(self, nranks: Optional[int] = None) -> "SweepConfig":
        """Raise ValueError/TypeError naming the first bad field; return self."""
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; choose from {', '.join(OPS)} or all")
        if self.redop not in REDOPS:
            raise ValueError(f"unknown reduction {self.redop!r}; choose from {', '.join(REDOPS)}")
        dt = resolve_dtype(self.dtype)
        self.dtype = dt.name
        if self.redop == "avg" and dt.kind not in "fV" and dt.name != "bfloat16":
            raise ValueError(f"-o avg is defined for floating dtypes only, not {dt.name}")
        for name in ("iters", "warmup", "inflight", "batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if self.iters < 1:
            raise ValueError(f"iters must be >= 1, got {self.iters}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.inflight < 1:
            raise ValueError(f"--async must be >= 1, got {self.inflight}")
        if self.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {self.batch}")
        if self.in_place and self.op in NOT_IN_PLACE:
            raise ValueError(f"--in-place: {self.op} has no in-place form here (it changes "
                             "all_gather; all_reduce, broadcast and reduce are in place anyway)")
        if isinstance(self.offset, bool) or not isinstance(self.offset, int):
            raise TypeError(f"offset must be an int, got {type(self.offset).__name__}")
        if not 0 <= self.offset < PAGE or self.offset % dt.itemsize:
            raise ValueError(f"--offset must be a multiple of {dt.name}'s {dt.itemsize} bytes "
                             f"in [0, {PAGE}), got {self.offset}")
        if not self.budget_s >= 0:
            raise ValueError(f"budget must be >= 0 seconds, got {self.budget_s}")
        if not self.sizes:
            raise ValueError("no sizes to measure")
        if nranks is not None:
            if not 0 <= self.root < nranks:
                raise ValueError(f"root {self.root} is out of range for {nranks} ranks")
            if self.op == "sendrecv" and nranks < 2:
                raise ValueError("sendrecv (ping-pong between ranks 0 and 1) needs >= 2 ranks")
        return self

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


# ---- sizes and bus bandwidth ---------------------------------------------------
@dataclass
class Layout:
    """Buffer shapes for one row.  ``size`` is the nccl-tests size: bytes of the
    largest buffer a rank holds (the gathered output for all_gather and gather,
    the full input for reduce_scatter and scatter, the send buffer for
    all_to_all).  ``block`` is the per-rank block in elements."""

    size: int
    count: int
    block: int


def layout(op: str, nbytes: int, itemsize: int, nranks: int) -> Layout:
    """Round a requested size to whole elements (and whole per-rank blocks)."""
    if op == "barrier":
        return Layout(0, 0, 0)
    if op in ("all_reduce", "broadcast", "reduce", "sendrecv"):
        count = max(1, nbytes // itemsize)
        return Layout(count * itemsize, count, count)
    block = max(1, nbytes // (itemsize * nranks))
    return Layout(block * nranks * itemsize, block * nranks, block)


def busbw_factor(op: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor.

    It scales algbw (size / time) to the bytes the busiest link carries, so
    busbw compares across rank counts and against a link's speed.
    """
    n = nranks
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    return 0.0  # barrier moves no data


# ---- data and the numpy oracle --------------------------------------------------
def _pattern(rank: int, start: int, count: int, dtype: np.dtype, redop: str,
             nranks: int) -> np.ndarray:
    """Rank ``rank``'s check data for elements [start, start+count).

    Small integers, so every reduction of up to a few dozen ranks is exact in
    every dtype (float16 and int8 included) and the result does not depend on
    the order in which ranks are combined.  For prod at most one rank
    contributes a factor 2 to each element and the rest are +-1.
    """
    i = np.arange(start, start + count, dtype=np.int64)
    signed = dtype.kind != "u"
    if redop == "prod":
        v = np.where(i % nranks == rank, 2, 1)
        if signed:
            v = np.where((i + 3 * rank) % 7 == 0, -v, v)
    else:
        v = (i * 7 + rank * 13) % 9
        if signed:
            v = v - 4
    if dtype.kind in "fV":  # via float32: extension float types (bfloat16) cast from it
        return v.astype(np.float32).astype(dtype)
    return v.astype(dtype)


def _combine(acc: np.ndarray, x: np.ndarray, redop: str) -> np.ndarray:
    if redop in ("sum", "avg"):
        return acc + x
    if redop == "prod":
        return acc * x
    if redop == "min":
        return np.minimum(acc, x)
    return np.maximum(acc, x)


def _reduced(start: int, count: int, dtype: np.dtype, redop: str, nranks: int) -> np.ndarray:
    """The oracle: the reduction over all ranks of their patterns, in float64."""
    acc = _pattern(0, start, count, dtype, redop, nranks).astype(np.float64)
    for r in range(1, nranks):
        acc = _combine(acc, _pattern(r, start, count, dtype, redop, nranks).astype(np.float64),
                       redop)
    if redop == "avg":
        acc = acc / nranks
    return acc


def _wrong(got: np.ndarray, want: np.ndarray, redop: str, dtype: np.dtype) -> int:
    g = np.asarray(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    if redop == "avg":
        # One rounding of sum/n into the dtype (several for 16-bit chains).
        rtol = {2: 2e-2, 4: 1e-6, 8: 1e-12}.get(dtype.itemsize, 1e-6)
        ok = np.isclose(g, w, rtol=rtol, atol=0.0)
    else:
        ok = g == w
    return int(g.size - np.count_nonzero(ok))


def _empty(count: int, dtype: np.dtype, offset: int = 0) -> np.ndarray:
    """An array in a mapping of its own, whatever the sizes measured before.

    From numpy's allocator, where a buffer lands depends on what earlier
    sizes allocated and freed: after the 256 MiB sizes of one op, glibc
    serves the next op's 2 MiB buffers from its heap (it raises its mmap
    threshold after large frees), and 2-rank scatter, sendrecv and all_to_all
    of 2 MiB then measured 2-3x slower than in a fresh process, for one
    library and not another.  A fresh anonymous mapping per buffer removes
    that history from the comparison.

    The mapping is private and anonymous, as numpy's memory is; those of
    4 MiB and more ask for transparent huge pages, as numpy does
    for its own large arrays (``madvise(MADV_HUGEPAGE)`` where the kernel
    leaves THP to the program): a training job's buffers are numpy arrays,
    and with 4 KiB pages every socket copy of a large message pays TLB
    misses that such buffers do not.

    The data starts ``offset`` bytes past the mapping's first page: 16 is
    where numpy's large arrays start (glibc's malloc header), which some
    copy routines handle far worse than a page-aligned start.
    """
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return np.empty(count, dtype=dtype)
    # Private, like numpy's own memory: mmap's default for -1 is a shared
    # mapping, which the kernel backs with shmem (no huge pages, other paths).
    m = mmap.mmap(-1, nbytes + offset, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= _HUGE_MIN and hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP unavailable: small pages, as before
            pass
    return np.frombuffer(m, dtype=dtype, count=count, offset=offset)


def _filled(count: int, dtype: np.dtype, value: float, offset: int = 0) -> np.ndarray:
    # fill writes every page; untouched pages would fault during the timing.
    a = _empty(count, dtype, offset)
    a.fill(value)
    return a


def _placed(src: np.ndarray, offset: int = 0) -> np.ndarray:
    a = _empty(src.size, src.dtype, offset)
    a[...] = src
    return a


class Buffers:
    """The arrays one in-flight operation uses."""

    def __init__(self, buf: Optional[np.ndarray] = None, out: Optional[np.ndarray] = None,
                 inp: Optional[np.ndarray] = None) -> None:
        self.buf, self.out, self.inp = buf, out, inp


def make_buffers(cfg: SweepConfig, lay: Layout, rank: int, nranks: int, dtype: np.dtype,
                 *, check: bool) -> Buffers:
    """Buffers for one in-flight op.  ``check``: rank patterns; else steady values.

    Steady values keep timed iterations from drifting into overflow or
    subnormals (sum of zeros, product of ones, min/max/avg of a fixed pattern).
    """
    op, c, b = cfg.op, lay.count, lay.block
    redop, at = cfg.redop, cfg.offset

    def data(n: int) -> np.ndarray:
        if check or redop in ("min", "max", "avg"):
            return _placed(_pattern(rank, 0, n, dtype, redop, nranks), at)
        return _filled(n, dtype, 1 if redop == "prod" else 0, at)

    def zeros(n: int) -> np.ndarray:
        return _filled(n, dtype, 0, at)

    if op == "barrier":
        return Buffers()
    if op in ("all_reduce", "broadcast", "reduce"):
        return Buffers(buf=data(c))
    if op == "sendrecv":
        return Buffers(buf=data(c), out=zeros(c))
    if op == "all_gather":
        out = zeros(b * nranks)
        if cfg.in_place:  # the input is this rank's block of the output
            mine = out[rank * b:(rank + 1) * b]
            mine[...] = data(b)
            return Buffers(out=out, inp=mine)
        return Buffers(out=out, inp=data(b))
    if op == "reduce_scatter":
        return Buffers(out=zeros(b), inp=data(b * nranks))
    if op == "all_to_all":
        return Buffers(out=zeros(b * nranks), inp=data(b * nranks))
    if op == "gather":
        out = zeros(b * nranks) if rank == cfg.root else None
        return Buffers(out=out, inp=data(b))
    if op == "scatter":
        inp = data(b * nranks) if rank == cfg.root else None
        return Buffers(out=zeros(b), inp=inp)
    raise ValueError(f"unknown op {op!r}")


def count_wrong(cfg: SweepConfig, lay: Layout, bufs: Buffers, rank: int, nranks: int,
                dtype: np.dtype, *, reduce_keeps_input: bool = True) -> int:
    """Elements of this rank's result that differ from the numpy oracle."""
    op, c, b, redop, root = cfg.op, lay.count, lay.block, cfg.redop, cfg.root
    pat = lambda r, start, n: _pattern(r, start, n, dtype, redop, nranks)  # noqa: E731
    if op == "barrier":
        return 0
    if op == "all_reduce":
        return _wrong(bufs.buf, _reduced(0, c, dtype, redop, nranks), redop, dtype)
    if op == "broadcast":
        return _wrong(bufs.buf, pat(root, 0, c), redop, dtype)
    if op == "reduce":
        if rank == root:
            return _wrong(bufs.buf, _reduced(0, c, dtype, redop, nranks), redop, dtype)
        return _wrong(bufs.buf, pat(rank, 0, c), redop, dtype) if reduce_keeps_input else 0
    if op == "sendrecv":
        if rank == 0:  # the echo of rank 0's own data
            return _wrong(bufs.out, pat(0, 0, c), redop, dtype)
        if rank == 1:
            return _wrong(bufs.out, pat(0, 0, c), redop, dtype)
        return 0
    if op == "all_gather":
        want = np.concatenate([pat(r, 0, b) for r in range(nranks)])
        return _wrong(bufs.out, want, redop, dtype)
    if op == "reduce_scatter":
        return _wrong(bufs.out, _reduced(rank * b, b, dtype, redop, nranks), redop, dtype)
    if op == "all_to_all":
        want = np.concatenate([pat(s, rank * b, b) for s in range(nranks)])
        return _wrong(bufs.out, want, redop, dtype)
    if op == "gather":
        if rank != root:
            return 0
        want = np.concatenate([pat(r, 0, b) for r in range(nranks)])
        return _wrong(bufs.out, want, redop, dtype)
    if op == "scatter":
        return _wrong(bufs.out, pat(root, rank * b, b), redop, dtype)
    raise ValueError(f"unknown op {op!r}")


# ---- the backend adapter ---------------------------------------------------------
class Backend:
    """What a system under test provides to the loop.

    ``start(cfg, bufs, async_)`` runs one operation; with ``async_`` it
    returns a handle for ``wait`` (the op may still be running), else it
    returns after the op finished.  ``max_f64`` / ``sum_i64`` combine small
    arrays over ranks (every rank gets the result); they are used outside the
    timed region only.
    """

    name = "?"
    rank = 0
    size = 1
    # Does reduce leave non-root buffers unchanged?  ringlet and MPI promise
    # it; torch.distributed does not (gloo uses them as scratch).
    reduce_keeps_input = True

    def unsupported(self, cfg: SweepConfig) -> Optional[str]:
        """A reason this system cannot run ``cfg``, or None."""
        return None

    def barrier(self) -> None:
        raise NotImplementedError

    def start(self, cfg: SweepConfig, bufs: Buffers, async_: bool) -> Any:
        raise NotImplementedError

    def wait(self, handle: Any) -> None:
        raise NotImplementedError

    def max_f64(self, a: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def sum_i64(self, a: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def versions(self) -> Dict[str, str]:
        return {}


def ping_pong(rank: int, send: Callable[[Any, int], Any], recv: Callable[[Any, int], Any],
              b: Buffers) -> None:
    """One ``sendrecv`` iteration, the same exchange for every system: rank 0 sends
    ``b.buf`` to rank 1 and receives the echo into ``b.out``; other ranks idle."""
    if rank == 0:
        send(b.buf, 1)
        recv(b.out, 1)
    elif rank == 1:
        recv(b.out, 0)
        send(b.out, 0)


def _iteration(backend: Backend, cfg: SweepConfig, sets: Sequence[Buffers]) -> None:
    if len(sets) == 1:
        backend.start(cfg, sets[0], False)
        return
    handles = [backend.start(cfg, s, True) for s in sets]
    for h in handles:
        backend.wait(h)


def _timed(backend: Backend, cfg: SweepConfig, sets: Sequence[Buffers], n: int) -> np.ndarray:
    """``n`` samples, each one barrier and ``cfg.batch`` iterations (not yet divided)."""
    times = np.empty(n, dtype=np.float64)
    clock = time.perf_counter
    batch = range(cfg.batch)
    for i in range(n):
        backend.barrier()
        t0 = clock()
        for _ in batch:
            _iteration(backend, cfg, sets)
        times[i] = clock() - t0
    return times


def measure_size(backend: Backend, cfg: SweepConfig, nbytes: int) -> Dict[str, Any]:
    """Measure one size; every rank returns the same row."""
    n, rank = backend.size, backend.rank
    dtype = resolve_dtype(cfg.dtype)
    lay = layout(cfg.op, nbytes, dtype.itemsize, n)
    inflight = 1 if cfg.op == "sendrecv" else cfg.inflight
    wrong = 0
    if cfg.check:
        csets = [make_buffers(cfg, lay, rank, n, dtype, check=True) for _ in range(inflight)]
        backend.barrier()
        _iteration(backend, cfg, csets)
        wrong = sum(count_wrong(cfg, lay, s, rank, n, dtype,
                                reduce_keeps_input=backend.reduce_keeps_input) for s in csets)
        del csets
    sets = [make_buffers(cfg, lay, rank, n, dtype, check=False) for _ in range(inflight)]
    if cfg.batch > 1 and cfg.budget_s > 0:
        # One operation sizes the batch (the slowest rank's time, so every
        # rank derives the same count) before a whole batch is risked.
        one = float(backend.max_f64(_timed(backend, replace(cfg, batch=1), sets, 1))[0])
        if one > 0:
            cfg = replace(cfg, batch=max(1, min(cfg.batch,
                                                int(cfg.budget_s / (MIN_ITERS * one)))))
    # One warm-up iteration always runs: it connects, faults pages in, and
    # its slowest-rank time sizes the rest to the budget identically everywhere.
    est = float(backend.max_f64(_timed(backend, cfg, sets, 1))[0])
    iters, warm = cfg.iters, max(0, cfg.warmup - 1)
    if cfg.budget_s > 0 and est > 0:
        iters = max(MIN_ITERS, min(iters, int(cfg.budget_s / est)))
        warm = min(warm, int(0.25 * cfg.budget_s / est))
    if warm:
        _timed(backend, cfg, sets, warm)
    own = _timed(backend, cfg, sets, iters)
    per_op = inflight * cfg.batch * (2.0 if cfg.op == "sendrecv" else 1.0)  # one way: half
    times = backend.max_f64(own) / per_op
    ns = backend.sum_i64(np.rint(own * 1e9).astype(np.int64))
    rank_mean = ns.astype(np.float64) / (n * 1e9) / per_op
    wrong_total = int(backend.sum_i64(np.array([wrong], dtype=np.int64))[0])
    med, p10, p90 = (float(x) for x in np.percentile(times, [50, 10, 90]))
    algbw = lay.size / med / 1e9 if med > 0 else 0.0
    return {
        "system": backend.name, "op": cfg.op, "nranks": n, "size": lay.size,
        "count": lay.count, "type": dtype.name,
        "redop": cfg.redop if cfg.op in REDUCING else "-",
        "root": cfg.root if cfg.op in ROOTED else -1,
        "time_us": med * 1e6, "p10_us": p10 * 1e6, "p90_us": p90 * 1e6,
        "time_rank_mean_us": float(np.median(rank_mean)) * 1e6,
        "algbw": algbw, "busbw": algbw * busbw_factor(cfg.op, n),
        "wrong": wrong_total if cfg.check else -1, "iters": int(times.size),
        "inflight": inflight, "batch": cfg.batch, "in_place": cfg.in_place,
        "offset": cfg.offset,
    }


def settle(backend: Backend, seconds: float = SETTLE_S, chunk: int = 20) -> int:
    """Run barriers until ``seconds`` have passed on the slowest rank; returns how many.

    Ranks agree when to stop through ``max_f64`` after every ``chunk``
    barriers, so all of them run the same number.
    """
    clock = time.perf_counter
    t0, done = clock(), 0
    while True:
        for _ in range(chunk):
            backend.barrier()
        done += chunk
        if float(backend.max_f64(np.array([clock() - t0]))[0]) >= seconds:
            return done


def run_sweep(backend: Backend, cfg: SweepConfig,
              on_row: Optional[Callable[[Dict[str, Any]], None]] = None) -> List[Dict[str, Any]]:
    """Measure every size of ``cfg`` on ``backend``; rows in size order (all ranks).

    Raises:
        ValueError: ``cfg`` is invalid for this world.
    """
    cfg.validate(backend.size)
    sizes = [0] if cfg.op == "barrier" else cfg.sizes
    rows, seen = [], set()
    dtype = resolve_dtype(cfg.dtype)
    for nbytes in sizes:
        size = layout(cfg.op, nbytes, dtype.itemsize, backend.size).size
        if size in seen:  # rounding to whole blocks can repeat a size
            continue
        seen.add(size)
        row = measure_size(backend, cfg, nbytes)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


# ---- the driver side of the parent <-> driver protocol ----------------------------
def emit(kind: str, payload: Dict[str, Any]) -> None:
    """Print one record for the parent (rank 0 of a driver only)."""
    sys.stdout.write(ROW_PREFIX + json.dumps({"kind": kind, **payload}) + "\n")
    sys.stdout.flush()


def drive(backend: Backend, sweeps: Sequence[Dict[str, Any]]) -> int:
    """Run every sweep on ``backend``; rank 0 emits rows.  Returns an exit code.

    An unsupported op is reported as a ``skip`` record and the next one runs.
    """
    if backend.rank == 0:
        emit("hello", {"system": backend.name, "nranks": backend.size,
                       "versions": backend.versions()})
    settle(backend)
    for raw in sweeps:
        cfg = SweepConfig(**raw)
        reason = backend.unsupported(cfg)
        if reason:
            if backend.rank == 0:
                emit("skip", {"system": backend.name, "op": cfg.op, "reason": reason})
            continue
        run_sweep(backend, cfg,
                  on_row=(lambda row: emit("row", row)) if backend.rank == 0 else None)
    if backend.rank == 0:
        emit("done", {"system": backend.name})
    return 0


def driver_args(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """Parse a driver's command line: ``--config JSON`` (a list of sweeps)."""
    import argparse

    p = argparse.ArgumentParser(description="ringlet bench driver (started by `ringlet bench`)")
    p.add_argument("--config", required=True, help="JSON: {\"sweeps\": [SweepConfig, ...]}")
    a = p.parse_args(argv)
    cfg = json.loads(a.config)
    sweeps = cfg.get("sweeps")
    if not isinstance(sweeps, list):
        raise ValueError("--config must be a JSON object with a 'sweeps' list")
    return sweeps
