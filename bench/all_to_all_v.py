"""all_to_all_v on one host: ringlet (over shared memory, or TCP with
``RINGLET_TRANSPORT=tcp``) and, with ``--mpi``, Open MPI's Alltoallv.

Rank s sends rank d a block of 0.75 or 1.25 times ``size/P`` bytes of float32 (by the
parity of s + d: near-even counts, as a mixture-of-experts layer's token routing gives);
beside it, for reference, ringlet's equal-block all_to_all of blocks of the largest count.
Per size and round the forms run interleaved, ``--iters`` operations back to back each,
and the slowest rank's time per operation is kept; printed are the medians over
``--rounds`` (docs/algorithms.md, "all_to_all_v"):

    ringlet run -n 4 python3 bench/all_to_all_v.py
    RINGLET_TRANSPORT=tcp ringlet run -n 4 python3 bench/all_to_all_v.py
    mpirun -n 4 --oversubscribe --bind-to none --mca pml ob1 --mca btl sm,self \\
        python3 bench/all_to_all_v.py --mpi
"""

import argparse
import time
from statistics import median

import numpy as np


def counts_for(nbytes: int, P: int, s: int) -> list:
    """Elements rank s sends each rank, for an input of about ``nbytes``."""
    base = max(1, nbytes // 4 // P)
    return [max(1, int(base * (0.75 if (s + d) % 2 == 0 else 1.25))) for d in range(P)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mpi", action="store_true", help="Open MPI's Alltoallv through mpi4py")
    p.add_argument("--sizes", default="64,1024,16384,131072,1048576,4194304,16777216",
                   help="input bytes per rank, comma-separated")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    if a.mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, P = comm.rank, comm.size

        def forms(out, recv, inp, send):
            def displs(c):
                return np.concatenate([[0], np.cumsum(c)[:-1]]).tolist()
            return {"mpi": lambda: comm.Alltoallv([inp, send, displs(send), MPI.FLOAT],
                                                  [out, recv, displs(recv), MPI.FLOAT])}

        barrier = comm.Barrier

        def slowest(t):
            return comm.allreduce(t, op=MPI.MAX)
    else:
        import ringlet

        ringlet.init()
        rank, P = ringlet.get_rank(), ringlet.get_world_size()

        def forms(out, recv, inp, send):
            m = max(max(recv), max(send))
            big, mine = np.empty(P * m, np.float32), np.empty(P * m, np.float32)
            return {"all_to_all_v": lambda: ringlet.all_to_all_v(out, recv, inp, send),
                    "all_to_all": lambda: ringlet.all_to_all(big, mine)}

        barrier = ringlet.barrier

        def slowest(t):
            v = np.array([t])
            ringlet.all_reduce(v, op=ringlet.ReduceOp.MAX)
            return float(v[0])
    results = {}
    for nbytes in sizes:
        send = counts_for(nbytes, P, rank)
        recv = [counts_for(nbytes, P, q)[rank] for q in range(P)]
        out = np.empty(sum(recv), np.float32)
        inp = np.full(sum(send), rank, np.float32)
        fs = forms(out, recv, inp, send)
        for name, fn in fs.items():
            fn()  # warm-up: connections, pages
        for _ in range(a.rounds):
            for name, fn in fs.items():
                barrier()
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    fn()
                t = slowest((time.perf_counter() - t0) / a.iters)
                results.setdefault((nbytes, name), []).append(t)
    if rank == 0:
        names = list(dict.fromkeys(n for _, n in results))
        print(f"# all_to_all_v, {P} ranks, near-even float32 blocks; median us per op "
              f"over {a.rounds} rounds of {a.iters} back to back")
        print("#" + "".join(f"{h:>12}" for h in ["bytes"] + names))
        for nbytes in sizes:
            print(" " + f"{sum(counts_for(nbytes, P, rank)) * 4:>12}" + "".join(
                f"{median(results[(nbytes, n)]) * 1e6:>12.1f}" for n in names))


if __name__ == "__main__":
    main()
