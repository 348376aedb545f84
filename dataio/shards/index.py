"""The headrace shard index: where every sample and member lives, plus per-sample lengths.

Stored in ``DIR/.nv-meta/headrace/`` beside Megatron-Energon's own metadata (``.nv-meta/*`` and the
per-shard ``.tar.idx`` files), so one directory serves webdataset, energon and headrace:

- ``manifest.json``: format version, the shard count, the member-extension vocabulary, the split
  names, the job fingerprint of the ``dataio shard`` run that wrote it and the index's content digest
  (what a loader state's fingerprint names the data by, computed once here instead of by every rank).
- ``shard_names.npy`` / ``shards.npy``: the per-shard table (name; split, bytes, sample count, largest
  token id, sha256), binary and mapped (``headrace.dataio.shards.shardtable``). Version 1 indexes kept
  it as a JSON list in the manifest; they are still read.
- ``samples.npy``: one row per sample (``SAMPLE_DTYPE``), global order = shards in manifest order,
  samples in tar order. ``offset``/``size`` span the sample's tar headers and payloads, so one read
  fetches a whole sample; ``tokens`` (-1 when unknown) and ``duration`` (NaN when unknown) let
  packing and bucketing plan without reading payloads.
- ``members.npy``: one row per tar member (``MEMBER_DTYPE``); sample i owns rows
  ``member_start[i] : member_start[i] + member_count[i]``; ``offset`` is the absolute payload offset.
- ``keys.npy``: the ``__key__`` of each sample (fixed-width bytes), memory-mapped like the rest.
- ``key_order.npy``: the sample indices sorted by key (``uint32``, ``uint64`` past 2^32 samples):
  ``DatasetIndex.find`` looks a key up by binary search over the two maps, O(log n) pages touched and
  no key loaded into the heap (an index written before it existed is searched linearly).

While a job runs, each finished shard leaves a ``ShardPart`` sidecar in ``DIR/.nv-meta/parts/`` (its
own rows, offsets known at write time or from one header scan); ``merge_parts`` turns the parts of all
shards, from any number of workers or nodes, into the one ``DatasetIndex``.

Plain ``.npy`` columns (no pickle, ``allow_pickle=False``) load in milliseconds and memory-map, so a
loader opens a 10M-sample dataset without parsing anything per sample.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from tokenize import TokenError

import numpy as np

from headrace.dataio.shards.index_check import IndexFormatError, check_layout
from headrace.dataio.shards.index_rows import MEMBER_DTYPE, SAMPLE_DTYPE
from headrace.dataio.shards.shardtable import ShardInfo, ShardTable, check_shard_names, split_ids
from headrace.dataio.shards.writes import writing

META_DIR = ".nv-meta"
INDEX_DIR = f"{META_DIR}/headrace"
PARTS_DIR = f"{META_DIR}/parts"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: the shard table as JSON in manifest.json

LHOTSE_MANIFEST_SUFFIXES = (".jsonl.gz", ".jsonl", ".json", ".json.gz")  # a Lhotse manifest file's endings


def shards_of(manifest: dict, where: str) -> list[ShardInfo]:
    """The ``ShardInfo`` list of a loaded ``manifest.json`` (``where`` names it); ValueError naming the file and the
    entry for an entry that is not one (an unknown field, a name leaving the dataset)."""
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    if not isinstance(shards, list):
        raise ValueError(f"{where}: 'shards' is not a list of shard entries")
    out = []
    for i, entry in enumerate(shards):
        try:
            out.append(ShardInfo(**entry))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: shards[{i}]: {e}") from None
    return out


@dataclass(kw_only=True)
class DatasetIndex:
    shards: Sequence[ShardInfo]  # a list, or the mapped ShardTable of a loaded index
    extensions: list[str]
    samples: np.ndarray  # SAMPLE_DTYPE
    members: np.ndarray  # MEMBER_DTYPE
    keys: np.ndarray  # bytes ("S<n>")
    job: dict = field(default_factory=dict)
    key_order: np.ndarray | None = None  # sample indices sorted by key (None: not loaded; ``find`` scans)
    digest: str | None = None  # ``content_digest`` as saved (None: not saved yet; computed when asked)

    def content_digest(self) -> str:
        """A digest of everything the index says (``content_digest``): the saved one where there is one."""
        return self.digest or content_digest(self)

    def __len__(self) -> int:
        return len(self.samples)

    def key(self, i: int) -> str:
        return self.keys[i].decode()

    def find(self, key: str) -> int | None:
        """The index of the sample named ``key`` (the first, were keys repeated), or None: a binary
        search over ``key_order`` (about log2(n) key compares, each a page of the mapped files)."""
        want = key.encode("utf-8", "surrogateescape")
        if len(want) > self.keys.dtype.itemsize:
            return None  # longer than every stored key
        if self.key_order is None:
            hits = np.flatnonzero(self.keys == want)
            return int(hits[0]) if len(hits) else None
        lo, hi = 0, len(self.key_order)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.keys[self.key_order[mid]] < want:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(self.key_order) and self.keys[self.key_order[lo]] == want:
            return int(self.key_order[lo])
        return None

    def sample_members(self, i: int) -> dict[str, tuple[int, int]]:
        """``{ext: (absolute payload offset, size)}`` of sample ``i``."""
        row = self.samples[i]
        start = int(row["member_start"])
        members = self.members[start : start + int(row["member_count"])]
        return {self.extensions[m["ext"]]: (int(m["offset"]), int(m["size"])) for m in members}

    def split_indices(self, split: str) -> np.ndarray:
        """Global sample indices of one split (e.g. ``"train"``)."""
        return np.flatnonzero(np.isin(self.samples["shard"], split_ids(self.shards, split)))

    def save(self, root: str | os.PathLike) -> None:
        """Write the index under ``root/.nv-meta/headrace`` atomically (temp dir, then rename)."""
        final = Path(root) / INDEX_DIR
        tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
        with writing(tmp, "the index"):
            self._write_files(tmp)
        if final.exists():
            old = final.with_name(final.name + f".old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            for name in os.listdir(old):
                os.unlink(old / name)
            old.rmdir()
        else:
            tmp.rename(final)

    def _write_files(self, tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        np.save(tmp / "samples.npy", np.ascontiguousarray(self.samples, dtype=SAMPLE_DTYPE))
        np.save(tmp / "members.npy", np.ascontiguousarray(self.members, dtype=MEMBER_DTYPE))
        keys = self.keys.astype(np.bytes_)
        np.save(tmp / "keys.npy", keys)
        np.save(tmp / "key_order.npy", key_order(keys))
        table = self.shards if isinstance(self.shards, ShardTable) else ShardTable.from_infos(self.shards)
        np.save(tmp / "shard_names.npy", table.names.astype(np.bytes_))
        np.save(tmp / "shards.npy", np.ascontiguousarray(table.rows))
        manifest = {
            "format": "headrace-index",
            "version": FORMAT_VERSION,
            "shards": len(table),
            "splits": table.splits,
            "extensions": self.extensions,
            "job": self.job,
            "digest": content_digest(self),
        }
        with open(tmp / "manifest.json", "w") as f:
            json.dump(manifest, f, indent=1)
        for name in os.listdir(tmp):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())


def _manifest_hint(path) -> str:
    """For a file named like a Lhotse manifest: how to have it read as one."""
    name = Path(path).name
    if not name.endswith(LHOTSE_MANIFEST_SUFFIXES):
        return ""
    return (
        f"; if it is a Lhotse CutSet manifest, its name must contain 'cuts' to be read as one (e.g. "
        f"{name.split('.')[0]}_cuts.{name.split('.', 1)[1]})"
    )


def load_index(root: str | os.PathLike, *, mmap: bool = True) -> DatasetIndex:
    """Load the index of a local dataset directory (remote sources copy these small files first)."""
    d = Path(root) / INDEX_DIR
    manifest_path = d / "manifest.json"
    if not Path(root).is_dir():  # no index hint for a path that is not there: it is the wrong path
        raise FileNotFoundError(
            f"{root}: no such directory"
            if not Path(root).exists()
            else f"{root}: not a directory (expected a dataset directory)" + _manifest_hint(root)
        )
    if not manifest_path.exists():
        raise FileNotFoundError(
            f"{root}: no headrace index ({INDEX_DIR}/manifest.json); run `dataio index {root}` first"
        )
    try:
        with open(manifest_path, "rb") as f:
            manifest = json.loads(f.read())
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser's depth
        raise IndexFormatError(f"{manifest_path}: not a JSON manifest ({' '.join(str(e).split())[:160]})") from None
    mode = "r" if mmap else None

    def load(name: str) -> np.ndarray:
        try:
            return np.load(d / name, mmap_mode=mode, allow_pickle=False)
        # a header that does not parse (numpy tokenizes and literal-evals it), a length past the file, a pickle
        except (ValueError, EOFError, SyntaxError, TokenError, OverflowError, TypeError, KeyError) as e:
            raise IndexFormatError(f"{d / name}: not an index array ({' '.join(str(e).split())[:160]})") from None

    return index_from_files(manifest, str(manifest_path), load, lambda name: (d / name).exists())


def index_from_files(
    manifest: dict, where: str, load: Callable[[str], np.ndarray], exists: Callable[[str], bool]
) -> DatasetIndex:
    """A ``DatasetIndex`` from its parsed ``manifest.json`` and a reader of its ``.npy`` files (mapped
    from a local directory, or fetched from a URL); ``where`` names the manifest in errors."""
    if not isinstance(manifest, dict):
        raise IndexFormatError(f"{where}: holds a JSON {type(manifest).__name__}, not the index manifest")
    version = manifest.get("version")
    if manifest.get("format") != "headrace-index" or version not in READABLE_VERSIONS:
        raise ValueError(
            f"{where}: unsupported index format {manifest.get('format')!r} version {version!r} "
            f"(this headrace reads versions {', '.join(map(str, READABLE_VERSIONS))}; "
            f"run `dataio index DIR` with it to rewrite the index)"
        )
    for field_name, needed in (("extensions", True), ("splits", version == 2)):
        value = manifest.get(field_name)
        if needed and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise IndexFormatError(f"{where}: '{field_name}' is not a list of names")
    if version == 1:
        shards: Sequence[ShardInfo] = shards_of(manifest, where)
    else:
        names = load("shard_names.npy")
        if names.ndim != 1 or names.dtype.kind != "S":  # before the names are read (check_layout: the rest)
            raise IndexFormatError(f"{where.rsplit('/', 1)[0]}/shard_names.npy: holds {names.dtype}, not names")
        check_shard_names(names, where)  # the loader opens dataset / name: never a path leaving the dataset
        shards = ShardTable(names, load("shards.npy"), manifest["splits"])
    index = DatasetIndex(
        shards=shards,
        extensions=list(manifest["extensions"]),
        samples=load("samples.npy"),
        members=load("members.npy"),
        keys=load("keys.npy"),
        job=manifest.get("job", {}),
        key_order=load("key_order.npy") if exists("key_order.npy") else None,
        digest=manifest.get("digest"),
    )
    check_layout(index, where.rsplit("/", 1)[0])
    return index


def content_digest(index: DatasetIndex) -> str:
    """blake2b of the whole index -- every sample's shard, byte span, member rows, lengths and key, every
    shard's name, split, size and checksum, the extensions and the ``dataio shard`` job id: one pass over
    the index arrays (~1 s per 10M samples), made once when the index is saved and kept in its manifest."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([[s.name, s.split, s.bytes, s.samples, s.sha256] for s in index.shards]).encode())
    h.update(json.dumps([index.extensions, index.job.get("id") if isinstance(index.job, dict) else None]).encode())
    for array in (index.samples, index.members, index.keys):
        h.update(np.ascontiguousarray(array).view(np.uint8))
    return h.hexdigest()


def key_order(keys: np.ndarray) -> np.ndarray:
    """Sample indices sorted by key (stable: repeated keys keep index order), 4 bytes a sample below 2^32."""
    order = np.argsort(keys, kind="stable")
    return order.astype(np.uint32 if len(keys) < 2**32 else np.uint64)


@dataclass(kw_only=True)
class ShardPart:
    """The index rows of one shard. ``samples['shard']`` is 0 and ``member_start`` counts from the
    shard's first member; ``merge_parts`` rebases both."""

    info: ShardInfo
    extensions: list[str]
    samples: np.ndarray
    members: np.ndarray
    keys: np.ndarray

    def save(self, root: str | os.PathLike) -> Path:
        """Write ``root/.nv-meta/parts/<shard>.npz`` atomically; returns its path."""
        d = Path(root) / PARTS_DIR
        d.mkdir(parents=True, exist_ok=True)
        final = d / f"{self.info.name}.npz"
        tmp = d / f".{self.info.name}.npz.tmp-{os.getpid()}"
        with writing(final, "an index part"), open(tmp, "wb") as f:
            np.savez(
                f,
                samples=np.ascontiguousarray(self.samples, dtype=SAMPLE_DTYPE),
                members=np.ascontiguousarray(self.members, dtype=MEMBER_DTYPE),
                keys=self.keys.astype(np.bytes_),
                meta=np.frombuffer(
                    json.dumps({"info": asdict(self.info), "extensions": self.extensions}).encode(), np.uint8
                ),
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        return final

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ShardPart":
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes())
            return cls(
                info=ShardInfo(**meta["info"]),
                extensions=meta["extensions"],
                samples=z["samples"],
                members=z["members"],
                keys=z["keys"],
            )


def merge_parts(parts: list[ShardPart], *, job: dict | None = None) -> DatasetIndex:
    """One ``DatasetIndex`` from per-shard parts, in the given shard order (vectorised, no per-sample loop)."""
    extensions = sorted({e for p in parts for e in p.extensions})
    ext_id = {e: i for i, e in enumerate(extensions)}
    samples, members, keys = [], [], []
    member_base = 0
    for shard_id, part in enumerate(parts):
        s = np.array(part.samples, dtype=SAMPLE_DTYPE)
        s["shard"] = shard_id
        s["member_start"] += member_base
        m = np.array(part.members, dtype=MEMBER_DTYPE)
        remap = np.array([ext_id[e] for e in part.extensions], dtype=np.uint16)
        m["ext"] = remap[m["ext"]] if len(m) else m["ext"]
        member_base += len(m)
        samples.append(s)
        members.append(m)
        keys.append(part.keys.astype(np.bytes_))
    return DatasetIndex(
        shards=[p.info for p in parts],
        extensions=extensions,
        samples=np.concatenate(samples) if samples else np.zeros(0, SAMPLE_DTYPE),
        members=np.concatenate(members) if members else np.zeros(0, MEMBER_DTYPE),
        keys=np.concatenate(keys) if keys else np.zeros(0, "S1"),
        job=job or {},
    )
