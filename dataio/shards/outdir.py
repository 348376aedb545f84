"""Who may write an output directory: an advisory lock for ``dataio shard`` / ``dataio index``, and
the removal of the temp files a killed run left.

The lock is a POSIX record lock (``fcntl.lockf``) on ``DIR/.dataio.lock``: the kernel drops it when
the holding process dies, however it dies (kill -9 included), so a crashed job never leaves it stuck,
and NFS carries it to other hosts through its lock manager. ``dataio shard`` node ``r`` locks byte
``r + 1`` only, so the nodes of one multi-node job write the directory side by side while a second
job for the same node is refused; ``dataio index`` (which rewrites everything and removes temps)
locks the whole file, so it excludes every writer and every writer excludes it. Cost: one open and
one ``fcntl`` call per command.
"""

from __future__ import annotations

import errno
import fcntl
import shutil
from pathlib import Path

from headrace.dataio.shards.index import META_DIR
from headrace.dataio.usererror import UserError


class OutputLocked(RuntimeError, UserError):
    """Another ``dataio shard`` / ``dataio index`` holds a conflicting lock on the output directory."""


LOCK_FILE = ".dataio.lock"  # hidden: never taken for a shard; outside .nv-meta, whose presence means "indexed"


def lock_output(root: Path, *, node: int | None, command: str):
    """Lock ``root`` for ``command`` (``node``: the shard node rank; None: the whole directory).

    Returns the open lock file: keep a reference while writing (closing it releases the lock).
    OutputLocked when another process holds a conflicting lock.
    """
    Path(root).mkdir(parents=True, exist_ok=True)
    start, length = (0, 0) if node is None else (node + 1, 1)  # length 0: the whole file and beyond
    f = try_lock(Path(root) / LOCK_FILE, start=start, length=length)
    if f is None:
        whom = "the whole directory" if node is None else f"node {node}"
        raise OutputLocked(
            f"{root} is being written by another `dataio shard` or `dataio index` (conflicting "
            f"with {command} for {whom}); wait for it to finish or use another output "
            "directory"
        )
    return f


def try_lock(path: Path, *, start: int = 0, length: int = 0):
    """``path`` opened for appending with an exclusive record lock on ``length`` bytes from ``start`` (0: the
    whole file and beyond), or None when another process holds a conflicting one. Closing the file (or the
    process dying) releases it."""
    f = open(path, "ab")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start)
    except OSError as e:
        f.close()
        if e.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        return None
    return f


def remove_temps(root: Path) -> list[Path]:
    """Delete every temp file or directory a killed writer left under ``root`` (``*.tmp-*`` from
    ``write_atomically``, index parts and the sqlite index; ``headrace.tmp-*`` / ``.old-*`` index
    directories). Only safe while holding the whole-directory lock. Returns what was removed."""
    root = Path(root)
    stale = [p for p in root.glob("**/*.tmp-*")] + list((root / META_DIR).glob("headrace.old-*"))
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return stale


__all__ = ["LOCK_FILE", "OutputLocked", "lock_output", "remove_temps", "try_lock"]
