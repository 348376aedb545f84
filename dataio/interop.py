"""Datasets prepared by other tools, read through the same loader.

``energon_index(root)``: a directory prepared by Megatron-Energon (``energon prepare``) but never
indexed by headrace. Energon's ``.nv-meta/index.sqlite`` already holds what the loader needs --
``samples(tar_file_id, sample_key, sample_index, byte_offset, byte_size)`` and
``sample_parts(tar_file_id, sample_index, part_name, content_byte_offset, content_byte_size)`` -- and
``.nv-meta/.info.json`` lists the shards in ``tar_file_id`` order. Two SQL queries and a few numpy
operations turn them into an in-memory ``DatasetIndex`` (nothing is written into the directory);
cost is one pass over the sqlite rows (~1 s per 1M parts). Every shard counts as split ``train``
(energon's ``split.yaml`` patterns are not interpreted); token counts and durations are unknown.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np

from dataio.index import MEMBER_DTYPE, META_DIR, SAMPLE_DTYPE, DatasetIndex, ShardInfo


def is_energon_dir(root: str) -> bool:
    return (Path(root) / META_DIR / "index.sqlite").exists() and (Path(root) / META_DIR / ".info.json").exists()


def energon_index(root: str) -> DatasetIndex:
    """The headrace index of an energon-prepared directory, built from its ``index.sqlite``."""
    meta = Path(root) / META_DIR
    with open(meta / ".info.json") as f:
        shard_counts = json.load(f)["shard_counts"]
    db = sqlite3.connect(f"file:{meta / 'index.sqlite'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT tar_file_id, sample_index, sample_key, byte_offset, byte_size FROM samples "
                          "ORDER BY tar_file_id, sample_index").fetchall()
        parts = db.execute("SELECT tar_file_id, sample_index, part_name, content_byte_offset, content_byte_size "
                           "FROM sample_parts ORDER BY tar_file_id, sample_index, content_byte_offset").fetchall()
    finally:
        db.close()
    extensions = sorted({p[2] for p in parts})
    ext_id = {e: i for i, e in enumerate(extensions)}
    members = np.zeros(len(parts), MEMBER_DTYPE)
    members["ext"] = [ext_id[p[2]] for p in parts]
    members["offset"] = [p[3] for p in parts]
    members["size"] = [p[4] for p in parts]
    owner = np.array([(p[0], p[1]) for p in parts], dtype=np.int64).reshape(-1, 2)
    sample_ids = np.array([(r[0], r[1]) for r in rows], dtype=np.int64).reshape(-1, 2)
    # Parts are sorted like samples, so each sample's parts are one contiguous run.
    starts = np.searchsorted(owner[:, 0] * (1 << 32) + owner[:, 1], sample_ids[:, 0] * (1 << 32) + sample_ids[:, 1])
    samples = np.zeros(len(rows), SAMPLE_DTYPE)
    samples["shard"] = sample_ids[:, 0]
    samples["offset"] = [r[3] for r in rows]
    samples["size"] = [r[4] for r in rows]
    samples["member_start"] = starts
    samples["member_count"] = np.diff(np.append(starts, len(parts)))
    samples["tokens"] = -1
    samples["duration"] = np.nan
    shards = [ShardInfo(name=name, samples=count, bytes=(Path(root) / name).stat().st_size)
              for name, count in shard_counts.items()]
    keys = np.array([r[2].encode() for r in rows], dtype=np.bytes_) if rows else np.zeros(0, "S1")
    return DatasetIndex(shards=shards, extensions=extensions, samples=samples, members=members, keys=keys,
                        job={"source": "energon index.sqlite"})


__all__ = ["energon_index", "is_energon_dir"]
