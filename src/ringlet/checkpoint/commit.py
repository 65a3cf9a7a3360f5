"""Atomic replacement of a checkpoint directory (run by group rank 0 only).

Names, for a checkpoint at ``parent/name``:

* ``parent/.name.tmp-<random>``: the save being written;
* ``parent/.name.old``: the previous checkpoint, moved aside during a commit.

The commit, after every rank has written and fsynced its shard file:

1. write ``manifest.json`` into the temporary directory, fsync it and the
   directory;
2. if ``name`` exists: rename it to ``.name.old``, fsync ``parent``;
3. rename the temporary directory to ``name``, fsync ``parent``;
4. rename ``.name.old`` to ``.name.trash-<random>``, fsync ``parent``, remove
   it (best effort: the save is committed; the next save tidies what is left).

A crash (SIGKILL, power loss) at any point leaves a loadable checkpoint:

* before step 2 completes: ``name`` is the old checkpoint, untouched; the
  temporary directory is garbage (removed by the next save);
* between 2 and 3: ``name`` is missing and ``.name.old`` is the complete old
  checkpoint: ``load`` reads it from there, the next save renames it back
  (also when something has since made ``name`` an empty directory);
* after 3: ``name`` is the new checkpoint; a leftover ``.name.old`` (whole or
  half removed) is deleted by the next save.

``name`` itself never holds a mix: its content only ever changes by a
rename of a complete directory, and renames within one filesystem are
atomic.  This needs the temporary directory on the same filesystem as
``name`` (it is its sibling) and, with several ranks, a filesystem every rank
sees (shared, e.g. NFS/Lustre/GPFS or one machine's disk).
"""

from __future__ import annotations

import os
import secrets
import shutil
from typing import Optional

from .format import FORMAT, MANIFEST, fsync_dir, is_checkpoint_dir


def _failpoint(name: str) -> None:
    """A no-op; crash tests replace it to kill the process at commit step ``name``."""


def old_path(path: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.old")


def _tmp_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.tmp-"


def _trash_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.trash-"


def _ours(path: str) -> bool:
    """``path`` holds a checkpoint ringlet wrote, not only some file named manifest.json
    (another tool's directory, which a save must never replace and delete).

    The format tag is searched in the raw bytes, so a checkpoint whose manifest is
    damaged elsewhere can still be replaced by a new save.
    """
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            return f'"format": "{FORMAT}"'.encode() in f.read()
    except OSError:
        return False


def _makedirs_durably(directory: str) -> None:
    """``os.makedirs``, then fsync the parent of every directory it created: a
    checkpoint committed into a new directory must not vanish with it on power loss."""
    created = []
    d = directory
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        created.append(d)
        d = os.path.dirname(d)
    os.makedirs(directory, exist_ok=True)
    for d in created:
        fsync_dir(os.path.dirname(d))


def _vacant(path: str) -> bool:
    """``path`` holds no checkpoint and nothing else: missing, or an empty directory
    (say, made by start-up code after a crash between steps 2 and 3)."""
    if not os.path.lexists(path):
        return True
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def _discard(path: str, old: str) -> None:
    """Step 4: move ``old`` out of the way, then remove it, best effort.

    The new checkpoint is committed by then: a file that will not go (an open
    file's ``.nfs*`` stand-in on NFS) leaves garbage for the next save to
    tidy, never a failed save or a ``.name.old`` that blocks the next commit.
    """
    parent = os.path.dirname(path)
    trash = os.path.join(parent, _trash_prefix(path) + secrets.token_hex(8))
    try:
        os.rename(old, trash)
        fsync_dir(parent)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def recover(path: str) -> None:
    """Finish what a crashed commit left: restore or remove ``.name.old``.

    Raises:
        FileExistsError: ``.name.old`` holds the latest checkpoint but ``path``
            holds something else; ringlet removes neither.
    """
    old = old_path(path)
    if not os.path.lexists(old):
        return
    parent = os.path.dirname(path)
    if _ours(path) or not is_checkpoint_dir(old):
        _discard(path, old)  # crash after step 3 (or during step 4)
        return
    # A crash between steps 2 and 3: the old one is the latest checkpoint.
    if not _vacant(path):
        raise FileExistsError(f"{old!r} holds the latest checkpoint (a commit crashed after "
                              f"moving it aside) but {path!r} holds something else; move one "
                              f"of them away")
    if os.path.lexists(path):
        os.rmdir(path)
    os.rename(old, path)
    fsync_dir(parent)


def resolve_for_load(path: str) -> str:
    """The directory ``load`` should read: ``path``, or its old copy after a crash."""
    if is_checkpoint_dir(path):
        return path
    old = old_path(path)
    if _vacant(path) and is_checkpoint_dir(old):
        return old
    if os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a checkpoint (it has no manifest.json)")
    raise FileNotFoundError(f"no checkpoint at {path!r}")


def prepare(path: str) -> str:
    """Check ``path`` may be (re)placed, tidy leftovers, create the temporary directory.

    Returns:
        The temporary directory's path.
    Raises:
        FileExistsError: ``path`` exists and is neither a checkpoint nor an
            empty directory (ringlet never replaces other data, also not a
            directory whose manifest.json another tool wrote).
    """
    parent = os.path.dirname(path)
    _makedirs_durably(parent)
    recover(path)
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise FileExistsError(f"{path!r} exists and is not a directory; refusing to "
                                  f"replace it with a checkpoint")
        if os.listdir(path) and not _ours(path):
            how = (" (its manifest.json was not written by ringlet)"
                   if is_checkpoint_dir(path) else "")
            raise FileExistsError(f"{path!r} is a non-empty directory that is not a ringlet "
                                  f"checkpoint{how}; refusing to replace it")
    prefixes = (_tmp_prefix(path), _trash_prefix(path))
    for entry in os.listdir(parent):
        if entry.startswith(prefixes):  # left by a save that crashed, or by step 4
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    tmp = os.path.join(parent, _tmp_prefix(path) + secrets.token_hex(8))
    os.mkdir(tmp)
    return tmp


def commit(tmp: str, path: str) -> None:
    """Steps 2-4 above; the manifest is already in ``tmp`` and fsynced."""
    parent = os.path.dirname(path)
    fsync_dir(tmp)
    _failpoint("manifest")
    old: Optional[str] = None
    if os.path.lexists(path):
        old = old_path(path)
        os.rename(path, old)
        fsync_dir(parent)
        _failpoint("aside")
    os.rename(tmp, path)
    fsync_dir(parent)
    _failpoint("renamed")
    if old is not None:
        _discard(path, old)


def abort(tmp: Optional[str]) -> None:
    """Remove a failed save's temporary directory (best effort)."""
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
