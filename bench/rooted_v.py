"""gather_v and scatter_v on one host: ringlet (over shared memory, or TCP with
``RINGLET_TRANSPORT=tcp``) and, with ``--mpi``, Open MPI's Gatherv and Scatterv.

Rank r's block is 0.75 or 1.25 times ``size/P`` bytes of float32 (by the parity of r:
near-even counts), root 0; beside them, for reference, ringlet's equal-block gather and
scatter of blocks of the largest count.  Per size and round the forms run interleaved,
``--iters`` operations back to back each, and the slowest rank's time per operation is
kept; printed are the medians over ``--rounds`` (docs/algorithms.md, "gather, scatter,
gather_v, scatter_v"):

    ringlet run -n 4 python3 bench/rooted_v.py
    RINGLET_TRANSPORT=tcp ringlet run -n 4 python3 bench/rooted_v.py
    mpirun -n 4 --oversubscribe --bind-to none --mca pml ob1 --mca btl sm,self \\
        python3 bench/rooted_v.py --mpi
"""

import argparse
import time
from statistics import median

import numpy as np


def counts_for(nbytes: int, P: int) -> list:
    """Elements of each rank's block, for a root buffer of about ``nbytes``."""
    base = max(1, nbytes // 4 // P)
    return [max(1, int(base * (0.75 if r % 2 == 0 else 1.25))) for r in range(P)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mpi", action="store_true", help="Open MPI's Gatherv / Scatterv")
    p.add_argument("--sizes", default="64,1024,16384,131072,1048576,4194304,16777216",
                   help="the root's buffer in bytes, comma-separated")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    if a.mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, P = comm.rank, comm.size

        def forms(many, cnt, one):
            displs = np.concatenate([[0], np.cumsum(cnt)[:-1]]).tolist()
            spec = [many, cnt, displs, MPI.FLOAT]
            return {"gatherv": lambda: comm.Gatherv(one, spec, root=0),
                    "scatterv": lambda: comm.Scatterv(spec, one, root=0)}

        barrier = comm.Barrier

        def slowest(t):
            return comm.allreduce(t, op=MPI.MAX)
    else:
        import ringlet

        ringlet.init()
        rank, P = ringlet.get_rank(), ringlet.get_world_size()

        def forms(many, cnt, one):
            m = max(cnt)
            big, mine = np.empty(P * m, np.float32), np.empty(m, np.float32)
            root = rank == 0
            return {"gather_v": lambda: ringlet.gather_v(many if root else None,
                                                         cnt if root else None, one),
                    "scatter_v": lambda: ringlet.scatter_v(one, many if root else None,
                                                           cnt if root else None),
                    "gather": lambda: ringlet.gather(big if root else None, mine),
                    "scatter": lambda: ringlet.scatter(mine, big if root else None)}

        barrier = ringlet.barrier

        def slowest(t):
            v = np.array([t])
            ringlet.all_reduce(v, op=ringlet.ReduceOp.MAX)
            return float(v[0])
    results = {}
    for nbytes in sizes:
        cnt = counts_for(nbytes, P)
        many = np.ones(sum(cnt), np.float32)
        one = np.full(cnt[rank], rank, np.float32)
        fs = forms(many, cnt, one)
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
        print(f"# gather_v / scatter_v, {P} ranks, root 0, near-even float32 blocks; median us "
              f"per op over {a.rounds} rounds of {a.iters} back to back")
        print("#" + "".join(f"{h:>12}" for h in ["bytes"] + names))
        for nbytes in sizes:
            print(" " + f"{sum(counts_for(nbytes, P)) * 4:>12}" + "".join(
                f"{median(results[(nbytes, n)]) * 1e6:>12.1f}" for n in names))


if __name__ == "__main__":
    main()
