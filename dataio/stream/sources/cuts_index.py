"""Lazy random access to a Lhotse cuts manifest (``cuts.jsonl[.gz]``) through an index cached beside it.

Lhotse's eager ``CutSet.from_file`` builds every cut object (~1 KB each) before the first one is used.
Here the manifest is read once, as a stream: each line is parsed for its ``id`` and ``duration`` only,
and the raw lines are re-packed into blocks of ``BLOCK_LINES`` lines, each zlib-compressed on its own,
into ``<manifest>.headrace-cuts`` (about the manifest's own size), with ``<manifest>.headrace-cuts.npz``
holding the keys, durations and block offsets plus the manifest's size and mtime. Every later open
(another rank, worker, epoch or job) loads only the ``.npz``: the manifest is not read at all, and
cut ``i`` costs one block read + decompression (``BLOCK_LINES`` lines, ~0.1 ms) and one
``deserialize_item``. The durations feed duration bucketing as before; memory is the keys, durations
and block offsets (~50 bytes per cut instead of ~1 KB).

Cache safety: both files are written under unique temporary names and renamed into place, the ``.npz``
last, so concurrent first opens (ranks of one node) each produce a complete pair and readers never see
a partial one. A manifest whose size or mtime changed is re-indexed. When the manifest's folder is not
writable the pair goes to ``$XDG_CACHE_HOME/headrace/cuts/`` (default ``~/.cache``) under a hash of the
manifest's absolute path.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import uuid
import zlib
from pathlib import Path

import numpy as np

BLOCK_LINES = 64
SUFFIX = ".headrace-cuts"


def cache_paths(manifest: str) -> tuple[Path, Path]:
    """(blocks file, index file) for ``manifest``: beside it when its folder is writable, else in the user cache."""
    path = Path(manifest).resolve()
    if os.access(path.parent, os.W_OK):
        base = path.with_name(path.name + SUFFIX)
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "headrace" / "cuts"
        root.mkdir(parents=True, exist_ok=True)
        base = root / (hashlib.sha1(str(path).encode()).hexdigest() + SUFFIX)
    return base, base.with_name(base.name + ".npz")


class CutsIndex:
    """``keys`` / ``durations`` of every cut, and ``load(i)`` -> the lhotse cut (see the module docstring)."""

    def __init__(self, manifest: str):
        self.manifest = manifest
        self.blocks_path, self.index_path = cache_paths(manifest)
        stat = os.stat(manifest)
        self.stamp = np.array([stat.st_size, stat.st_mtime_ns], dtype=np.int64)
        index = self._load_index()
        if index is None:
            index = self._build()
        self.keys, self.durations, self.offsets = index["keys"], index["durations"], index["offsets"]
        self._block: tuple[int, list[bytes]] | None = None  # the last decompressed block

    def __len__(self) -> int:
        return len(self.keys)

    def _load_index(self) -> dict | None:
        try:
            with np.load(self.index_path) as data:
                if not np.array_equal(data["stamp"], self.stamp):
                    return None  # the manifest changed since it was indexed
                return {k: data[k] for k in ("keys", "durations", "offsets")}
        except FileNotFoundError:
            return None

    def _build(self) -> dict:
        """One streaming pass: id + duration per line, lines re-packed into compressed blocks."""
        keys, durations, offsets, pending = [], [], [0], []
        tmp = f".tmp-{uuid.uuid4().hex}"
        blocks_tmp = self.blocks_path.with_name(self.blocks_path.name + tmp)
        opener = gzip.open if self.manifest.endswith(".gz") else open
        with opener(self.manifest, "rb") as src, open(blocks_tmp, "wb") as out:

            def flush():
                offsets.append(offsets[-1] + out.write(zlib.compress(b"\n".join(pending), 1)))
                pending.clear()

            lines = src if ".jsonl" in self.manifest else (json.dumps(c).encode() for c in json.load(src))
            for number, line in enumerate(lines, 1):  # a .json manifest (one JSON list) is read whole
                line = line.strip()
                if not line:
                    continue
                try:
                    cut = json.loads(line)
                    keys.append(cut["id"].encode())
                    durations.append(float(cut["duration"]))
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    raise ValueError(f"{self.manifest}:{number}: not a lhotse cut with id and duration ({e})") from None
                pending.append(line)
                if len(pending) == BLOCK_LINES:
                    flush()
            if pending:
                flush()
        index = {
            "keys": np.array(keys, dtype=np.bytes_) if keys else np.zeros(0, "S1"),
            "durations": np.array(durations, dtype=np.float64),
            "offsets": np.array(offsets, dtype=np.int64),
        }
        os.replace(blocks_tmp, self.blocks_path)
        index_tmp = self.index_path.with_name(self.index_path.name + tmp + ".npz")
        np.savez(index_tmp, stamp=self.stamp, **index)
        os.replace(index_tmp, self.index_path)  # last: its presence means the pair is complete
        return index

    def load(self, i: int):
        """Cut ``i`` as a lhotse object (its block read and decompressed once while consecutive reads hit it)."""
        from lhotse.serialization import deserialize_item

        block, row = divmod(int(i), BLOCK_LINES)
        if self._block is None or self._block[0] != block:
            start, end = int(self.offsets[block]), int(self.offsets[block + 1])
            with open(self.blocks_path, "rb") as f:
                f.seek(start)
                self._block = (block, zlib.decompress(f.read(end - start)).split(b"\n"))
        return deserialize_item(json.loads(self._block[1][row]))


__all__ = ["BLOCK_LINES", "CutsIndex", "cache_paths"]
