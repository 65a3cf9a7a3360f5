"""Thin wrapper around ``ringlet.bench.peers.gloo_peer`` (the driver lives in the package).

``bench/`` is not installed with ringlet, but ``ringlet bench --vs`` must find its
peer drivers wherever ringlet is installed, so the code is in
``src/ringlet/bench/peers/``.  This file runs it from a source checkout::

    RANK=0 WORLD_SIZE=1 python bench/peers/gloo_peer.py --store /tmp/gloo-store --config '{"sweeps": [{"op": "all_reduce", "sizes": [8]}]}'

Records (one JSON object per line, prefixed ``@@ringlet-bench``) appear on rank 0's stdout.
"""

import os
import sys

try:
    from ringlet.bench.peers.gloo_peer import main
except ImportError:  # a source checkout that was not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
    from ringlet.bench.peers.gloo_peer import main

if __name__ == "__main__":
    sys.exit(main())
