"""Random access to the samples of one indexed dataset, local or remote, by byte offset.

A local shard is memory-mapped once per process: reading sample ``i`` is a slice of the map at the
offset the index gives (no syscall, no tar parsing, no copy; the page cache does the block reads and
the kernel's read-ahead turns a window of nearby samples into large sequential reads). The map is
``ACCESS_COPY`` (private, copy-on-write): reading shares the page cache exactly like a read-only map,
but the buffers are writable, so numpy/torch views need no read-only special case. A remote shard
(any fsspec URL: ``s3://`` with the ``s3`` extra, ``gs://``, ``http(s)://``, ``file://``) is read through
an fsspec file with a block cache of ``REMOTE_BLOCK`` bytes, so nearby samples come from one ranged
GET; transient storage errors (``OSError``, timeouts) are retried with exponential backoff before they
count as failures. With a ``ShardCache`` (``data.cache_dir``) a remote shard is instead downloaded whole
on first use (``headrace.dataio.stream.sources.shardcache``) and mapped like a local one; a source keeps at most
``OPEN_CACHED_SHARDS`` such maps, each holding its shard in the cache until the map is closed.

Maps and remote files are held in the loader's one ``OpenShards`` (``headrace.dataio.stream.sources.openshards``):
least recently used, at most ``data.max_open_shards`` per process across all the loader's sources, so a
dataset of any number of shards runs within the process's descriptor and map limits.

Every read checks that the tar header right before the sample's first payload names the sample's key
(one short ``bytes`` compare), so an index that disagrees with its tar is an error naming the shard and
key instead of silently wrong data; a shard shorter than its index says is reported when it is opened. A
local shard is one version for the loader's life: its (inode, mtime) when first mapped by any of the
loader's processes is kept in memory shared with its workers, and every map (a reopen after eviction
included) and every read (one ``stat``, which the size check needs anyway) compares against it, so a
shard rewritten or replaced in place, even at the same size, is an error naming it rather than new bytes
under the index's (and gather's checked) old keys.
``headrace.dataio.stream.reading.gather`` does the same check for token datasets a block of samples at a time.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import stat
from dataclasses import dataclass

import numpy as np

from headrace.dataio.stream.sources.openshards import OpenShards, new_owner
from headrace.dataio.stream.sources.shardcache import ShardCache, local_name, unlock
from headrace.dataio.stream.sources.storage import ShardFormatError, retry
from headrace.dataio.shards.index import INDEX_DIR, DatasetIndex, index_from_files, load_index
from headrace.dataio.shards.shardtable import shard_sample_counts, split_ids

REMOTE_BLOCK = 8 << 20
OPEN_CACHED_SHARDS = 4
TAR_NAME_FIELD = 100  # bytes of the ustar name field; longer keys live in a pax/GNU long-name record


def by_value(values: np.ndarray) -> list[tuple[int, np.ndarray | slice]]:
    """``(value, where)`` for each distinct value of a 1-D array; a batch is usually all one dataset,
    shard or epoch, which costs one min/max here instead of ``np.unique`` and a mask."""
    if not len(values) or values.min() == values.max():
        return [(int(values[0]), slice(None))] if len(values) else []
    # sorted(set()), not np.unique: that imports numpy.ma on first use (~90 ms in each fresh worker)
    return [(v, np.flatnonzero(values == v)) for v in sorted(set(values.tolist()))]


def shard_counts(index: DatasetIndex) -> np.ndarray:
    """Samples per shard from the shard table (O(shards)); counted over the per-sample rows (O(samples),
    a temporary of 8 bytes a sample) only where the table's counts do not add up to the rows."""
    counts = shard_sample_counts(index.shards)
    if counts.sum() != len(index.samples):
        counts = np.bincount(index.samples["shard"], minlength=len(index.shards)).astype(np.int64)
    return counts


class SplitError(ValueError):
    """A dataset has no shards in the split asked for."""


def load_remote_index(url: str, storage_options: dict | None = None) -> DatasetIndex:
    """The headrace index of a dataset behind an fsspec URL (a few files, read whole)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    d = f"{root.rstrip('/')}/{INDEX_DIR}"
    manifest = json.loads(retry(lambda: fs.cat_file(f"{d}/manifest.json"), f"{url}: reading the index"))
    return index_from_files(
        manifest,
        f"{url}/{INDEX_DIR}/manifest.json",
        lambda name: np.load(io.BytesIO(retry(lambda: fs.cat_file(f"{d}/{name}"), url)), allow_pickle=False),
        lambda name: retry(lambda: fs.exists(f"{d}/{name}"), url),
    )


def open_remote(url: str, storage_options: dict | None = None):
    """A block-cached fsspec file; the block options go to ``fs.open``, not ``fsspec.open``, which would
    hand them to the filesystem's constructor (s3fs passes them on to botocore, which refuses them)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs.open(path, "rb", block_size=REMOTE_BLOCK, cache_type="blockcache")


class ShardSource:
    """One dataset (one split of an indexed directory or URL): sample indices -> raw member bytes."""

    def __init__(
        self,
        path: str,
        *,
        split: str = "train",
        index: DatasetIndex | None = None,
        storage_options: dict | None = None,
        cache: ShardCache | None = None,
        open_shards: OpenShards | None = None,
    ):
        self.path, self.storage_options = path, storage_options
        # the loader's one bounded set of open maps/files (its own when the source stands alone)
        self.open_shards = open_shards if open_shards is not None else OpenShards()
        self._owner = new_owner()
        self.remote = "://" in path and not path.startswith("file://")
        self.cache = cache if self.remote else None
        self.ranged = self.remote and self.cache is None  # read by ranged GETs, not through a map
        if index is None:
            index = load_remote_index(path, storage_options) if "://" in path else load_index(path)
        self.index = index
        shard_ids = split_ids(index.shards, split)
        if not len(shard_ids):
            splits = sorted({s.split for s in index.shards})
            raise SplitError(f"{path}: no shards in split {split!r} (splits: {', '.join(splits) or 'none'})")
        counts = shard_counts(index)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.shard_starts, self.shard_sizes = starts[shard_ids], counts[shard_ids]
        # bytes each shard must have for its indexed samples (0: none of this split; 8 bytes a shard, no dict)
        self._needed = np.zeros(len(index.shards), dtype=np.int64)
        ids = shard_ids[counts[shard_ids] > 0]
        last = starts[ids] + counts[ids] - 1
        self._needed[ids] = index.samples["offset"][last].astype(np.int64) + index.samples["size"][last].astype(
            np.int64
        )
        self._ext_names = list(index.extensions)
        if self.cache is not None:
            self._cache_folder = self.cache.folder(path, index)
            self.cache.check_fits(path, {index.shards[s].name: self._shard_bytes(s) for s in shard_ids.tolist()})
        # (inode, mtime_ns) of each local shard as the first process to map it found it, in memory shared
        # with the workers forked later: every process then reads one version of each file (_check_stamp)
        self._stamp_memory = mmap.mmap(-1, 16 * max(1, len(index.shards)))
        self._first_stamps = np.frombuffer(self._stamp_memory, dtype=np.int64).reshape(-1, 2)

    def __len__(self) -> int:
        return int(self.shard_sizes.sum())

    def shard_path(self, shard: int) -> str:
        return f"{self.path.rstrip('/')}/{self.index.shards[shard].name}"

    def read(self, indices: np.ndarray) -> list[tuple[str, str, dict[str, memoryview | bytes]]]:
        """``(key, shard path, {ext: payload})`` of each global sample index; payloads are views where possible."""
        idx = np.asarray(indices, dtype=np.int64)
        rows = self.index.samples[idx]
        counts = rows["member_count"].astype(np.int64)
        first = np.repeat(rows["member_start"].astype(np.int64), counts)
        member_rows = first + np.arange(len(first)) - np.repeat(np.cumsum(counts) - counts, counts)
        members = self.index.members[member_rows]
        exts = [self._ext_names[e] for e in members["ext"].tolist()]
        offsets, sizes = members["offset"].tolist(), members["size"].tolist()
        keys = self.index.keys[idx].tolist()
        shards = rows["shard"].tolist()
        mbase = (np.cumsum(counts) - counts).tolist()  # each sample's first row of ``members``
        distinct = set(shards)
        paths = {s: self.shard_path(s) for s in distinct}
        # A read over more shards than half the open-shard budget (a packing buffer's worth of samples of
        # a dataset with many small shards) copies the payloads out shard by shard instead of handing out
        # views, which would keep every one of those maps (and descriptors) alive past the budget.
        copy = not self.ranged and len(distinct) > self.open_shards.budget // 2
        if copy:
            order = np.argsort(rows["shard"], kind="stable").tolist()
            ends = self._read_ends(rows)
        else:
            order = range(len(shards))
            # local: each shard's map looked up once per call, not once per sample; a shard that shrank
            # since it was mapped is an error here, before a page past its end is touched
            maps = {} if self.ranged else {s: self._map(s, self._read_end(rows, s)) for s in distinct}
        starts, out, current, buf = rows["offset"].tolist(), [None] * len(shards), None, None
        for i in order:
            shard, start, key, n, m = shards[i], starts[i], keys[i], int(counts[i]), mbase[i]
            if self.ranged:
                buf, base = self._read_remote(shard, start, offsets[m + n - 1] + sizes[m + n - 1] - start), start
            elif copy:
                if shard != current:
                    buf, current = self._map(shard, ends[shard]), shard
                base = 0
            else:
                buf, base = maps[shard], 0
            first_payload = offsets[m] - base
            header = first_payload - 512
            if (
                buf[header : header + len(key) + 1] != key + b"."  # fast path: the ustar name field
                and key.rpartition(b"/")[2] + b"." not in bytes(buf[start - base : first_payload])
            ):  # long names
                raise ShardFormatError(
                    f"the tar at byte {start} does not hold this sample, which the index places there"
                    f"  (index out of date? run `dataio index {self.path}`)",
                    shard=paths[shard],
                    key=key.decode(errors="replace"),
                )
            payloads = {
                exts[m + t]: buf[offsets[m + t] - base : offsets[m + t] - base + sizes[m + t]] for t in range(n)
            }
            if copy:
                payloads = {ext: bytes(p) for ext, p in payloads.items()}
            out[i] = (key.decode(errors="surrogateescape"), paths[shard], payloads)
        return out

    def array(self, shard: int, end: int = 0) -> np.ndarray:
        """A local shard's map as a ``uint8`` array (made once per shard while it is open), after ``_map``'s
        check that the file still holds byte ``end - 1`` (one ``stat`` per call: call it once per batch and shard)."""
        entry = self._entry(shard, end)
        if entry.array is None:
            entry.array = np.frombuffer(entry.view, dtype=np.uint8)
        return entry.array

    def indexed_array(self, shard: int) -> np.ndarray:
        """``array`` after checking that the file still holds every byte the index places in the shard:
        one check a shard per batch, whichever of its samples the batch reads."""
        return self.array(shard, int(self._needed[shard]))

    @staticmethod
    def _read_ends(rows: np.ndarray) -> dict[int, int]:
        """``_read_end`` of every shard of ``rows`` at once (one sort, not a mask per shard)."""
        order = np.argsort(rows["shard"], kind="stable")
        shard = rows["shard"][order]
        end = (rows["offset"] + rows["size"])[order]
        first = np.flatnonzero(np.r_[True, shard[1:] != shard[:-1]])
        return dict(zip(shard[first].tolist(), np.maximum.reduceat(end, first).tolist()))

    @staticmethod
    def _read_end(rows: np.ndarray, shard: int) -> int:
        """One past the last byte a read of ``rows`` touches in ``shard``."""
        mine = rows["shard"] == shard
        return int((rows["offset"][mine] + rows["size"][mine]).max())

    def _map(self, shard: int, end: int = 0) -> memoryview:
        return self._entry(shard, end).view

    def _entry(self, shard: int, end: int = 0) -> MappedShard:
        """The shard's open map (from the loader's bounded ``OpenShards``, opened if it was closed), after
        checking (one ``stat``) that the file still holds byte ``end - 1`` and is the version mapped:
        touching a mapped page past the end of a file that was truncated under us is SIGBUS, which kills
        the process with no message (in a worker: "killed by signal SIGBUS", see
        ``RankStream.explain_worker_crash``); a local shard rewritten or replaced in place (its inode or
        mtime changed: the map shows new bytes where the index and the checks of
        ``headrace.dataio.stream.reading.gather`` describe the old) is an error naming it. A change between this
        check and the batch's copy is not caught (microseconds; a signal handler cannot resume a faulting access)."""
        entry = self.open_shards.get(self._owner, shard)
        if entry is None:
            if self.cache is not None:  # before the download: what this frees may make room for it
                self.open_shards.trim(self._owner, OPEN_CACHED_SHARDS - 1)
            self.open_shards.make_room()
            entry = self._open_map(shard)
            self.open_shards.add(self._owner, shard, entry)
        try:
            st = os.stat(entry.path)
        except FileNotFoundError:
            raise ShardFormatError(
                "shard removed since it was mapped (deleted under the loader?)", shard=self.shard_path(shard)
            ) from None
        if st.st_size < end:
            raise ShardFormatError(
                f"shard shrank to {st.st_size} bytes while mapped (modified under the loader?); "
                f"this read needs bytes up to {end}",
                shard=self.shard_path(shard),
            )
        if self.cache is None and (st.st_ino, st.st_mtime_ns) != entry.stamp:
            raise ShardFormatError(
                "shard changed since it was mapped (rewritten under the loader?): its samples "
                "no longer match the index",
                shard=self.shard_path(shard),
            )
        return entry

    def _open_map(self, shard: int) -> MappedShard:
        """A local or cached shard mapped, its version recorded; holds no descriptor but the map's own."""
        lock_fd = None
        if self.cache is not None:
            path, lock_fd = self.cache.acquire(
                self._cache_folder,
                self.index.shards[shard].name,
                self.shard_path(shard),
                self._shard_bytes(shard),
                self.storage_options,
            )
        else:
            path = self._disk_path(shard)
        try:
            file = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO would block without it
            try:
                st = os.fstat(file)
                if not stat.S_ISREG(st.st_mode):
                    raise ShardFormatError(
                        "not a regular file (a FIFO, device or directory in the shard's place)",
                        shard=self.shard_path(shard),
                    )
                self._check_size(shard, st.st_size)
                stamp = (st.st_ino, st.st_mtime_ns)
                if self.cache is None:
                    self._check_stamp(shard, stamp)
                mapped = mmap.mmap(file, 0, access=mmap.ACCESS_COPY) if st.st_size else None
            finally:
                os.close(file)  # the map holds its own duplicate
        except BaseException:
            if lock_fd is not None:
                unlock(lock_fd)
            raise
        return MappedShard(
            mapped=mapped,
            view=memoryview(mapped) if mapped is not None else memoryview(b""),
            path=str(path),
            stamp=stamp,
            lock_fd=lock_fd,
        )

    def _check_stamp(self, shard: int, stamp: tuple[int, int]) -> None:
        """Record the first (inode, mtime) any process of this loader mapped the shard with; a later
        map of another version (the file was replaced or rewritten meanwhile) is an error naming it."""
        first = self._first_stamps[shard]
        if not first.any():
            first[:] = stamp
        elif tuple(first.tolist()) != stamp:
            raise ShardFormatError(
                "shard changed since the loader first read it (rewritten or replaced under the "
                "loader?): its samples no longer match the index",
                shard=self.shard_path(shard),
            )

    def _shard_bytes(self, shard: int) -> int:
        """The shard's size from the index (its last indexed byte when the index has no size)."""
        return self.index.shards[shard].bytes or int(self._needed[shard])

    def check_sizes(self) -> None:
        """ShardFormatError naming the first local (or cached) shard now shorter than its index needs (one
        ``stat`` a shard): how a worker's SIGBUS is traced back to the shard that shrank under it."""
        if self.ranged:
            return
        for shard in np.flatnonzero(self._needed).tolist():
            path = self._disk_path(shard)
            if self.cache is not None and not os.path.exists(path):
                continue
            self._check_size(shard, os.stat(path).st_size)

    def _disk_path(self, shard: int) -> str:
        """Where the shard's bytes lie on this machine: its cache file (present or not), else its local path."""
        if self.cache is not None:
            return str(self._cache_folder / local_name(self.index.shards[shard].name))
        return self.shard_path(shard).removeprefix("file://")

    def _check_size(self, shard: int, size: int) -> None:
        needed = int(self._needed[shard])
        if size < needed:
            raise ShardFormatError(
                f"truncated shard: {size} bytes, the index needs {needed}", shard=self.shard_path(shard)
            )

    def _read_remote(self, shard: int, start: int, size: int) -> bytes:
        def attempt():
            entry = self.open_shards.get(self._owner, shard)
            if entry is None:
                self.open_shards.make_room()
                f = open_remote(self.shard_path(shard), self.storage_options)
                try:
                    self._check_size(shard, f.size)
                except BaseException:
                    f.close()
                    raise
                entry = RemoteShard(file=f)
                self.open_shards.add(self._owner, shard, entry)
            try:
                entry.file.seek(start)
                data = entry.file.read(size)
            except Exception:
                self.open_shards.discard(self._owner, shard)  # reopen on the next attempt
                raise
            if len(data) != size:
                raise ShardFormatError(f"truncated shard: short read at byte {start}", shard=self.shard_path(shard))
            return data

        return retry(attempt, f"{self.shard_path(shard)}: reading bytes {start}..{start + size}")


@dataclass(kw_only=True, eq=False)
class MappedShard:
    """A mapped local (or cached) shard: an entry of ``OpenShards``."""

    mapped: mmap.mmap | None  # None: an empty file
    view: memoryview | None
    path: str  # the file mapped (``stat``ed before each batch's reads)
    stamp: tuple[int, int]  # its (inode, mtime_ns) when mapped
    lock_fd: int | None  # a cached shard's shared cache lock, held while the map lives
    array: np.ndarray | None = None

    def close(self) -> bool:
        # dropped, not released: a batch being read may hold this very view (or an array of it)
        self.array = self.view = None
        if self.mapped is not None:
            try:
                self.mapped.close()
            except BufferError:  # a payload view is alive: a local map goes when the last view does
                if self.lock_fd is not None:
                    return False  # a cached one keeps its lock until it really is unmapped: retried
        self.mapped = None
        if self.lock_fd is not None:
            unlock(self.lock_fd)
            self.lock_fd = None
        return True

    def forget(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # the parent's lock: closed here, never unlocked (that would free the parent's)
        self.mapped = self.view = self.array = None  # unmapped in this process when the last reference goes


@dataclass(kw_only=True, eq=False)
class RemoteShard:
    """A block-cached fsspec file of a shard read by ranged GETs: an entry of ``OpenShards``."""

    file: object

    def close(self) -> bool:
        self.file.close()
        return True

    def forget(self) -> None:
        self.file = None


__all__ = ["MappedShard", "RemoteShard", "ShardSource", "SplitError", "by_value", "load_remote_index", "open_remote"]
