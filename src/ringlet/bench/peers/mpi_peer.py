"""Open MPI (through mpi4py) as a ``ringlet bench --vs mpi`` peer.

Started by ``ringlet bench`` as::

    mpirun -n N --oversubscribe [--mca pml ob1 --mca btl tcp,self ...] \\
        python -m ringlet.bench.peers.mpi_peer --config JSON

Each operation is the mpi4py buffer call closest to ringlet's: in-place
``Allreduce`` / ``Reduce`` (``MPI.IN_PLACE`` on the root), ``Bcast``,
``Allgather``, ``Reduce_scatter_block``, ``Alltoall``, ``Gather``,
``Scatter``, blocking ``Send``/``Recv`` for the ping-pong, and the ``I*``
non-blocking forms for ``--async``.  MPI has no AVG reduction and no
float16/bfloat16 arithmetic, so those sweeps are reported as skipped.
"""

from __future__ import annotations

import platform
import sys
from typing import Any, Dict, Optional, Sequence

import numpy as np

from ..sweep import Backend, Buffers, SweepConfig, drive, driver_args, ping_pong

__all__ = ["MpiBackend", "main"]


class MpiBackend(Backend):
    """The sweep's operations on ``MPI.COMM_WORLD``."""

    def __init__(self, name: str = "mpi") -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.name = name
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

    def unsupported(self, cfg: SweepConfig) -> Optional[str]:
        if cfg.redop == "avg" and cfg.op in ("all_reduce", "reduce", "reduce_scatter"):
            return "MPI has no AVG reduction"
        if cfg.dtype in ("float16", "bfloat16"):
            return f"MPI has no {cfg.dtype} datatype"
        return None

    def barrier(self) -> None:
        self.comm.Barrier()

    def start(self, cfg: SweepConfig, b: Buffers, async_: bool) -> Any:
        c, MPI, op = self.comm, self.MPI, cfg.op
        red = self._ops.get(cfg.redop)
        root = cfg.root
        if op == "sendrecv":
            return ping_pong(self.rank, lambda a, p: c.Send(a, dest=p),
                             lambda a, p: c.Recv(a, source=p), b)
        if not async_:
            if op == "all_reduce":
                c.Allreduce(MPI.IN_PLACE, b.buf, op=red)
            elif op == "broadcast":
                c.Bcast(b.buf, root=root)
            elif op == "reduce":
                if self.rank == root:
                    c.Reduce(MPI.IN_PLACE, b.buf, op=red, root=root)
                else:
                    c.Reduce(b.buf, None, op=red, root=root)
            elif op == "all_gather":
                c.Allgather(MPI.IN_PLACE if cfg.in_place else b.inp, b.out)
            elif op == "reduce_scatter":
                c.Reduce_scatter_block(b.inp, b.out, op=red)
            elif op == "all_to_all":
                c.Alltoall(b.inp, b.out)
            elif op == "gather":
                c.Gather(b.inp, b.out if self.rank == root else None, root=root)
            elif op == "scatter":
                c.Scatter(b.inp if self.rank == root else None, b.out, root=root)
            elif op == "barrier":
                c.Barrier()
            else:
                raise ValueError(f"unknown op {op!r}")
            return None
        if op == "all_reduce":
            return c.Iallreduce(MPI.IN_PLACE, b.buf, op=red)
        if op == "broadcast":
            return c.Ibcast(b.buf, root=root)
        if op == "reduce":
            if self.rank == root:
                return c.Ireduce(MPI.IN_PLACE, b.buf, op=red, root=root)
            return c.Ireduce(b.buf, None, op=red, root=root)
        if op == "all_gather":
            return c.Iallgather(MPI.IN_PLACE if cfg.in_place else b.inp, b.out)
        if op == "reduce_scatter":
            return c.Ireduce_scatter_block(b.inp, b.out, op=red)
        if op == "all_to_all":
            return c.Ialltoall(b.inp, b.out)
        if op == "gather":
            return c.Igather(b.inp, b.out if self.rank == root else None, root=root)
        if op == "scatter":
            return c.Iscatter(b.inp if self.rank == root else None, b.out, root=root)
        if op == "barrier":
            return c.Ibarrier()
        raise ValueError(f"unknown op {op!r}")

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.Wait()

    def max_f64(self, a: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(a, dtype=np.float64).copy()
        self.comm.Allreduce(self.MPI.IN_PLACE, a, op=self.MPI.MAX)
        return a

    def sum_i64(self, a: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(a, dtype=np.int64).copy()
        self.comm.Allreduce(self.MPI.IN_PLACE, a, op=self.MPI.SUM)
        return a

    def versions(self) -> Dict[str, Any]:
        import mpi4py

        lib = self.MPI.Get_library_version().strip().splitlines()[0]
        return {"mpi4py": mpi4py.__version__, "mpi_library": lib.split(",")[0],
                "python": platform.python_version(), "numpy": np.__version__}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point under ``mpirun``; ``--name`` labels the rows (mpi-tcp, mpi-sm)."""
    args = list(sys.argv[1:] if argv is None else argv)
    name = "mpi"
    if "--name" in args:
        i = args.index("--name")
        name = args[i + 1]
        del args[i:i + 2]
    sweeps = driver_args(args)
    return drive(MpiBackend(name), sweeps)


if __name__ == "__main__":
    sys.exit(main())
