"""torch's env:// variables for ranks that ``ringlet run`` started.

``ringlet run`` sets RINGLET_* only.  torch's env:// rendezvous needs RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT and a TCPStore there.  Rank 0 serves
that TCPStore on a port the OS picks and publishes the port in the launcher's
(authenticated) ringlet store; every rank then sets the variables with
TORCHELASTIC_USE_AGENT_STORE=True, so torch's rank 0 joins that store as a
client instead of binding another, as under torchrun.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

_KEY = "ringlet/torch/master_port"
_served: Optional[Any] = None  # rank 0's TCPStore, alive for the process


def export_env(timeout: float = 300.0) -> bool:
    """Set torch's env:// variables from ``ringlet run``'s; True when it did.

    Does nothing outside ``ringlet run`` or when RANK / MASTER_PORT are
    already set (torchrun, or by hand).
    """
    global _served
    env = os.environ
    if "RINGLET_RANK" not in env or "RANK" in env or "MASTER_PORT" in env:
        return False
    from ringlet import environment
    from ringlet.store import Store

    le = environment.detect()
    if le is None or le.source != "ringlet" or not le.master_addr or not le.master_port:
        return False
    secret = environment.load_secret()
    if secret is None:
        return False  # ringlet run always sets one; without it the address is not trusted
    import torch.distributed as dist

    store = Store(le.master_addr, int(le.master_port), secret=secret, timeout=timeout)
    try:
        if le.rank == 0:
            _served = dist.TCPStore(le.master_addr, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout))
            port = _served.port
            store.set(_KEY, str(port).encode())
        else:
            port = int(store.get(_KEY, timeout=timeout).decode())
    finally:
        store.close()
    env.update(RANK=str(le.rank), WORLD_SIZE=str(le.world_size),
               LOCAL_RANK=str(le.local_rank), LOCAL_WORLD_SIZE=str(le.local_world_size),
               MASTER_ADDR=le.master_addr, MASTER_PORT=str(port),
               TORCHELASTIC_USE_AGENT_STORE="True")
    return True
