"""``ringlet bench``: nccl-tests-style measurements of ringlet's collectives.

``ringlet bench OP [options]`` sweeps message sizes for one collective (or
``all``), launching its own local ranks or running in place inside an
existing launch; ``--vs mpi,gloo`` runs the same sweep on Open MPI (TCP and
shared memory) and torch.distributed gloo, interleaved; ``ringlet bench
limits`` measures the machine's loopback TCP, latency and memory ceilings.
See docs/benchmarks.md for the method and the measured results.

Modules: ``command`` (CLI and flow), ``sweep`` (the measuring loop and numpy
oracle shared by every system), ``ringlet_driver`` and ``peers`` (one backend
per system), ``launch`` (local jobs), ``busy`` (busy loops beside them),
``report`` (tables, JSON, CSV), ``limits`` (ceilings and the memory bound),
``plot`` (matplotlib figure).

Example::

    ringlet bench all_reduce -n 4 -b 8 -e 256M -f 4 --vs mpi,gloo --json ar.json
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ringlet bench`` with ``argv`` (the arguments after ``bench``); return the exit code.

    Example::

        import ringlet.bench
        code = ringlet.bench.main(["all_reduce", "-n", "2", "-e", "1M", "--check"])
    """
    from .command import main as _main

    return _main(argv)
