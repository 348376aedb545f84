"""The per-shard table of an index as two binary columns files instead of a JSON list.

``shard_names.npy`` (fixed-width UTF-8 bytes) and ``shards.npy`` (``SHARD_DTYPE``: split id, bytes,
samples, largest token id, sha256) are memory-mapped like the per-sample files, so opening a dataset
of 10^6 shards parses nothing per shard and keeps no Python object per shard: ``ShardTable[i]`` makes
the ``ShardInfo`` of shard ``i`` when asked (a microsecond), and the loader's per-shard questions
(which shards a split holds, how many samples each has) are numpy over the columns. A shard costs
``SHARD_DTYPE.itemsize`` (59) bytes plus its name's width, against ~140 bytes of JSON that every rank
parsed into ~400 bytes of objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

SHARD_DTYPE = np.dtype(
    [
        ("split", "<u2"),
        ("bytes", "<u8"),
        ("samples", "<u8"),
        ("max_token", "<i8"),
        ("has_sha256", "u1"),
        ("sha256", "V32"),
    ]
)
NO_MAX_TOKEN = -1  # token ids are >= 0: -1 stands for ShardInfo.max_token None
# uint64 ids past int64 (a corrupt or foreign shard) are recorded as this: still outside every vocabulary, so the
# trainer's vocabulary check names the shard all the same
MAX_TOKEN_STORED = np.iinfo(np.int64).max


def check_shard_name(name) -> None:
    """ValueError unless ``name`` is a relative path inside the dataset directory: it comes from a file the
    dataset's author wrote, and the loader opens ``dataset / name``."""
    parts = name.split("/") if isinstance(name, str) else None
    if not parts or name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in name:
        raise ValueError(f"shard name {name!r} is not a relative path inside the dataset directory")


@dataclass(kw_only=True)
class ShardInfo:
    name: str  # file name relative to the dataset directory
    split: str = "train"
    bytes: int = 0
    samples: int = 0
    sha256: str | None = None
    max_token: int | None = None  # largest token id of the shard's token members (None: unknown / none)

    def __post_init__(self):
        check_shard_name(self.name)


def check_shard_names(names: np.ndarray, where: str) -> None:
    """``check_shard_name`` over a whole ``shard_names.npy`` column at once (numpy over the bytes: ~10 ms for
    10^5 names); ValueError naming ``where`` and the first bad entry."""
    framed = np.char.add(np.char.add(b"/", names), b"/")
    bad = (
        (np.char.str_len(names) == 0)
        | np.char.startswith(names, b"/")
        | (np.char.find(names, b"\0") >= 0)
        | (np.char.find(framed, b"//") >= 0)
        | (np.char.find(framed, b"/./") >= 0)
        | (np.char.find(framed, b"/../") >= 0)
    )
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        try:
            check_shard_name(names[i].decode("utf-8", "surrogateescape"))
        except ValueError as e:
            raise ValueError(f"{where}: shards[{i}]: {e}") from None


class ShardTable(Sequence):
    """The shards of an index as columns; indexing and iteration give ``ShardInfo`` objects."""

    def __init__(self, names: np.ndarray, rows: np.ndarray, splits: list[str]):
        # plain ndarray views of the maps: np.memmap's __getitem__ costs ~10x a row's own look-up
        self.names, self.rows, self.splits = np.asarray(names), np.asarray(rows), list(splits)

    @classmethod
    def from_infos(cls, infos: Iterable) -> "ShardTable":
        infos = list(infos)
        splits = sorted({s.split for s in infos})
        split_id = {s: i for i, s in enumerate(splits)}
        rows = np.zeros(len(infos), SHARD_DTYPE)
        for i, s in enumerate(infos):
            sha = bytes.fromhex(s.sha256) if s.sha256 else b"\0" * 32
            rows[i] = (
                split_id[s.split],
                s.bytes,
                s.samples,
                NO_MAX_TOKEN if s.max_token is None else min(s.max_token, MAX_TOKEN_STORED),
                s.sha256 is not None,
                sha,
            )
        names = (
            np.array([s.name.encode("utf-8", "surrogateescape") for s in infos], dtype=np.bytes_)
            if infos
            else np.zeros(0, "S1")
        )
        return cls(names, rows, splits)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = self.rows[i]
        max_token = int(row["max_token"])
        return ShardInfo(
            name=self.name(i),
            split=self.splits[int(row["split"])],
            bytes=int(row["bytes"]),
            samples=int(row["samples"]),
            sha256=bytes(row["sha256"]).hex() if row["has_sha256"] else None,
            max_token=None if max_token == NO_MAX_TOKEN else max_token,
        )

    def name(self, i: int) -> str:
        """Shard ``i``'s file name (without making its ``ShardInfo``)."""
        return self.names[i].decode("utf-8", "surrogateescape")

    def __iter__(self) -> Iterator:
        return (self[i] for i in range(len(self)))

    def split_ids(self, split: str) -> np.ndarray:
        """Indices of the shards of ``split`` (numpy over the split column)."""
        if split not in self.splits:
            return np.zeros(0, np.int64)
        return np.flatnonzero(self.rows["split"] == self.splits.index(split))

    def counts(self) -> np.ndarray:
        """Samples per shard (``int64``)."""
        return self.rows["samples"].astype(np.int64)


def split_ids(shards: Sequence, split: str) -> np.ndarray:
    """Indices of the shards of ``split``: a ``ShardTable``'s column, else one pass over the ``ShardInfo`` list."""
    if isinstance(shards, ShardTable):
        return shards.split_ids(split)
    return np.array([i for i, s in enumerate(shards) if s.split == split], dtype=np.int64)


def shard_sample_counts(shards: Sequence) -> np.ndarray:
    """Samples per shard as the table records them (``int64``)."""
    if isinstance(shards, ShardTable):
        return shards.counts()
    return np.fromiter((s.samples for s in shards), dtype=np.int64, count=len(shards))


__all__ = [
    "SHARD_DTYPE",
    "ShardInfo",
    "ShardTable",
    "check_shard_name",
    "check_shard_names",
    "shard_sample_counts",
    "split_ids",
]
