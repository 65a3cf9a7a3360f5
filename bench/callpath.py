"""A fixed loop of small operations, for instruction-count profiles of the call path.

Two in-process ranks (threads over loopback sockets) each do N ping-pongs of
8 bytes (send + recv) and N 8-byte all_reduces.  Run it twice under callgrind
with different N; the difference of the totals divided by the extra calls is
the user-space cost of one call, free of start-up and of scheduling noise:

    RINGLET_SPIN_US=0 PYTHONPATH=src valgrind --tool=callgrind \\
        --callgrind-out-file=cg.2000 "$(python3 -c 'import sys; print(sys.executable)')" \\
        bench/callpath.py 2000
    # ... and again with 4000; then compare callgrind_annotate of both.

RINGLET_SPIN_US=0 keeps a waiting rank from spinning, so its polls do not
inflate the count.
"""

import sys

import numpy as np

import ringlet
from ringlet.testing import run_world


def _body(rank: int, size: int, n: int) -> bool:
    a = np.zeros(2, np.float32)
    for _ in range(n):
        if rank == 0:
            ringlet.send(a, 1)
            ringlet.recv(a, 1)
        else:
            ringlet.recv(a, 0)
            ringlet.send(a, 0)
    for _ in range(n):
        ringlet.all_reduce(a)
    return True


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    assert run_world(_body, 2, timeout=600, args=(n,)) == [True, True]
