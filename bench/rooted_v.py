"""gather_v and scatter_v on one host: ringlet (over shared memory, or TCP with
``RINGLET_TRANSPORT=tcp``) and, with ``--mpi``, Open MPI's Gatherv and Scatterv.

Rank r's block is 0.75 or 1.25 times ``size/P`` bytes of float32 (by the parity of r:
near-even counts), root 0; beside them, for reference, ringlet's equal-block gather and
scatter of blocks of the largest count.  Per size and round the forms run interleaved,
``--iters`` operations back to back each, and the slowest rank's time per operation is
kept; printed are the medians over ``--rounds`` (docs/algorithms.md, "gather, scatter,
gather_v, scatter_v"):

    ringlet run -n 4 python3 bench/rooted_v.py
    ringlet run -n 4 python3 bench/rooted_v.py --busy 2     # beside two busy loops
    ringlet run -n 4 python3 bench/rooted_v.py --per-barrier  # one op per barrier
    RINGLET_TRANSPORT=tcp ringlet run -n 4 python3 bench/rooted_v.py
    mpirun -n 4 --oversubscribe --bind-to none --mca pml ob1 --mca btl sm,self \\
        python3 bench/rooted_v.py --mpi
"""

import numpy as np

from _uneven import World, parse, run


def counts_for(nbytes: int, P: int) -> list:
    """Elements of each rank's block, for a root buffer of about ``nbytes``."""
    base = max(1, nbytes // 4 // P)
    return [max(1, int(base * (0.75 if r % 2 == 0 else 1.25))) for r in range(P)]


def main() -> None:
    a = parse(__doc__, "Open MPI's Gatherv / Scatterv", "the root's buffer in bytes")
    w = World(a.mpi)
    rank, P = w.rank, w.size
    root = rank == 0

    def forms(nbytes):
        cnt = counts_for(nbytes, P)
        many = np.ones(sum(cnt), np.float32)
        one = np.full(cnt[rank], rank, np.float32)
        if a.mpi:
            from mpi4py import MPI

            spec = [many, cnt, np.concatenate([[0], np.cumsum(cnt)[:-1]]).tolist(), MPI.FLOAT]
            return {"gatherv": lambda: w.comm.Gatherv(one, spec, root=0),
                    "scatterv": lambda: w.comm.Scatterv(spec, one, root=0)}
        import ringlet

        m = max(cnt)
        big, mine = np.empty(P * m, np.float32), np.empty(m, np.float32)
        return {"gather_v": lambda: ringlet.gather_v(many if root else None,
                                                     cnt if root else None, one),
                "scatter_v": lambda: ringlet.scatter_v(one, many if root else None,
                                                       cnt if root else None),
                "gather": lambda: ringlet.gather(big if root else None, mine),
                "scatter": lambda: ringlet.scatter(mine, big if root else None)}

    run(a, w, forms, f"gather_v / scatter_v, {P} ranks, root 0, near-even float32 blocks",
        lambda nbytes: sum(counts_for(nbytes, P)) * 4)


if __name__ == "__main__":
    main()
