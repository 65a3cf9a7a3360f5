"""Explicit "I am blocked" signals for tests, and the hand-over sockets a process holds:
read from the kernel, not guessed by timers."""

from __future__ import annotations

import os
import time

_POLL_SYSCALLS = {"7", "271"}  # x86-64 poll, ppoll: where a call over TCP waits
_FUTEX = "202"  # x86-64 futex: where a call over shared memory waits...
_FUTEX_WAIT_SHARED = 0  # ...with FUTEX_WAIT on the segment's bell; the GIL and other
# process-private locks wait with the PRIVATE flag (128) set


def blocked_in_poll(tid: int) -> bool:
    """True while thread `tid` of this process sits in a ringlet wait: poll(2)
    (TCP) or a shared FUTEX_WAIT (shared memory), as /proc/self/task/TID/syscall
    reports it."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return False
    if not fields:
        return False
    if fields[0] in _POLL_SYSCALLS:
        return True
    return fields[0] == _FUTEX and len(fields) > 2 and int(fields[2], 16) == _FUTEX_WAIT_SHARED


def wait_until_blocked(tid: int, timeout: float = 30.0) -> bool:
    """Wait (bounded, generous) until thread `tid` blocks in a ringlet wait; True if it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if blocked_in_poll(tid):
            return True
        time.sleep(0.001)
    return False


def handover_sockets(pids=None):
    """Names of ringlet's shared-memory hand-over sockets (abstract Unix
    sockets, from /proc/net/unix); with pids, only those these processes hold
    (other jobs on the machine have their own)."""
    inodes = None
    if pids is not None:
        inodes = set()
        for pid in pids:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {r[-1][1:] for r in rows
            if len(r) >= 8 and r[-1].startswith("@ringlet-shm-")
            and (inodes is None or r[6] in inodes)}
