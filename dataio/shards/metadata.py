"""Megatron-Energon metadata for a shard directory, written from a ``DatasetIndex`` (no tar is re-read).

Writes what ``energon prepare --non-interactive --sample-type CrudeWebdataset`` writes with
megatron-energon 7.x, so ``megatron.energon`` opens the directory as it is:

- ``SHARD.tar.idx`` beside each shard: native uint64 byte offsets of each sample's first tar header,
  then the end-of-data offset (energon's ``TarIndexWriter``);
- ``.nv-meta/index.sqlite``: tables ``samples`` and ``sample_parts`` with energon's DDL and indices
  (random access by key, sample-part lookups, ``list_all_samples``);
- ``.nv-meta/index.uuid``, ``.nv-meta/split.yaml`` (split parts from ``ShardInfo.split``, shard names
  brace-collapsed), ``.nv-meta/dataset.yaml`` (``CrudeWebdataset``), ``.nv-meta/.info.json``
  (``shard_counts``);
- the headrace index (``DatasetIndex.save``).

Energon's byte spans follow from the headrace rows: a sample spans from its first header to the next
sample's first header; the last one ends at the shard's end-of-data offset (its span rounded up to the
512-byte block). ``index.uuid`` is derived from the index content instead of ``uuid4``, so it still
changes whenever the index does but re-running on the same shards writes identical bytes.

Atomicity: every file is written under a temporary name, fsynced and renamed. ``.info.json`` is what
makes energon treat a directory as prepared, so it is removed first and written last: a reader sees
either no metadata set or a complete one. Cost: ``executemany`` per table in chunks (~1 us per row) plus
one small file per shard (left as it is when it already holds those bytes: re-indexing after
shards were added writes only the new shards' files); no payload byte is touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import uuid
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import yaml

from headrace.dataio.shards.index import META_DIR, DatasetIndex
from headrace.dataio.shards.tarwriter import BLOCK, write_atomically
from headrace.dataio.shards.writes import writing

ITAR_SUFFIX = ".idx"  # shard.tar -> shard.tar.idx
DEFAULT_SPLITS = ("train", "val", "test")
SQLITE_CHUNK = (
    1 << 16
)  # samples a sqlite insert batch: its Python rows are the writer's memory  # energon prepare always writes these three parts

# Energon's DDL, verbatim: sqlite keeps the statement text in sqlite_master, so the schema of our
# index.sqlite is identical to the one ``energon prepare`` writes.
SAMPLES_DDL = """
                CREATE TABLE IF NOT EXISTS samples (
                    tar_file_id INTEGER NOT NULL,
                    sample_key TEXT NOT NULL UNIQUE,
                    sample_index INTEGER NOT NULL,
                    byte_offset INTEGER,
                    byte_size INTEGER
                )
                """
SAMPLE_PARTS_DDL = """
                CREATE TABLE IF NOT EXISTS sample_parts (
                    tar_file_id INTEGER,
                    sample_index INTEGER,
                    part_name TEXT,
                    content_byte_offset INTEGER,
                    content_byte_size INTEGER
                )
                """
INDEX_DDL = (
    "CREATE INDEX IF NOT EXISTS idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index)",
    "CREATE INDEX IF NOT EXISTS idx_sample_parts_seq ON sample_parts(tar_file_id, sample_index, content_byte_offset)",
    "CREATE INDEX IF NOT EXISTS idx_sample_parts_full ON sample_parts(tar_file_id, sample_index, part_name, content_byte_offset, content_byte_size)",
)


def energon_spans(index: DatasetIndex) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sample: ``sample_index`` within its shard and energon's ``byte_size``; per shard: the
    end-of-data offset (the last ``.tar.idx`` entry)."""
    shard = index.samples["shard"].astype(np.int64)
    offset = index.samples["offset"].astype(np.int64)
    n_shards = len(index.shards)
    counts = np.bincount(shard, minlength=n_shards)
    first = np.cumsum(counts) - counts
    sample_index = np.arange(len(shard)) - first[shard]
    last_of_shard = np.ones(len(shard), bool)
    last_of_shard[:-1] = shard[1:] != shard[:-1]
    sample_end = offset + index.samples["size"].astype(np.int64)
    shard_end = np.zeros(n_shards, np.int64)
    shard_end[shard[last_of_shard]] = -(-sample_end[last_of_shard] // BLOCK) * BLOCK
    next_offset = np.empty_like(offset)
    next_offset[:-1] = offset[1:]
    byte_size = np.where(last_of_shard, shard_end[shard] - offset, next_offset - offset)
    return sample_index, byte_size, shard_end


def collapse_names(names: list[str]) -> list[str]:
    """Brace-collapse runs of names that differ in one number counting up by one, keeping order
    (``s-000.tar, s-001.tar`` -> ``s-{000..001}.tar``), as energon writes split parts."""
    out: list[str] = []
    run = None  # (literals, numbers of the last name, varying slot or None, first value of the slot)

    def flush():
        if run is not None:
            lits, nums, slot, first = run
            if slot is not None:
                nums = nums[:slot] + [f"{{{first}..{nums[slot]}}}"] + nums[slot + 1 :]
            out.append("".join(x for pair in zip(lits, nums + [""]) for x in pair))

    for name in names:
        nums, lits = re.findall(r"\d+", name), re.split(r"\d+", name)
        if run is not None and run[0] == lits and len(run[1]) == len(nums):
            diff = [i for i, (a, b) in enumerate(zip(run[1], nums)) if a != b]
            if (
                len(diff) == 1
                and run[2] in (None, diff[0])
                and len(nums[diff[0]]) == len(run[1][diff[0]])
                and int(nums[diff[0]]) == int(run[1][diff[0]]) + 1
            ):
                slot = diff[0]
                run = (lits, nums, slot, run[3] if run[2] is not None else run[1][slot])
                continue
        flush()
        run = (lits, nums, None, None)
    flush()
    return out


def _write_sqlite(path: Path, index: DatasetIndex, sample_index: np.ndarray, byte_size: np.ndarray) -> None:
    """Energon's two tables, inserted ``SQLITE_CHUNK`` samples at a time: the Python rows ``executemany``
    needs exist for one chunk at a time (they were the indexer's largest cost per sample)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    n = len(index.samples)
    db = sqlite3.connect(tmp)
    try:
        db.execute("PRAGMA journal_mode = OFF")  # a temp file: durability comes from fsync + rename
        db.execute("PRAGMA synchronous = OFF")
        db.execute(SAMPLES_DDL)
        db.execute(SAMPLE_PARTS_DDL)
        try:
            for a in range(0, n, SQLITE_CHUNK):
                rows = index.samples[a : a + SQLITE_CHUNK]
                db.executemany(
                    "INSERT INTO samples (tar_file_id, sample_key, sample_index, byte_offset, byte_size) VALUES (?, ?, ?, ?, ?)",
                    zip(
                        rows["shard"].tolist(),
                        [k.decode("utf-8", "surrogateescape") for k in index.keys[a : a + SQLITE_CHUNK].tolist()],
                        sample_index[a : a + SQLITE_CHUNK].tolist(),
                        rows["offset"].tolist(),
                        byte_size[a : a + SQLITE_CHUNK].tolist(),
                    ),
                )
        except sqlite3.IntegrityError:
            raise ValueError(_duplicate_key_message(index)) from None
        for a in range(0, n, SQLITE_CHUNK):
            rows = index.samples[a : a + SQLITE_CHUNK]
            counts = rows["member_count"].astype(np.int64)
            total = int(counts.sum())
            owner = np.repeat(np.arange(len(counts)), counts)
            excl = np.cumsum(counts) - counts
            members = index.members[np.repeat(rows["member_start"].astype(np.int64) - excl, counts) + np.arange(total)]
            part_names = np.array(index.extensions, dtype=object)[members["ext"]].tolist() if total else []
            db.executemany(
                "INSERT INTO sample_parts (tar_file_id, sample_index, part_name, content_byte_offset, content_byte_size) VALUES (?, ?, ?, ?, ?)",
                zip(
                    rows["shard"][owner].tolist(),
                    sample_index[a + owner].tolist(),
                    part_names,
                    members["offset"].tolist(),
                    members["size"].tolist(),
                ),
            )
        for ddl in INDEX_DDL:
            db.execute(ddl)
        db.commit()
    except BaseException:
        db.close()
        tmp.unlink(missing_ok=True)
        raise
    db.close()
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _duplicate_key_message(index: DatasetIndex) -> str:
    seen: dict[bytes, int] = {}
    for i, key in enumerate(index.keys.tolist()):
        if key in seen:
            a, b = (index.shards[int(index.samples["shard"][j])].name for j in (seen[key], i))
            return (
                f"duplicate sample key {key.decode('utf-8', 'surrogateescape')!r} (in {a} and {b}): energon and "
                f"webdataset need keys unique across the dataset"
            )
        seen[key] = i
    return "duplicate sample key"


def _content_uuid(index: DatasetIndex, byte_size: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([(s.name, s.samples, s.split) for s in index.shards]).encode())
    h.update(np.ascontiguousarray(index.samples["offset"]).tobytes())
    h.update(np.ascontiguousarray(byte_size).tobytes())
    h.update(index.keys.astype(np.bytes_).tobytes())
    return str(uuid.UUID(bytes=h.digest()[:16], version=4))


def split_parts(index: DatasetIndex) -> dict[str, list[str]]:
    """``{split: [collapsed shard names]}`` with energon's train/val/test always present."""
    parts: dict[str, list[str]] = {name: [] for name in DEFAULT_SPLITS}
    for shard in index.shards:
        parts.setdefault(shard.split, []).append(shard.name)
    return {name: collapse_names(shards) for name, shards in parts.items()}


def _energon_version() -> dict[str, str]:
    """``energon_version`` for ``.info.json`` where energon is installed. Sharding does not need energon (it is
    the ``bench`` extra), and energon reads a directory whose ``.info.json`` lacks the field."""
    try:
        return {"energon_version": version("megatron-energon")}
    except PackageNotFoundError:
        return {}


def _holds(path: Path, content: bytes) -> bool:
    """Whether ``path`` holds exactly ``content`` (a read is much cheaper than a write, fsync and rename)."""
    try:
        if path.stat().st_size != len(content):
            return False
        return path.read_bytes() == content
    except FileNotFoundError:
        return False


def write_dataset_metadata(root: str | os.PathLike, index: DatasetIndex, *, workers: int = 1) -> None:
    """Write energon's ``.nv-meta`` set, the per-shard ``.tar.idx`` files and the headrace index for
    the shards of ``index`` under ``root`` (``workers`` threads write the ``.tar.idx`` files)."""
    root = Path(root)
    meta = root / META_DIR
    meta.mkdir(parents=True, exist_ok=True)
    counts = np.bincount(index.samples["shard"].astype(np.int64), minlength=len(index.shards))
    for shard, count in zip(index.shards, counts.tolist()):
        if count == 0:
            raise ValueError(f"{root / shard.name}: shard has no samples (energon cannot index an empty shard)")
        if count != shard.samples:
            raise ValueError(f"{root / shard.name}: index has {count} samples but ShardInfo says {shard.samples}")
    sample_index, byte_size, shard_end = energon_spans(index)

    info_path = meta / ".info.json"
    info_path.unlink(missing_ok=True)  # the "prepared" marker goes first and comes back last

    offsets = index.samples["offset"].astype(np.uint64)
    bounds = np.concatenate([[0], np.cumsum(counts)])

    def write_itar(i: int) -> None:
        entries = np.append(offsets[bounds[i] : bounds[i + 1]], np.uint64(shard_end[i])).astype("=u8").tobytes()
        shard_path = root / index.shards[i].name
        itar = shard_path.with_name(shard_path.name + ITAR_SUFFIX)
        if _holds(itar, entries):  # a re-index after shards were added: the old shards' files stand
            return
        write_atomically(itar, entries, what="energon's .tar.idx")

    with ThreadPoolExecutor(max(1, workers)) as pool:
        list(pool.map(write_itar, range(len(index.shards))))

    with writing(meta / "index.sqlite", "energon's sample index"):
        _write_sqlite(meta / "index.sqlite", index, sample_index, byte_size)
    write_atomically(meta / "index.uuid", _content_uuid(index, byte_size).encode(), what="energon's metadata")
    splits = {"split_parts": split_parts(index), "exclude": []}
    write_atomically(meta / "split.yaml", yaml.dump(splits, sort_keys=False).encode(), what="energon's metadata")
    dataset = {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
    write_atomically(meta / "dataset.yaml", yaml.dump(dataset, sort_keys=False).encode(), what="energon's metadata")
    index.save(root)
    info = {**_energon_version(), "shard_counts": {s.name: int(c) for s, c in zip(index.shards, counts.tolist())}}
    write_atomically(info_path, json.dumps(info, indent=2).encode(), what="energon's metadata")
    dir_fd = os.open(meta, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
