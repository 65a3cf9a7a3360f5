"""A first multi-rank job: run with `ringlet run -n 4 examples/quickstart.py`.

Every rank contributes its rank number; the collectives combine them and each
rank prints what it received, so you can see every rank agree.
"""

import numpy as np

import ringlet


def main() -> None:
    ringlet.init()
    rank, size = ringlet.get_rank(), ringlet.get_world_size()

    x = np.full(4, rank + 1, dtype=np.float32)
    ringlet.all_reduce(x)  # in place: 1 + 2 + ... + size on every rank

    gathered = np.empty(size, dtype=np.int64)
    ringlet.all_gather(gathered, np.array([rank * 10], dtype=np.int64))

    mean = np.array([float(rank)])
    ringlet.all_reduce(mean, ringlet.ReduceOp.AVG)

    config = ringlet.broadcast_object({"lr": 0.1, "seed": 1234} if rank == 0 else None, src=0)

    if size > 1:  # a tagged message around the ring
        token = np.array([rank], dtype=np.int32)
        got = np.empty(1, dtype=np.int32)
        w = ringlet.isend(token, (rank + 1) % size, tag=7)
        ringlet.recv(got, (rank - 1) % size, tag=7)
        w.wait()
        ring_msg = int(got[0])
    else:
        ring_msg = rank

    expected = size * (size + 1) / 2
    ok = bool(np.all(x == expected)) and list(gathered) == [10 * r for r in range(size)]
    print(f"rank {rank}/{size}: all_reduce={x[0]:g} (expected {expected:g}) "
          f"all_gather={gathered.tolist()} mean_rank={mean[0]:g} config={config} "
          f"from_left={ring_msg} {'OK' if ok else 'WRONG'}", flush=True)
    ringlet.barrier()
    ringlet.shutdown()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
