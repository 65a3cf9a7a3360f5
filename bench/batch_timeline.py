"""Where the time of a back-to-back batch goes, rank by rank.

``ringlet bench --batch B`` times B operations after each barrier on every rank
from that rank's own start and reports the slowest rank.  This script runs the
same loop (barrier, then B operations of 8 bytes rooted at rank 0: broadcasts
unless ``--op`` names scatter, gather or reduce) and keeps each rank's clock
after every operation, then prints per rank the median time per operation and
how long after the first rank it left the barrier, the median wall-clock span
of a batch (first rank out of the barrier to last rank done), the median from
the last rank into the barrier to the last rank done (barrier and batch end to
end, which no order of leaving the barrier can shorten on paper), and the
timeline of the median and the slowest batch (µs since the first rank left).
Run it under either launcher, 4 ranks on 2 cores (docs/experiments.md, "Where
a 4-rank batch of small broadcasts waits"):

    ringlet run -n 4 python3 bench/batch_timeline.py
    mpirun -n 4 --oversubscribe --bind-to none --mca pml ob1 --mca btl sm,self \
        python3 bench/batch_timeline.py --mpi
"""

import argparse
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mpi", action="store_true", help="Open MPI through mpi4py instead")
    p.add_argument("--batch", type=int, default=20, help="operations per barrier")
    p.add_argument("--batches", type=int, default=300, help="timed batches")
    p.add_argument("--bytes", type=int, default=8, help="message size (a multiple of 4)")
    p.add_argument("--op", default="broadcast", choices=("broadcast", "scatter", "gather",
                                                         "reduce"),
                   help="the operation, rooted at rank 0 (scatter, gather: --bytes per rank)")
    args = p.parse_args()
    a = np.zeros(max(1, args.bytes // 4), np.float32)
    if args.mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.rank, comm.size
        many = np.zeros(a.size * size, np.float32)
        out = np.zeros_like(a)
        fn = {"broadcast": lambda: comm.Bcast(a, root=0),
              "scatter": lambda: comm.Scatter(many if rank == 0 else None, out, root=0),
              "gather": lambda: comm.Gather(a, many if rank == 0 else None, root=0),
              "reduce": lambda: comm.Reduce(a, out if rank == 0 else None, root=0)}[args.op]

        barrier = comm.Barrier

        def gather(x: list) -> list:
            return comm.allgather(x)
    else:
        import ringlet

        ringlet.init()
        rank, size = ringlet.get_rank(), ringlet.get_world_size()
        many = np.zeros(a.size * size, np.float32)
        fn = {"broadcast": lambda: ringlet.broadcast(a, 0),
              "scatter": lambda: ringlet.scatter(a, many if rank == 0 else None, 0),
              "gather": lambda: ringlet.gather(many if rank == 0 else None, a, 0),
              "reduce": lambda: ringlet.reduce(a, 0)}[args.op]

        barrier = ringlet.barrier
        gather = ringlet.all_gather_object
    clock, b = time.perf_counter, args.batch
    stamps = np.empty((args.batches, b + 1))
    entry = np.empty(args.batches)
    for _ in range(100):
        fn()
    for i in range(args.batches):
        entry[i] = clock()
        barrier()
        row = stamps[i]
        row[0] = clock()
        for k in range(b):
            fn()
            row[k + 1] = clock()
    every = np.array(gather(stamps.tolist()))  # rank x batch x (b + 1)
    entries = np.array(gather(entry.tolist()))  # rank x batch
    if rank != 0:
        return
    own = every[:, :, -1] - every[:, :, 0]
    slowest = own.max(axis=0)
    offsets = every[:, :, 0] - every[:, :, 0].min(axis=0)
    span = every[:, :, -1].max(axis=0) - every[:, :, 0].min(axis=0)
    name = "Open MPI" if args.mpi else "ringlet"
    print(f"{name}, {size} ranks, {args.batches} batches of {b} {args.op} of {a.nbytes} B")
    print("per rank, median us per op:  ", np.round(np.median(own, axis=1) / b * 1e6, 2))
    print("per rank, median start (us): ", np.round(np.median(offsets, axis=1) * 1e6, 1))
    print(f"slowest rank, median us per op: {np.median(slowest) / b * 1e6:.2f}")
    print(f"median span, first out of the barrier to last done, us: {np.median(span) * 1e6:.1f}")
    whole = every[:, :, -1].max(axis=0) - entries.max(axis=0)
    print(f"median, last into the barrier to last done, us: {np.median(whole) * 1e6:.1f}")
    order = np.argsort(slowest)
    for label, i in (("median", order[len(order) // 2]), ("slowest", order[-1])):
        base = every[:, i, 0].min()
        print(f"{label} batch ({slowest[i] * 1e6:.1f} us): clock after each op, us")
        for r in range(size):
            print(f"  rank {r}: " + " ".join(f"{(x - base) * 1e6:5.0f}" for x in every[r, i]))


if __name__ == "__main__":
    main()
