"""Where the time of a small rooted op goes: a ``barrier(); t0; op; t1`` loop with timestamps.

For each rank: its median op time, when it left the barrier relative to rank 0
and when its op ended relative to rank 0's start (medians over iterations;
``time.perf_counter`` is CLOCK_MONOTONIC, shared by the processes of one
machine), plus the median over iterations of the slowest rank's time (what
``ringlet bench`` reports).  ringlet's ranks are local processes; under
``mpirun`` the same loop runs on Open MPI through mpi4py.

    PYTHONPATH=src python3 bench/barrier_skew.py broadcast -n 4
    RINGLET_SPIN_US=500 PYTHONPATH=src python3 bench/barrier_skew.py broadcast -n 4
    mpirun -n 2 --mca pml ob1 --mca btl tcp,self python3 bench/barrier_skew.py broadcast --mpi
"""

from __future__ import annotations

import argparse
import time

import numpy as np

OPS = ("broadcast", "gather", "scatter", "reduce", "all_reduce")


def _loop(rank: int, n: int, op: str, iters: int, barrier, run) -> tuple:
    a = np.zeros(2, np.float32)
    many = np.zeros(2 * n, np.float32)
    clock = time.perf_counter
    took, left = np.empty(iters), np.empty(iters)
    for i in range(iters):
        barrier()
        t0 = clock()
        run(op, a, many)
        took[i] = clock() - t0
        left[i] = t0
    skip = iters // 8  # warm-up
    return took[skip:] * 1e6, left[skip:]


def _ringlet_rank(rank: int, n: int, op: str, iters: int) -> tuple:
    import ringlet

    def run(op, a, many):
        if op == "broadcast":
            ringlet.broadcast(a, 0)
        elif op == "gather":
            ringlet.gather(many if rank == 0 else None, a, 0)
        elif op == "scatter":
            ringlet.scatter(a, many if rank == 0 else None, 0)
        elif op == "reduce":
            ringlet.reduce(a, 0)
        else:
            ringlet.all_reduce(a)

    return _loop(rank, n, op, iters, ringlet.barrier, run)


def report(name: str, results: list) -> str:
    took = np.array([r[0] for r in results])
    left = np.array([r[1] for r in results])
    ended = left + took / 1e6
    out = [f"{name}: median of the slowest rank {np.median(took.max(axis=0)):.1f} us"]
    out.append("  rank  op median (us)  left barrier vs rank 0 (us)  op end vs rank 0 start (us)")
    for r in range(len(results)):
        out.append(f"  {r:4d}  {np.median(took[r]):14.1f}  {np.median((left[r] - left[0]) * 1e6):27.1f}"
                   f"  {np.median((ended[r] - left[0]) * 1e6):27.1f}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("op", choices=OPS)
    p.add_argument("-n", "--nranks", type=int, default=2)
    p.add_argument("-i", "--iters", type=int, default=3000)
    p.add_argument("--mpi", action="store_true", help="run on Open MPI (under mpirun)")
    args = p.parse_args()
    if args.mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, n = comm.Get_rank(), comm.Get_size()

        def run(op, a, many):
            if op == "broadcast":
                comm.Bcast(a, 0)
            elif op == "gather":
                comm.Gather(a, many if rank == 0 else None, 0)
            elif op == "scatter":
                comm.Scatter(many if rank == 0 else None, a, 0)
            elif op == "reduce":
                comm.Reduce(MPI.IN_PLACE if rank == 0 else a, a if rank == 0 else None, root=0)
            else:
                comm.Allreduce(MPI.IN_PLACE, a)

        res = comm.gather(_loop(rank, n, args.op, args.iters, comm.Barrier, run), 0)
        if rank == 0:
            print(report(f"Open MPI {args.op}, {n} ranks", res))
        return 0
    from ringlet.testing import run_world

    res = run_world(_ringlet_rank, args.nranks, mode="process", timeout=600,
                    args=(args.op, args.iters))
    print(report(f"ringlet {args.op}, {args.nranks} ranks", res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
