"""Which RPC agent a thread uses: the one it initialised or serves, else the only one.

Kept apart from ``agent`` so that RRefs find their agent without importing it.
"""

from __future__ import annotations

import threading
from typing import Any, List

from ringlet.errors import RingletError

_tls = threading.local()
_agents_lock = threading.Lock()
_agents: List[Any] = []  # every live Agent of this process


def current_agent() -> Any:
    """The agent of this worker: the one this thread initialised or serves, else the only one.

    Raises:
        RingletError: RPC is not initialised (or, with several agents in one
            process, this thread belongs to none of them).
    """
    a = getattr(_tls, "agent", None)
    if a is not None and not a.closed:
        return a
    if getattr(_tls, "bound", False):
        # This thread started (and has since shut down) an agent: never borrow
        # another rank's agent (thread-mode worlds keep several in one process).
        raise RingletError("ringlet.rpc is not initialised on this worker: call ringlet.rpc.init_rpc(name) first")
    with _agents_lock:
        live = [x for x in _agents if not x.closed]
    if len(live) == 1:
        return live[0]
    raise RingletError("ringlet.rpc is not initialised on this worker: call ringlet.rpc.init_rpc(name) first"
                       + (" (several RPC agents live in this process; use the thread that called init_rpc)"
                          if live else ""))
