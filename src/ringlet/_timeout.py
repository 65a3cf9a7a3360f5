"""One check for every ``timeout`` argument: seconds, positive, capped.

A timeout is a number of seconds.  NaN, negative numbers and (unless a
call allows polling) zero are refused with a ``ValueError`` naming the
argument.  Anything above ``MAX_TIMEOUT`` (one year), ``inf`` included,
means "no practical deadline" and is capped to it, so the C side's
nanosecond deadlines (int64) and ``threading`` waits never overflow.
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["MAX_TIMEOUT", "seconds", "millis"]

MAX_TIMEOUT = 365.0 * 24 * 3600  # one year, in seconds


def seconds(timeout: Any, what: str = "timeout", *, zero: bool = False) -> float:
    """``timeout`` as float seconds in (0, MAX_TIMEOUT] ([0, ...] with ``zero``).

    Raises:
        TypeError: not a real number (bool refused too).
        ValueError: NaN, negative, or zero where ``zero`` is False.
    """
    t = timeout
    if type(t) is not float:  # floats skip the (slower) ABC check: per-op call path
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise TypeError(f"{what} must be a number of seconds, got {type(t).__name__}")
        t = float(t)
    if not (t >= 0 if zero else t > 0):  # NaN fails both
        raise ValueError(f"{what} must be a {'non-negative' if zero else 'positive'} number "
                         f"of seconds, got {timeout!r}")
    return t if t < MAX_TIMEOUT else MAX_TIMEOUT


def millis(timeout: Any, what: str = "timeout") -> int:
    """``seconds(timeout)`` in whole milliseconds, at least 1 (the C binding's unit)."""
    tp = type(timeout)
    if (tp is float or tp is int) and 0 < timeout < MAX_TIMEOUT:  # the per-op call path
        return max(1, int(timeout * 1000))
    return max(1, int(seconds(timeout, what) * 1000))
