"""all_gather_v on one host: ringlet (over shared memory, or TCP with
``RINGLET_TRANSPORT=tcp``) and, with ``--mpi``, Open MPI's Allgatherv.

Each rank contributes a block of 0.75 or 1.25 times ``size/P`` bytes of float32 (near-even
counts, as a variable-length batch gives); beside it, for reference, ringlet's equal-block
all_gather of blocks of the largest count.  Per size and round the forms run interleaved,
``--iters`` operations back to back each, and the slowest rank's time per operation is
kept; printed are the medians over ``--rounds`` (docs/algorithms.md, "all_gather_v"):

    ringlet run -n 4 python3 bench/all_gather_v.py
    RINGLET_TRANSPORT=tcp ringlet run -n 4 python3 bench/all_gather_v.py
    mpirun -n 4 --oversubscribe --bind-to none --mca pml ob1 --mca btl sm,self \\
        python3 bench/all_gather_v.py --mpi
"""

import numpy as np

from _uneven import World, parse, run


def counts_for(nbytes: int, P: int) -> list:
    base = max(1, nbytes // 4 // P)
    return [max(1, int(base * (0.75 if r % 2 == 0 else 1.25))) for r in range(P)]


def main() -> None:
    a = parse(__doc__, "Open MPI's Allgatherv through mpi4py", "total output bytes")
    w = World(a.mpi)
    rank, P = w.rank, w.size

    def forms(nbytes):
        cnt = counts_for(nbytes, P)
        out = np.empty(sum(cnt), np.float32)
        inp = np.full(cnt[rank], rank, np.float32)
        if a.mpi:
            from mpi4py import MPI

            displs = np.concatenate([[0], np.cumsum(cnt)[:-1]]).tolist()
            return {"mpi": lambda: w.comm.Allgatherv(inp, [out, cnt, displs, MPI.FLOAT])}
        import ringlet

        m = max(cnt)
        big, mine = np.empty(P * m, np.float32), np.empty(m, np.float32)
        return {"all_gather_v": lambda: ringlet.all_gather_v(out, cnt, inp),
                "all_gather": lambda: ringlet.all_gather(big, mine)}

    run(a, w, forms, f"all_gather_v, {P} ranks, near-even float32 blocks",
        lambda nbytes: sum(counts_for(nbytes, P)) * 4)


if __name__ == "__main__":
    main()
