"""torch's env:// variables for ranks that ``ringlet run`` or mpirun started.

``ringlet run`` sets RINGLET_* only.  torch's env:// rendezvous needs RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT and a TCPStore there.  Rank 0 serves
that TCPStore on a port the OS picks, on the address ringlet binds on its host,
and publishes ``host:port`` in the launcher's (authenticated) ringlet store;
every rank then sets the variables with TORCHELASTIC_USE_AGENT_STORE=True, so
torch's rank 0 joins that store as a client instead of binding another, as
under torchrun.

Which variables count is ringlet's own rule (``environment.detect``,
docs/launching.md "Which launcher wins"): torchrun's RANK (its markers beside
it), or a RANK a script set that agrees with mpirun's, is left alone with
the rest of torch's variables.  Under ``ringlet run`` its RINGLET_RANK wins
and a RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT there is replaced:
``ringlet run`` sets none of them, so they are left from an earlier session
(one RANK for every rank), and kept they would give every rank one number or
send torch's rendezvous to a stale address.  Under mpirun a RANK that
disagrees with its numbering raises the ``ValueError`` ``init`` raises, and
a MASTER_ADDR / MASTER_PORT without RANK is replaced (``ringlet.environment``
passes them over under mpirun and srun for the same reason).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any, Optional

from ringlet.errors import RendezvousError

_KEY = "ringlet/torch/master_addr"
_served: Optional[Any] = None  # rank 0's TCPStore, alive for the process
_log = logging.getLogger("ringlet")
# How a timed-out MPI exchange of the import reads (environment._mpi_wait).
_TORCH_WAIT = {"step": "`import ringlet.torch` under MPI", "reached": "it"}


def export_env(timeout: float = 300.0) -> bool:
    """Set torch's env:// variables from ``ringlet run``'s; True when it did.

    Under mpirun (with mpi4py) the same, with MPI carrying the address.
    Does nothing elsewhere, when torch's RANK counts (torchrun's, or one set by
    hand that agrees with mpirun's), or without a store served before ``init``
    (RINGLET_EXTERNAL_STORE=1, as ``ringlet run`` sets).  A variable replaced
    is logged at debug level.

    Raises:
        ValueError: under mpirun, a RANK / WORLD_SIZE without torchrun's markers
            that disagrees with mpirun's numbering (as ``ringlet.init``).
    """
    global _served
    env = os.environ
    if "RINGLET_RANK" not in env and "OMPI_COMM_WORLD_RANK" not in env \
            and "PMI_RANK" not in env:
        return False
    from ringlet import environment
    from ringlet.store import Store

    le = environment.detect()  # "torchrun" when RANK counts; raises on an MPI conflict
    if le is not None and le.source in ("openmpi", "mpich"):
        return _export_from_mpi(le, timeout)
    # Without ringlet run's store (RINGLET_* set by hand) nobody serves one until
    # rank 0's init: publishing there would wait out the timeout at import.
    if le is None or le.source != "ringlet" or not le.master_addr or not le.master_port \
            or env.get("RINGLET_EXTERNAL_STORE") != "1":
        return False
    secret = environment.load_secret()
    if secret is None:
        return False  # ringlet run always sets one; without it the address is not trusted
    import torch.distributed as dist

    store = Store(le.master_addr, int(le.master_port), secret=secret, timeout=timeout)
    try:
        if le.rank == 0:
            # Where ringlet binds on this host: rank 0 need not run on the launcher's
            # host (`ringlet run --hosts`), whose address it cannot bind.
            host = environment.select_bind_address(le.master_addr, env.get("RINGLET_IFNAME"))
            _served = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout))
            addr = f"{host}:{_served.port}"
            store.set(_KEY, addr.encode())
        else:
            addr = store.get(_KEY, timeout=timeout).decode()
    finally:
        store.close()
    host, _, port = addr.rpartition(":")
    _set(le, host, int(port))
    return True


def _set(le: Any, addr: str, port: int) -> None:
    stale = [f"{n}={os.environ[n]}" for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
             if n in os.environ]
    if stale:
        _log.debug("ringlet: rank %d: %s replaced by rank %d of %d, %s:%d (torch's store, "
                   "served by rank 0 under %s); these are torchrun's, often left from an "
                   "earlier job", le.rank, ", ".join(stale), le.rank, le.world_size, addr, port,
                   "ringlet run" if le.source == "ringlet" else le.source)
    os.environ.update(RANK=str(le.rank), WORLD_SIZE=str(le.world_size),
                      LOCAL_RANK=str(le.local_rank), LOCAL_WORLD_SIZE=str(le.local_world_size),
                      MASTER_ADDR=addr, MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")


def _export_from_mpi(le: Any, timeout: float) -> bool:
    """Under mpirun: rank 0 serves torch's TCPStore, MPI (the trusted channel) carries
    its address.  Needs mpi4py, as ringlet's own MPI bootstrap does, and goes as it
    does (``environment.mpi_bootstrap``): hosts told apart by the same-host identity
    (host names are often alike on every node), non-blocking collectives polled
    against the deadline, rank 0's failure told to every rank."""
    global _served
    try:
        from mpi4py import MPI
    except ImportError:
        return False  # then RANK / MASTER_* must be set by hand, as for gloo
    import torch.distributed as dist

    from ringlet import environment
    from ringlet._topology import host_id
    from ringlet.environment import _mpi_wait

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    deadline = time.monotonic() + timeout
    n = environment._ID_BYTES
    mine = bytearray(host_id().encode()[:n].ljust(n, b"\0"))
    ids = bytearray(n * size)
    _mpi_wait(comm.Iallgather([mine, MPI.BYTE], [ids, MPI.BYTE]), deadline,
              "the host identity exchange", rank, **_TORCH_WAIT)
    hosts = len({bytes(ids[i:i + n]) for i in range(0, len(ids), n)})
    buf = bytearray(environment._BCAST_BYTES)
    failure: Optional[BaseException] = None
    if rank == 0:
        try:
            addr = le.master_addr or _mpi_store_host(environment, hosts)
            _served = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout))
            body = b"\0" + f"{addr}:{_served.port}".encode()
        except Exception as exc:  # noqa: BLE001 - every rank must hear why
            failure = exc
            body = b"\1" + f"{type(exc).__name__}: {exc}".encode()[:len(buf) - 1]
        buf[:len(body)] = body
    _mpi_wait(comm.Ibcast([buf, MPI.BYTE], root=0), deadline, "the store-address broadcast",
              rank, **_TORCH_WAIT)
    if failure is not None:
        raise failure
    msg = bytes(buf[1:]).rstrip(b"\0").decode("utf-8", "replace")
    if buf[0]:
        raise RendezvousError(f"rank {rank}: rank 0 could not serve torch's store: {msg}",
                              rank=rank, peer=0)
    host, _, port = msg.rpartition(":")
    _set(le, host, int(port))
    return True


def _mpi_store_host(environment: Any, hosts: int) -> str:
    # As ringlet's MPI bootstrap chooses (environment.mpi_bootstrap): loopback
    # only when every rank shares rank 0's host.
    ifname = os.environ.get("RINGLET_IFNAME")
    if ifname and ifname.strip():
        addr = environment.select_bind_address(None, ifname)
        if hosts > 1 and environment.is_loopback(addr):
            raise RendezvousError(f"RINGLET_IFNAME={ifname!r} selects loopback but the job "
                                  f"spans {hosts} hosts")
        return addr
    return environment._routable_address() if hosts > 1 else "127.0.0.1"
