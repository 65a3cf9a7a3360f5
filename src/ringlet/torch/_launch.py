"""torch's env:// variables for ranks that ``ringlet run`` or mpirun started.

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

    Under mpirun (with mpi4py) the same, with MPI carrying the address.
    Does nothing elsewhere or when RANK / MASTER_PORT are already set
    (torchrun, or by hand).
    """
    global _served
    env = os.environ
    if "RANK" in env or "MASTER_PORT" in env:
        return False
    if "RINGLET_RANK" not in env and "OMPI_COMM_WORLD_RANK" not in env \
            and "PMI_RANK" not in env:
        return False
    from ringlet import environment
    from ringlet.store import Store

    le = environment.detect()
    if le is not None and le.source in ("openmpi", "mpich"):
        return _export_from_mpi(le, timeout)
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
    _set(le, le.master_addr, port)
    return True


def _set(le: Any, addr: str, port: int) -> None:
    os.environ.update(RANK=str(le.rank), WORLD_SIZE=str(le.world_size),
                      LOCAL_RANK=str(le.local_rank), LOCAL_WORLD_SIZE=str(le.local_world_size),
                      MASTER_ADDR=addr, MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")


def _export_from_mpi(le: Any, timeout: float) -> bool:
    """Under mpirun: rank 0 serves torch's TCPStore, MPI (the trusted channel) carries
    its address.  Needs mpi4py, as ringlet's own MPI bootstrap does."""
    global _served
    try:
        from mpi4py import MPI
    except ImportError:
        return False  # then RANK / MASTER_* must be set by hand, as for gloo
    import socket

    import torch.distributed as dist

    from ringlet import environment

    comm = MPI.COMM_WORLD
    hosts = set(comm.allgather(socket.gethostname()))
    addr = None
    if comm.Get_rank() == 0:
        addr = le.master_addr or ("127.0.0.1" if len(hosts) == 1
                                  else environment.select_bind_address(None, os.environ.get(
                                      "RINGLET_IFNAME")))
        _served = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=timeout))
        addr = (addr, _served.port)
    addr, port = comm.bcast(addr, root=0)
    _set(le, addr, port)
    return True
