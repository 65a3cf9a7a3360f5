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

import numpy as np

from _uneven import World, parse, run


def counts_for(nbytes: int, P: int, s: int) -> list:
    """Elements rank s sends each rank, for an input of about ``nbytes``."""
    base = max(1, nbytes // 4 // P)
    return [max(1, int(base * (0.75 if (s + d) % 2 == 0 else 1.25))) for d in range(P)]


def main() -> None:
    a = parse(__doc__, "Open MPI's Alltoallv through mpi4py", "input bytes per rank")
    w = World(a.mpi)
    rank, P = w.rank, w.size

    def forms(nbytes):
        send = counts_for(nbytes, P, rank)
        recv = [counts_for(nbytes, P, q)[rank] for q in range(P)]
        out = np.empty(sum(recv), np.float32)
        inp = np.full(sum(send), rank, np.float32)
        if a.mpi:
            from mpi4py import MPI

            def spec(buf, c):
                return [buf, c, np.concatenate([[0], np.cumsum(c)[:-1]]).tolist(), MPI.FLOAT]
            return {"mpi": lambda: w.comm.Alltoallv(spec(inp, send), spec(out, recv))}
        import ringlet

        m = max(max(recv), max(send))
        big, mine = np.empty(P * m, np.float32), np.empty(P * m, np.float32)
        return {"all_to_all_v": lambda: ringlet.all_to_all_v(out, recv, inp, send),
                "all_to_all": lambda: ringlet.all_to_all(big, mine)}

    run(a, w, forms, f"all_to_all_v, {P} ranks, near-even float32 blocks",
        lambda nbytes: sum(counts_for(nbytes, P, rank)) * 4)


if __name__ == "__main__":
    main()
