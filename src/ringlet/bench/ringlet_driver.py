"""ringlet's side of the benchmark: the ``Backend`` over ringlet's public API.

Run by ``ringlet bench`` on every rank it launches
(``python -m ringlet.bench.ringlet_driver --config JSON``) and used in place
when ``ringlet bench`` itself runs inside an existing launch.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any, Dict, Optional, Sequence

import numpy as np

from .sweep import Backend, Buffers, SweepConfig, drive, driver_args, ping_pong

__all__ = ["RingletBackend", "main"]


class RingletBackend(Backend):
    """Runs the sweep's operations on ringlet's default group."""

    name = "ringlet"

    def __init__(self) -> None:
        import ringlet

        self._rl = ringlet
        self.rank = ringlet.get_rank()
        self.size = ringlet.get_world_size()
        self._ops = {o.name.lower(): o for o in ringlet.ReduceOp}

    def unsupported(self, cfg: SweepConfig) -> Optional[str]:
        return None

    def barrier(self) -> None:
        self._rl.barrier()

    def start(self, cfg: SweepConfig, b: Buffers, async_: bool) -> Any:
        rl, op = self._rl, cfg.op
        if op == "all_reduce":
            return rl.all_reduce(b.buf, self._ops[cfg.redop], async_op=async_)
        if op == "broadcast":
            return rl.broadcast(b.buf, cfg.root, async_op=async_)
        if op == "reduce":
            return rl.reduce(b.buf, cfg.root, self._ops[cfg.redop], async_op=async_)
        if op == "all_gather":
            return rl.all_gather(b.out, b.inp, async_op=async_)
        if op == "reduce_scatter":
            return rl.reduce_scatter(b.out, b.inp, self._ops[cfg.redop], async_op=async_)
        if op == "all_to_all":
            return rl.all_to_all(b.out, b.inp, async_op=async_)
        if op == "gather":
            return rl.gather(b.out, b.inp, cfg.root, async_op=async_)
        if op == "scatter":
            return rl.scatter(b.out, b.inp, cfg.root, async_op=async_)
        if op == "barrier":
            return rl.barrier(async_op=async_)
        if op == "sendrecv":
            return ping_pong(self.rank, rl.send, rl.recv, b)
        raise ValueError(f"unknown op {op!r}")

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.wait()

    def max_f64(self, a: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(a, dtype=np.float64).copy()
        self._rl.all_reduce(a, self._rl.ReduceOp.MAX)
        return a

    def sum_i64(self, a: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(a, dtype=np.int64).copy()
        self._rl.all_reduce(a, self._rl.ReduceOp.SUM)
        return a

    def versions(self) -> Dict[str, Any]:
        from .. import _core

        # The transport asked for (ringlet-tcp forces tcp); ``ringlet info``
        # and the debug log say which one each peer pair got.
        return {"ringlet": self._rl.__version__, "python": platform.python_version(),
                "numpy": np.__version__, "build": _core.build_info(),
                "transport": os.environ.get("RINGLET_TRANSPORT") or "auto"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Join the job from the launcher's environment and run the sweeps."""
    import ringlet

    sweeps = driver_args(argv)
    ringlet.init()
    try:
        return drive(RingletBackend(), sweeps)
    finally:
        ringlet.shutdown()


if __name__ == "__main__":
    sys.exit(main())
