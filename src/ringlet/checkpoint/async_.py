"""``AsyncCheckpointer``: snapshot now, write and commit in a background thread.

Concurrency design.  A save needs collectives (the plan exchange and the
commit vote).  Issued from a background thread on the *training* group they
would interleave with the training thread's own collectives in an order that
differs between ranks, and mix up the byte streams.  So the checkpointer
creates a group of its own at construction (``ringlet.new_group`` over the
same ranks, a collective call) and the background thread runs the whole
``SaveJob`` (plan, write, commit) on that group.  Groups have separate
communicators, so the two threads' traffic never mixes; and because at most
one save is in flight and every rank issues saves in the same order, the
background collectives line up across ranks.

A consequence worth knowing: the checkpoint is committed by the background
thread, without the caller having to call ``wait()``; ``wait()`` only
reports the outcome.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional

import numpy as np

from .._timeout import seconds
from ._comm import Comm, describe
from ._state import flatten
from .errors import CheckpointError
from .format import DEFAULT_CHUNK_BYTES, dtype_name
from .save import DEFAULT_SPLIT_BYTES, SaveJob, _check_path, _check_sizes
from .shard import ShardedTensor

__all__ = ["AsyncCheckpointer"]


class AsyncCheckpointer:
    """Saves checkpoints in the background while training continues.

    Construction is collective: every rank of ``group`` must create its
    checkpointer at the same point (it creates a dedicated group).

    Args:
        group: ringlet group whose ranks save together (default: the world; a
            world of one when ringlet is not initialised).
        timeout: seconds each agreement collective may wait for the slowest
            rank's I/O (default: the group's timeout).
        chunk_bytes, split_bytes: as for ``save``.

    Example::

        ckpt = AsyncCheckpointer()
        for step in range(steps):
            train_step()
            if step % 100 == 0:
                ckpt.save_async({"model": model.state_dict(), "step": step}, "ckpt/latest")
        ckpt.wait()  # raises if the last save failed
    """

    def __init__(self, *, group: Any = None, timeout: Optional[float] = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 split_bytes: int = DEFAULT_SPLIT_BYTES) -> None:
        import ringlet

        _check_sizes(chunk_bytes, split_bytes)
        self._chunk_bytes = chunk_bytes
        self._split_bytes = split_bytes
        self._timeout = timeout
        own = None
        if group is not None:
            own = ringlet.new_group(group.ranks, group=group)
        elif ringlet.is_initialized():
            own = ringlet.new_group(list(range(ringlet.get_world_size())))
        self._comm = Comm(own, timeout)
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._reported = True  # the current error was already raised to the caller
        self._staging: Dict[str, np.ndarray] = {}

    # ---- snapshot -------------------------------------------------------------
    def _copy(self, key: str, arr: np.ndarray) -> np.ndarray:
        """A private copy of ``arr``, reusing last save's buffer when it fits.

        Refuses a dtype checkpoints cannot store (TypeError naming ``key``)
        here, so ``save_async`` raises at once as ``save`` would.
        """
        dtype_name(arr.dtype, key)
        buf = self._staging.get(key)
        if buf is None or buf.shape != arr.shape or buf.dtype != arr.dtype:
            buf = np.empty(arr.shape, dtype=arr.dtype)
        np.copyto(buf, arr)
        return buf

    def _snapshot(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        flat = flatten(state_dict)
        snap: Dict[str, Any] = {}
        for key, leaf in flat.items():
            if isinstance(leaf, np.ndarray):
                snap[key] = self._copy(key, leaf)
            elif isinstance(leaf, ShardedTensor):
                snap[key] = ShardedTensor(self._copy(key, leaf.local), leaf.spec)
            else:
                snap[key] = leaf  # already a fresh JSON-ready copy
        self._staging = {k: (v.local if isinstance(v, ShardedTensor) else v)
                         for k, v in snap.items() if isinstance(v, (np.ndarray, ShardedTensor))}
        return snap

    # ---- public API -----------------------------------------------------------------
    def save_async(self, state_dict: Dict[str, Any], path: Any) -> None:
        """Snapshot ``state_dict`` and save it to ``path`` in the background; collective.

        Waits first for the previous save, if one is in flight.  Once this
        returns, the caller may modify its arrays freely.

        Args:
            state_dict, path: as for ``save``.
        Raises:
            TypeError/ValueError: bad state dict on this rank (raised here; the
                other ranks see a ``CheckpointError`` from ``wait()``).
            Exception: the previous save's error, if it was not yet reported
                by ``wait()``.  This save then fails on every rank: the ranks
                that had already seen that error get a ``CheckpointError`` from
                ``wait()``, so every rank's saves stay paired.
        """
        with self._lock:
            self._join(None)
            if self._comm.local:
                import ringlet

                if ringlet.is_initialized():
                    raise RuntimeError("this AsyncCheckpointer was created before "
                                       "ringlet.init(), as a world of one; create it after init")
            job = SaveJob(self._comm, "", self._chunk_bytes, self._split_bytes)
            flat = None
            error: Optional[BaseException] = None
            vote: Optional[BaseException] = None
            pending = self._error if self._error is not None and not self._reported else None
            if pending is not None:
                # Raised here instead of saving, but still voted: a rank that already
                # saw this error through wait() (done() differs by timing) has started
                # this save, and its collectives must pair with this rank's.
                error = pending
                vote = CheckpointError(f"this rank did not start the save: save_async raised "
                                       f"its previous save's error instead: {describe(pending)}")
            else:
                try:
                    job.path = _check_path(path)
                    job.what = f"checkpoint save to {job.path!r}"
                    flat = self._snapshot(state_dict)
                except Exception as exc:  # noqa: BLE001 - still voted so peers fail fast
                    error = vote = exc
            self._error, self._reported = None, error is not None
            self._thread = threading.Thread(target=self._run, args=(job, flat, vote),
                                            name="ringlet-checkpoint", daemon=True)
            self._thread.start()
            if error is not None:
                raise error

    def _run(self, job: SaveJob, flat: Optional[Dict[str, Any]],
             error: Optional[BaseException]) -> None:
        try:
            job.plan(flat, error)
            err, summary = job.write()
            job.commit(err, summary)
        except BaseException as exc:  # noqa: BLE001 - surfaced by wait()
            self._error = exc

    def _join(self, timeout: Optional[float]) -> bool:
        t = self._thread
        if t is None:
            return True
        t.join(timeout)
        return not t.is_alive()

    def _raise_pending(self) -> None:
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error

    def done(self) -> bool:
        """True when no save is in flight (the last one committed or failed)."""
        t = self._thread
        return t is None or not t.is_alive()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the in-flight save (if any) is committed; raise its error.

        Args:
            timeout: seconds to wait (None: until the save finishes, which its
                own collectives' timeouts bound).
        Raises:
            TimeoutError: the save is still running after ``timeout``.
            CheckpointError, OSError, RingletError, ...: the save failed (each
                error is raised once).
        """
        if timeout is not None:
            timeout = seconds(timeout, zero=True)
        if not self._join(timeout):
            raise TimeoutError(f"the background checkpoint save is still running after "
                               f"{timeout}s")
        self._raise_pending()

    def close(self) -> None:
        """Wait for the in-flight save; raise its error."""
        self.wait()

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - do not mask the exception already leaving
            if exc_type is None:
                raise
