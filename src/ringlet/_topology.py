"""Which ranks share a host: the same-host identity.

Two processes may share memory only if they run on one kernel, in one IPC
and mount view of it.  A host name alone does not say that: containers and
network namespaces often share or repeat names (every pod called "worker",
``mpirun`` on hosts that all report "localhost").  The identity is therefore
the kernel's boot id, the IPC and network namespace inodes, and the host
name, hashed; ``RINGLET_HOST_ID`` overrides it (tests use distinct values to
force TCP between ranks of one machine).
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import Dict, List, Optional, Sequence

__all__ = ["host_id", "host_groups", "HOST_ID_ENV"]

HOST_ID_ENV = "RINGLET_HOST_ID"


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(256).decode(errors="replace").strip()
    except OSError:
        return ""


def _ns(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def host_id(env: Optional[Dict[str, str]] = None) -> str:
    """This process's same-host identity, a short printable string.

    Args:
        env: environment to read ``RINGLET_HOST_ID`` from (default ``os.environ``).
    Returns:
        ``RINGLET_HOST_ID`` when set and non-empty, else 16 hex digits of a hash
        of the boot id, the IPC, mount and network namespaces and the host name.
    Raises:
        ValueError: ``RINGLET_HOST_ID`` longer than 64 characters or not printable.

    Example::

        same_host = host_id() == peer_host_id
    """
    e = os.environ if env is None else env
    forced = e.get(HOST_ID_ENV, "").strip()
    if forced:
        if len(forced) > 64 or not forced.isprintable():
            raise ValueError(f"{HOST_ID_ENV} must be at most 64 printable characters, "
                             f"got {forced!r}")
        return forced
    parts = (_read("/proc/sys/kernel/random/boot_id"), _ns("ipc"), _ns("mnt"), _ns("net"),
             socket.gethostname())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def host_groups(ids: Sequence[str]) -> List[List[int]]:
    """Ranks grouped by host, in order of each host's lowest rank.

    Args:
        ids: ``ids[r]`` is rank r's ``host_id()``.
    Returns:
        A list of rank lists; each inner list is sorted.

    Example::

        host_groups(["a", "b", "a"])  # [[0, 2], [1]]
    """
    order: Dict[str, List[int]] = {}
    for r, h in enumerate(ids):
        order.setdefault(h, []).append(r)
    return list(order.values())
