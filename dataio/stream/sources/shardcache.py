"""A local disk cache of remote shards (``data.cache_dir``, ``data.cache_limit``), shared by every
process of a node: loader workers and ranks download each shard once and read it through the same
memory map as a local shard.

Layout under ``cache_dir``: one folder per dataset, named by a digest of its URL and its index (a
re-indexed dataset gets a new folder, so a stale shard is never read as current), holding

- ``<shard>``: complete shards only (the shard's name, ``/`` and a leading ``.`` percent-encoded);
- ``.parts/<shard>.<pid>.<hex>``: a download in progress, renamed to ``<shard>`` once its size equals
  the index's and it is on disk (``fsync``), so a complete name never holds a partial file;
- ``.locks/<shard>``: the shard's ``flock`` lock file.

Protocol (``flock`` on the shard's lock file; the kernel drops a dead process's locks):

- *use*: a process holds a shared lock for as long as it has the shard mapped;
- *download*: a process that finds no shard takes the exclusive lock (waiting for any other
  downloader), looks again, fetches the shard in ``CHUNK`` ranged reads (each retried with the
  loader's backoff), checks the size, renames; the processes that waited then find it and map it;
- *evict*: under the cache-wide lock (``.lock`` in ``cache_dir``), when the bytes on disk plus the
  incoming shard exceed ``cache_limit``, shards are removed least recently used first (their mtime,
  touched at every map), each only when its exclusive lock is free right now (``LOCK_NB``): a shard
  some process has mapped is never removed. Stale ``.parts`` files (their downloader died) go first.
  The incoming shard's bytes are reserved (``posix_fallocate`` of its part file) before that lock is
  released, so concurrent downloads account for each other.

Unlinking a mapped file is safe on Linux (the pages live until the last map goes), but its disk space
is only freed then, and the size scan would not see it: hence shards in use are skipped, not unlinked.
If the shards in use alone exceed the limit, the download goes ahead over it, with a warning.

Cost: a hit is an ``open`` + ``flock`` + ``utime`` + ``mmap`` per shard and process; a miss adds the
download and, with a limit, one scan of the cache's folders (a ``stat`` per cached shard).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from headrace.config import ConfigError
from headrace.dataio.shards.index import DatasetIndex
from headrace.dataio.stream.sources.storage import ShardFormatError, retry

log = logging.getLogger(__name__)

CHUNK = 64 << 20  # bytes per ranged read of a download (a failed read redoes one chunk, not the shard)
LOCKS, PARTS = ".locks", ".parts"


def dataset_folder(url: str, index: DatasetIndex) -> str:
    """The cache folder name of a dataset: a digest of its URL and of its shards' names, sizes and checksums."""
    shards = [[s.name, s.bytes, s.sha256] for s in index.shards]
    return hashlib.blake2b(json.dumps([url, shards]).encode(), digest_size=12).hexdigest()


def local_name(shard_name: str) -> str:
    """A shard's file name in its cache folder: one path component, never hidden, never ``..``."""
    name = quote(shard_name, safe="")
    return "%2E" + name[1:] if name.startswith(".") else name


def lock(path: Path, mode: int) -> int | None:
    """A descriptor of ``path`` (created if missing) holding ``flock`` ``mode``; None when ``mode``
    has ``LOCK_NB`` and the lock is taken. Retries when the file was unlinked (evicted) while this
    process waited on it, so a lock is always on the file the path names now."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            os.close(fd)
            return None
        if _current(fd, path):
            return fd
        os.close(fd)


def unlock(fd: int) -> None:
    """Release a lock from ``lock`` (``LOCK_UN`` first: a forked child may still hold a copy of ``fd``)."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@dataclass
class Entry:
    path: Path
    size: int
    mtime: float
    lock: Path  # the lock file deciding whether ``path`` may be removed


class ShardCache:
    """The cache in ``root`` with at most ``limit`` bytes of shards (None: no limit); one per loader,
    shared by its datasets (the runtime object of ``data.cache_dir`` / ``data.cache_limit``)."""

    def __init__(self, root: str, limit: int | None = None):
        self.root, self.limit = Path(root).expanduser(), limit
        self._warned = False

    def folder(self, url: str, index: DatasetIndex) -> Path:
        """The dataset's cache folder, with its lock and part folders made (once per source, not per shard)."""
        folder = self.root / dataset_folder(url, index)
        for d in (folder / LOCKS, folder / PARTS):
            d.mkdir(parents=True, exist_ok=True)
        return folder

    def check_fits(self, url: str, shard_bytes: dict[str, int]) -> None:
        """ConfigError when the largest shard of dataset ``url`` alone is over ``cache_limit``."""
        name, size = max(shard_bytes.items(), key=lambda kv: kv[1], default=("", 0))
        if self.limit is not None and size > self.limit:
            raise ConfigError(
                f"data.cache_limit: {self.limit} bytes cannot hold shard {name} of {url} ({size} bytes); "
                f"the limit must hold at least the shards every process of the node has open"
            )

    def acquire(
        self,
        folder: Path,
        shard_name: str,
        url: str,
        size: int,
        storage_options: dict | None,
    ) -> tuple[Path, int]:
        """``(local path, descriptor holding the shard's shared lock)`` of the complete cached shard,
        downloading ``url`` (``size`` bytes) first when it is not there. Release with ``unlock``."""
        name = local_name(shard_name)
        local, lock_path = folder / name, folder / LOCKS / name
        while True:
            fd = lock(lock_path, fcntl.LOCK_SH)
            if local.exists():
                os.utime(local)  # least recently used = oldest mtime
                return local, fd
            fcntl.flock(fd, fcntl.LOCK_UN)  # not there: become its downloader, or wait for the one that is
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if _current(fd, lock_path) and not local.exists():
                    self._download(folder, name, url, size, storage_options)
            finally:
                unlock(fd)  # and look again under a shared lock

    def _download(self, folder: Path, name: str, url: str, size: int, storage_options: dict | None) -> None:
        import fsspec

        for stale in (folder / PARTS).iterdir():  # a dead downloader's (the exclusive lock is ours)
            if _part_of(stale) == name:
                stale.unlink(missing_ok=True)
        part = folder / PARTS / f"{name}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            with open(part, "wb") as out:
                self._reserve(out.fileno(), size)
                fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
                for start in range(0, size, CHUNK):
                    end = min(start + CHUNK, size)
                    data = retry(
                        lambda s=start, e=end: fs.cat_file(path, start=s, end=e),
                        f"{url}: downloading bytes {start}..{end} into {self.root}",
                    )
                    if len(data) != end - start:
                        raise ShardFormatError(
                            f"truncated shard: {start + len(data)} bytes, the index says {size}", shard=url
                        )
                    out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.rename(part, folder / name)
        finally:
            part.unlink(missing_ok=True)

    def _reserve(self, fd: int, size: int) -> None:
        """Make room for ``size`` more bytes and claim them (the part file's blocks), under the cache lock."""
        if self.limit is None:
            return
        cache_lock = lock(self.root / ".lock", fcntl.LOCK_EX)
        try:
            entries = self._entries()
            used = sum(e.size for e in entries)
            for e in entries:  # stale parts first (mtime 0), then shards, least recently used first
                if used + size <= self.limit:
                    break
                fd_e = lock(e.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if fd_e is None:  # mapped by some process, or being downloaded
                    continue
                try:
                    e.path.unlink(missing_ok=True)
                    if e.path.parent.name != PARTS:
                        e.lock.unlink(missing_ok=True)
                finally:
                    unlock(fd_e)
                used -= e.size
            if used + size > self.limit and not self._warned:
                self._warned = True
                log.warning(
                    "%s: the shards in use (%d bytes) leave no room for a %d-byte shard under cache_limit %d; "
                    "downloading over the limit (fewer ranks/workers per node or a larger limit avoid this)",
                    self.root,
                    used,
                    size,
                    self.limit,
                )
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate: no claim
                    raise
                os.truncate(fd, size)
        finally:
            unlock(cache_lock)

    def _entries(self) -> list[Entry]:
        """Every cached shard and part file, eviction order first (parts, then oldest mtime)."""
        entries = []
        for folder in self.root.iterdir() if self.root.is_dir() else ():
            if not folder.is_dir():
                continue
            for path in folder.iterdir():
                if path.name not in (LOCKS, PARTS):
                    entries.append(_entry(path, folder / LOCKS / path.name))
            for path in (folder / PARTS).iterdir() if (folder / PARTS).is_dir() else ():
                entries.append(_entry(path, folder / LOCKS / _part_of(path), stale=True))
        entries = [e for e in entries if e is not None]
        return sorted(entries, key=lambda e: e.mtime)


def _entry(path: Path, lock_path: Path, stale: bool = False) -> Entry | None:
    try:
        st = path.stat()
    except FileNotFoundError:  # removed since the listing
        return None
    return Entry(path=path, size=st.st_size, mtime=0.0 if stale else st.st_mtime, lock=lock_path)


def _part_of(part: Path) -> str:
    """The shard name of a part file ``<shard>.<pid>.<hex>``."""
    return part.name.rsplit(".", 2)[0]


def _current(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


__all__ = ["ShardCache", "dataset_folder", "local_name", "lock", "unlock"]
