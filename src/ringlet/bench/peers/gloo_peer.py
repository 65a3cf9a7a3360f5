"""torch.distributed's gloo backend as a ``ringlet bench --vs gloo`` peer.

Started by ``ringlet bench`` once per rank::

    RANK=r WORLD_SIZE=N GLOO_SOCKET_IFNAME=lo \\
        python -m ringlet.bench.peers.gloo_peer --store FILE --config JSON

Ranks meet through a ``FileStore`` on a fresh temporary file, so no port has
to be chosen in advance.  Tensors are ``torch.from_numpy`` views of the
sweep's numpy buffers (no copies; results are checked by the same oracle).
gloo has no AVG reduction and no bfloat16 from numpy, so those sweeps are
reported as skipped.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from typing import Any, Dict, Optional, Sequence

import numpy as np

from ..sweep import Backend, Buffers, SweepConfig, drive, driver_args, ping_pong

__all__ = ["GlooBackend", "main"]


class GlooBackend(Backend):
    """The sweep's operations on the default gloo process group."""

    name = "gloo"
    reduce_keeps_input = False  # torch leaves non-root reduce buffers undefined

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        R = dist.ReduceOp
        self._ops = {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}
        # Newer torch renamed the flat-tensor collectives; use what exists.
        self._ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def _tensors(self, b: Buffers) -> Any:
        # Wrapped once per buffer set and kept on it: from_numpy is cheap but
        # not free next to an 8-byte operation, and dies with the buffers.
        t = getattr(b, "_torch", None)
        if t is None:
            wrap = lambda a: None if a is None else self.torch.from_numpy(a)  # noqa: E731
            t = b._torch = Buffers(wrap(b.buf), wrap(b.out), wrap(b.inp))
        return t

    def unsupported(self, cfg: SweepConfig) -> Optional[str]:
        if cfg.redop == "avg" and cfg.op in ("all_reduce", "reduce", "reduce_scatter"):
            return "gloo has no AVG reduction"
        if cfg.dtype == "bfloat16":
            return "torch cannot wrap an ml_dtypes bfloat16 numpy array"
        return None

    def barrier(self) -> None:
        self.dist.barrier()

    def start(self, cfg: SweepConfig, b: Buffers, async_: bool) -> Any:
        d, op = self.dist, cfg.op
        b = self._tensors(b)
        red = self._ops.get(cfg.redop)
        root = cfg.root
        if op == "sendrecv":
            return ping_pong(self.rank, d.send, d.recv, b)
        if op == "all_reduce":
            return d.all_reduce(b.buf, op=red, async_op=async_)
        if op == "broadcast":
            return d.broadcast(b.buf, src=root, async_op=async_)
        if op == "reduce":
            return d.reduce(b.buf, dst=root, op=red, async_op=async_)
        if op == "all_gather":
            return self._ag(b.out, b.inp, async_op=async_)
        if op == "reduce_scatter":
            return self._rs(b.out, b.inp, op=red, async_op=async_)
        if op == "all_to_all":
            return d.all_to_all_single(b.out, b.inp, async_op=async_)
        if op == "gather":
            outs = list(b.out.chunk(self.size)) if self.rank == root else None
            return d.gather(b.inp, outs, dst=root, async_op=async_)
        if op == "scatter":
            ins = list(b.inp.chunk(self.size)) if self.rank == root else None
            return d.scatter(b.out, ins, src=root, async_op=async_)
        if op == "barrier":
            return d.barrier(async_op=async_)
        raise ValueError(f"unknown op {op!r}")

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.wait()

    def max_f64(self, a: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(a, dtype=np.float64).copy()
        self.dist.all_reduce(self.torch.from_numpy(a), op=self.dist.ReduceOp.MAX)
        return a

    def sum_i64(self, a: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(a, dtype=np.int64).copy()
        self.dist.all_reduce(self.torch.from_numpy(a), op=self.dist.ReduceOp.SUM)
        return a

    def versions(self) -> Dict[str, Any]:
        return {"torch": self.torch.__version__, "python": platform.python_version(),
                "numpy": np.__version__}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: rank and world size from RANK / WORLD_SIZE, store from ``--store``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--store" not in args:
        raise SystemExit("gloo_peer: --store FILE is required (a path no other job uses)")
    i = args.index("--store")
    store = args[i + 1]
    del args[i:i + 2]
    sweeps = driver_args(args)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's API renames
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + os.path.abspath(store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=600))
    try:
        return drive(GlooBackend(), sweeps)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
