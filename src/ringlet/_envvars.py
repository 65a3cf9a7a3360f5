"""The enumerated ``RINGLET_*`` settings (``RINGLET_TRANSPORT``,
``RINGLET_BIND``): one parser, so every such variable accepts and refuses
values alike."""

from __future__ import annotations

import os
from typing import Mapping, Optional, Tuple

__all__ = ["choice"]


def choice(name: str, choices: Tuple[str, ...],
           environ: Optional[Mapping[str, str]] = None) -> str:
    """The environment variable ``name`` as one of ``choices`` (case and
    surrounding blanks ignored); unset or blank means ``choices[0]``.

    Raises:
        ValueError: any other value, naming the variable and the choices.
    """
    env = os.environ if environ is None else environ
    raw = (env.get(name) or "").strip().lower() or choices[0]
    if raw not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {env.get(name)!r}")
    return raw
