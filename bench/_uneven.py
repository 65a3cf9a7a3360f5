"""The harness of the uneven-block benchmarks (all_gather_v.py, all_to_all_v.py,
rooted_v.py): their command line, the world they run in (ringlet, or Open MPI through
mpi4py with ``--mpi``), and the interleaved rounds and the table they print.  With
``--busy K`` rank 0 runs K busy-looping processes through the timed rounds (``ringlet
bench --busy``'s loops), so one command measures a busy host."""

import argparse
import contextlib
import time
from statistics import median
from typing import Callable, Dict, List

import numpy as np

SIZES = "64,1024,16384,131072,1048576,4194304,16777216"


def parse(doc: str, mpi_help: str, sizes_help: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--mpi", action="store_true", help=mpi_help)
    p.add_argument("--sizes", default=SIZES, help=sizes_help + ", comma-separated")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--busy", type=int, default=0, metavar="K",
                   help="busy-looping processes beside the timed rounds (started by rank 0)")
    p.add_argument("--per-barrier", action="store_true",
                   help="one op per barrier (each timed from the barrier's return), not "
                        "--iters back to back")
    a = p.parse_args()
    if a.busy < 0:
        p.error(f"--busy must be >= 0, got {a.busy}")
    a.sizes = [int(x) for x in a.sizes.split(",")]
    return a


class World:
    """rank, size, barrier() and slowest(t) (the largest t over the ranks), and
    ``comm``, the MPI communicator under ``--mpi`` (else None)."""

    def __init__(self, mpi: bool) -> None:
        if mpi:
            from mpi4py import MPI

            self.comm = MPI.COMM_WORLD
            self.rank, self.size = self.comm.rank, self.comm.size
            self.barrier = self.comm.Barrier
            self.slowest = lambda t: self.comm.allreduce(t, op=MPI.MAX)
            return
        import ringlet

        ringlet.init()
        self.comm = None
        self.rank, self.size = ringlet.get_rank(), ringlet.get_world_size()
        self.barrier = ringlet.barrier

        def slowest(t: float) -> float:
            v = np.array([t])
            ringlet.all_reduce(v, op=ringlet.ReduceOp.MAX)
            return float(v[0])

        self.slowest = slowest


def run(a: argparse.Namespace, w: World, forms: Callable[[int], Dict[str, Callable[[], None]]],
        title: str, shown: Callable[[int], int]) -> None:
    """Per size, the forms ``forms(size)`` gives, interleaved: ``a.rounds`` rounds of
    ``a.iters`` ops back to back each (or each after a barrier, ``--per-barrier``), the
    slowest rank's mean time per op; rank 0 prints the medians, one row per size (its
    bytes as ``shown(size)``)."""
    results: Dict[tuple, List[float]] = {}
    busy = contextlib.nullcontext()
    if a.busy and w.rank == 0:
        from ringlet.bench.busy import busy_loops

        busy = busy_loops(a.busy)
    with busy:
        for nbytes in a.sizes:
            _size(a, w, forms(nbytes), nbytes, results)
    if w.rank == 0:
        names = list(dict.fromkeys(n for _, n in results))
        wd = max(12, *(len(n) + 2 for n in names))
        load = f", beside {a.busy} busy loops" if a.busy else ""
        how = "one per barrier" if a.per_barrier else "back to back"
        print(f"# {title}; median us per op over {a.rounds} rounds of {a.iters} {how}{load}")
        print("#" + "".join(f"{h:>{wd}}" for h in ["bytes"] + names))
        for nbytes in a.sizes:
            print(" " + f"{shown(nbytes):>{wd}}" + "".join(
                f"{median(results[(nbytes, n)]) * 1e6:>{wd}.1f}" for n in names))


def _size(a: argparse.Namespace, w: World, fs: Dict[str, Callable[[], None]], nbytes: int,
          results: Dict[tuple, List[float]]) -> None:
    # A warm-up round first (connections, pages, and the scheduler's view of
    # the new processes: the first size measured otherwise pays for them).
    for fn in fs.values():
        for _ in range(a.iters):
            fn()
    for _ in range(a.rounds):
        for name, fn in fs.items():
            if a.per_barrier:
                spent = 0.0
                for _ in range(a.iters):
                    w.barrier()
                    t0 = time.perf_counter()
                    fn()
                    spent += time.perf_counter() - t0
            else:
                w.barrier()
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    fn()
                spent = time.perf_counter() - t0
            results.setdefault((nbytes, name), []).append(w.slowest(spent / a.iters))
