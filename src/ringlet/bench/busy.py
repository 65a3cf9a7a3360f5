"""``ringlet bench --busy K``: busy-looping processes beside every benchmark job.

A real host is rarely idle (data loaders, compute threads, other jobs), and
waiting policies that hold on an idle machine can collapse when ranks must
share their cores.  ``busy_loops(k)`` starts ``k`` plain Python processes that
spin (``while True: pass``) and stops them when the block ends, whatever
happened inside it.  ``ringlet bench`` wraps each system's job in one such
block, so every system runs beside the same load and none inherits another's.

The loops start in this session, each in a process group of its own, like the
benchmark's ranks: with the kernel's scheduler autogroups every session is
one scheduling group, so load started from another terminal would take a
fixed share of the CPU, while these compete with the ranks one process
against another (docs/benchmarks.md).

Example::

    with busy_loops(2) as pids:
        run_the_job()
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from typing import Iterator, List

from ..run import own_process_group

__all__ = ["busy_loops", "BUSY_MARK", "BusyError"]

# In every loop's command line, so a test (or a person with ps) can tell
# them from other processes.
BUSY_MARK = "ringlet-bench-busy"
# The loop says it is running before it spins: the job starts only beside
# loops that already compete for the cores.
_CODE = (f"import sys  # {BUSY_MARK}\n"
         "sys.stdout.write('spinning\\n'); sys.stdout.flush()\n"
         "while True:\n    pass\n")
_START_S = 60.0  # generous: a new interpreter on a loaded 2-core host


class BusyError(RuntimeError):
    """A busy loop did not start (it exited, or did not report within the deadline)."""


def _stop(procs: List[subprocess.Popen]) -> None:
    # SIGKILL right away: a loop holds nothing worth a graceful exit.
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


@contextlib.contextmanager
def busy_loops(k: int) -> Iterator[List[int]]:
    """Run ``k`` busy-looping processes for the duration of the block.

    Args:
        k: how many (0: none, the block runs as it is).
    Yields:
        The loops' process ids, every one of them already spinning.
    Raises:
        ValueError: ``k`` is not an int >= 0.
        BusyError: a loop did not start within 60 s (those started are stopped).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"busy loops: expected an int >= 0, got {k!r}")
    procs: List[subprocess.Popen] = []
    try:
        for _ in range(k):
            procs.append(subprocess.Popen(
                [sys.executable, "-S", "-c", _CODE], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, **own_process_group()))
        deadline = time.monotonic() + _START_S
        for i, p in enumerate(procs):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, left))
            line = p.stdout.readline() if ready else b""
            if line != b"spinning\n":
                if not ready:
                    why = f"within {_START_S:.0f} s"
                else:  # its output ended: it is exiting; give it the time left to say how
                    try:
                        why = f"(exit code {p.wait(max(0.1, deadline - time.monotonic()))})"
                    except subprocess.TimeoutExpired:
                        why = "(its output ended, yet it did not exit)"
                raise BusyError(f"busy loop {i + 1} of {k} (pid {p.pid}) did not start {why}")
        yield [p.pid for p in procs]
    finally:
        _stop(procs)
