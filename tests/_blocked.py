"""Explicit "I am blocked" signals for tests: read from the kernel, not guessed by timers."""

from __future__ import annotations

import time

_POLL_SYSCALLS = {"7", "271"}  # x86-64 poll, ppoll: where a blocked ringlet call waits


def blocked_in_poll(tid: int) -> bool:
    """True while thread `tid` of this process sits in poll(2), as
    /proc/self/task/TID/syscall reports it."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            return f.read().split()[0] in _POLL_SYSCALLS
    except (OSError, IndexError):
        return False


def wait_until_blocked(tid: int, timeout: float = 30.0) -> bool:
    """Wait (bounded, generous) until thread `tid` blocks in poll; True if it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if blocked_in_poll(tid):
            return True
        time.sleep(0.001)
    return False
