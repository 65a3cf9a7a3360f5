"""Back-to-back broadcasts from rank 0 with the ranks pinned to chosen cores.

Each rank times its own loop of N 8-byte broadcasts and the loop plus a
closing barrier; rank 0 prints both per rank, in microseconds per operation.
Run under ``ringlet run`` (docs/benchmarks.md, "Small messages, back to back"):

    ringlet run -n 4 bench/pinned_loop.py --cores 0,0,1,1 -n 20000
    perf sched record -o sched.data -- ringlet run -n 4 bench/pinned_loop.py --cores 0,0,1,1 -n 5000
    perf sched timehist -i sched.data -C 0 -w | grep python
    mpirun -n 4 --oversubscribe --bind-to none --mca pml ob1 --mca btl tcp,self \
        --mca btl_tcp_if_include lo python3 bench/pinned_loop.py --mpi --cores 0,0,1,1

``--cores`` lists one core per rank (default: no pinning); ``--mpi`` runs the
same loop with Open MPI through mpi4py instead, for comparison.
"""

import argparse
import os
import time

import numpy as np

import ringlet


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--ops", type=int, default=20000, help="broadcasts per rank")
    p.add_argument("--cores", default="", help="comma-separated core of each rank")
    p.add_argument("--mpi", action="store_true", help="Open MPI (mpi4py) instead of ringlet")
    args = p.parse_args()
    if args.mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        r, size = comm.Get_rank(), comm.Get_size()
        bcast, barrier = (lambda a: comm.Bcast(a, 0)), comm.Barrier
        allsum = lambda a: comm.Allreduce(MPI.IN_PLACE, a)  # noqa: E731
    else:
        ringlet.init()
        r, size = ringlet.get_rank(), ringlet.get_world_size()
        bcast, barrier, allsum = (lambda a: ringlet.broadcast(a, 0)), ringlet.barrier, \
            ringlet.all_reduce
    if args.cores:
        os.sched_setaffinity(0, {int(args.cores.split(",")[r])})
    x = np.ones(2, np.float32)
    barrier()
    t0 = time.perf_counter()
    for _ in range(args.ops):
        bcast(x)
    t1 = time.perf_counter()
    barrier()
    t2 = time.perf_counter()
    per = np.zeros(2 * size)
    per[2 * r:2 * r + 2] = [(t1 - t0) / args.ops * 1e6, (t2 - t0) / args.ops * 1e6]
    allsum(per)
    if r == 0:
        print(f"{'mpi' if args.mpi else 'ringlet'}: rank  own loop (us/op)  with barrier (us/op)")
        for i in range(size):
            print(f"{i:4d}  {per[2 * i]:16.1f}  {per[2 * i + 1]:20.1f}")
    if not args.mpi:
        ringlet.shutdown()


if __name__ == "__main__":
    main()
