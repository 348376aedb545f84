"""Random access to one sample of an indexed dataset by its key: ``open_dataset(DIR)[key]``.

The key is found by binary search over the index's mapped ``keys.npy`` / ``key_order.npy``
(``DatasetIndex.find``: about log2(n) compares, no key loaded into the heap), then the sample's members
are read with one ``pread`` each from its shard, after checking that the tar header in front of the
first member names the key (an index out of date with its tar is an error, not wrong bytes). Cost:
opening is reading the per-shard table (``load_index``); a look-up is ~log2(n) page touches of the
maps, one ``open`` and a ``pread`` per member. The shards are only read (webdataset and energon read
the same files).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from headrace.dataio.shards.index import INDEX_DIR, DatasetIndex, load_index

TAR_HEADER = 512


class SampleNotFound(KeyError):
    """No sample of the dataset has this key."""

    def __str__(self) -> str:  # KeyError's own would quote the whole message
        return str(self.args[0])


class IndexMismatch(ValueError):
    """The index places a sample where its tar holds something else (re-index the directory)."""


class Dataset:
    """A read-only mapping ``key -> {member extension: bytes}`` over an indexed directory (all splits)."""

    def __init__(self, root: str | os.PathLike, index: DatasetIndex | None = None):
        self.root = Path(root)
        self.index = index if index is not None else load_index(self.root)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.index.find(key) is not None

    def __getitem__(self, key: str) -> dict[str, bytes]:
        i = self._find(key)
        with self._damage_named("samples.npy"):
            return self.sample(i)

    def locate(self, key: str) -> tuple[str, int]:
        """``(shard name, byte offset of the sample's first tar header)`` of ``key``."""
        i = self._find(key)
        with self._damage_named("samples.npy"):
            row = self.index.samples[i]
            return self.index.shards[int(row["shard"])].name, int(row["offset"])

    def _find(self, key: str) -> int:
        with self._damage_named("key_order.npy"):
            i = self.index.find(key)
        if i is None:
            raise SampleNotFound(f"{self.root}: no sample with key {key!r} ({len(self)} samples)")
        return i

    @contextlib.contextmanager
    def _damage_named(self, name: str):
        """An entry of index file ``name`` pointing past the arrays it indexes (a damaged index) as one
        ``IndexMismatch`` line naming the file, not an ``IndexError``."""
        try:
            yield
        except IndexError:
            raise IndexMismatch(
                f"{self.root / INDEX_DIR / name}: points past the index's own arrays (damaged? `dataio verify "
                f"{self.root}` checks every file; `dataio index {self.root}` rewrites them)"
            ) from None

    def sample(self, i: int) -> dict[str, bytes]:
        """The members of sample ``i`` (global index order), read from its shard."""
        row = self.index.samples[i]
        shard = self.root / self.index.shards[int(row["shard"])].name
        members = self.index.sample_members(i)
        key = self.index.keys[i]
        fd = os.open(shard, os.O_RDONLY | os.O_CLOEXEC)
        try:
            first = min((offset for offset, _ in members.values()), default=int(row["offset"]) + TAR_HEADER)
            head = os.pread(fd, first - int(row["offset"]), int(row["offset"]))
            name = key.rpartition(b"/")[2] + b"."
            if head[-TAR_HEADER:][: len(key) + 1] != key + b"." and name not in head:  # ustar name, else long name
                raise IndexMismatch(
                    f"{shard}: the tar at byte {int(row['offset'])} does not hold sample "
                    f"{key.decode(errors='replace')!r}, which the index places there "
                    f"(index out of date? run `dataio index {self.root}`)"
                )
            out = {}
            for ext, (offset, size) in members.items():
                data = os.pread(fd, size, offset)
                if len(data) != size:
                    raise IndexMismatch(
                        f"{shard}: truncated shard: member {ext!r} of {key.decode(errors='replace')!r} "
                        f"ends past the end of the file (index out of date? run `dataio index {self.root}`)"
                    )
                out[ext] = data
            return out
        finally:
            os.close(fd)


def open_dataset(root: str | os.PathLike) -> Dataset:
    """The indexed directory ``root`` as a mapping from sample key to ``{extension: bytes}``."""
    return Dataset(root)


__all__ = ["Dataset", "IndexMismatch", "SampleNotFound", "open_dataset"]
