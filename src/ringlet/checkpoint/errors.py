"""The checkpoint layer's exception."""

from __future__ import annotations

from typing import Dict, List, Optional

from ..errors import RingletError

__all__ = ["CheckpointError"]


class CheckpointError(RingletError):
    """A checkpoint could not be saved or loaded.

    Raised for a damaged checkpoint (missing, truncated or corrupted file:
    ``file`` and ``key`` name it), for key mismatches under ``strict``
    (``missing_keys`` / ``unexpected_keys``), and on every rank when another
    rank of the group failed its part (``failed_ranks`` maps each failing rank
    to its error message).
    """

    def __init__(self, message: str, *, file: Optional[str] = None, key: Optional[str] = None,
                 failed_ranks: Optional[Dict[int, str]] = None,
                 missing_keys: Optional[Dict[int, List[str]]] = None,
                 unexpected_keys: Optional[List[str]] = None, rank: Optional[int] = None,
                 op: Optional[str] = None) -> None:
        super().__init__(message, rank=rank, op=op)
        self.file = file
        self.key = key
        self.failed_ranks = failed_ranks or {}
        self.missing_keys = missing_keys or {}
        self.unexpected_keys = unexpected_keys or []
