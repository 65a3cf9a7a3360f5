"""Back-to-back broadcasts from rank 0 with the ranks pinned to chosen cores.

Each rank times its own loop of N 8-byte broadcasts and the loop plus a
closing barrier, and counts the loop's CPU time and context switches; rank 0
prints all of them per rank, per operation.
Run under ``ringlet run`` (docs/experiments.md, "Small messages, back to back"):

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
import resource
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
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for _ in range(args.ops):
        bcast(x)
    t1 = time.perf_counter()
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    barrier()
    t2 = time.perf_counter()
    # Per rank: loop time, loop + barrier, CPU time (user + system) and the
    # voluntary / involuntary context switches of the loop, all per op.
    ncol = 5
    per = np.zeros(ncol * size)
    cpu = (u1.ru_utime + u1.ru_stime) - (u0.ru_utime + u0.ru_stime)
    per[ncol * r:ncol * r + ncol] = [
        (t1 - t0) * 1e6, (t2 - t0) * 1e6, cpu * 1e6,
        u1.ru_nvcsw - u0.ru_nvcsw, u1.ru_nivcsw - u0.ru_nivcsw]
    per /= args.ops
    allsum(per)
    if r == 0:
        print(f"{'mpi' if args.mpi else 'ringlet'}: rank  loop (us/op)  with barrier (us/op)"
              "  cpu (us/op)  vol. switches/op  invol. switches/op")
        for i in range(size):
            v = per[ncol * i:ncol * i + ncol]
            print(f"{i:4d}  {v[0]:12.1f}  {v[1]:20.1f}  {v[2]:11.1f}  {v[3]:16.2f}  {v[4]:18.2f}")
    if not args.mpi:
        ringlet.shutdown()


if __name__ == "__main__":
    main()
