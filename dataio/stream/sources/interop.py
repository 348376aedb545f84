"""Datasets prepared by other tools, read through the same loader.

``energon_index(root)``: a directory prepared by Megatron-Energon (``energon prepare``) but never
indexed by headrace. Energon's ``.nv-meta/index.sqlite`` already holds what the loader needs --
``samples(tar_file_id, sample_key, sample_index, byte_offset, byte_size)`` and
``sample_parts(tar_file_id, sample_index, part_name, content_byte_offset, content_byte_size)`` -- and
``.nv-meta/.info.json`` lists the shards in ``tar_file_id`` order. Two SQL queries and a few numpy
operations turn them into an in-memory ``DatasetIndex`` (nothing is written into the directory);
cost is one pass over the sqlite rows (~1 s per 1M parts). Each shard's split comes from energon's
``.nv-meta/split.yaml`` (``split_parts: {train: [patterns], val: [...]}``, brace patterns such as
``shard_{000000..000009}.tar``; ``exclude`` drops whole shards or ``shard/key`` samples), read with
``yaml.safe_load`` + ``braceexpand`` (what energon itself uses; energon's own parser costs a 0.4 s
import). Shards that no split lists are left out, as energon leaves them out; without a split file
every shard counts as ``train``. Token counts and durations are unknown. The directory may be an fsspec
URL (``s3://``, ``memory://``; ``Folder``, with the entry's ``storage_options``): the metadata files are
read whole (the sqlite into memory), the shards then like any remote shard.

Lhotse: a cuts manifest (``cuts.jsonl.gz``) becomes a ``LhotseCutSource`` (lazy random access to cut i);
a Shar directory becomes a ``SharSource``: its ``recording.NNNNNN.tar`` files are plain tars, indexed
in memory with ``headrace.dataio.shards.tarscan`` and read like any shard, and the transcripts in the matching
``cuts.NNNNNN.jsonl.gz`` are parsed once at open into one compact buffer. Both give each sample the
members ``dataio shard`` writes for audio: the audio, plus ``json`` = ``{"text", "id", "duration"}``
(``transcript_json``), so plain batches carry ``batch["json"][i]["text"]`` and bucketed batches
``batch["text"]``.
"""

from __future__ import annotations

import gzip
import io
import json
import sqlite3
from pathlib import Path

import numpy as np

from headrace.dataio.shards.index import (
    LHOTSE_MANIFEST_SUFFIXES,
    MEMBER_DTYPE,
    META_DIR,
    SAMPLE_DTYPE,
    DatasetIndex,
    ShardInfo,
    merge_parts,
)
from headrace.dataio.shards.tarscan import scan_shard
from headrace.dataio.stream.sources.cuts_index import CutsIndex
from headrace.dataio.usererror import SampleDecodeError
from headrace.dataio.stream.sources.shard_source import ShardSource
from headrace.dataio.stream.sources.storage import retry

SPLIT_FILES = ("split.yaml", "split.json")  # energon's default split config, then its fallback


class Folder:
    """The files of a dataset folder: a local directory, or an fsspec URL (``s3://``, ``memory://``, ...)
    opened with the entry's ``storage_options``; remote reads are retried like shard reads."""

    def __init__(self, root: str, storage_options: dict | None = None):
        self.root = root.rstrip("/")
        self.fs = None
        if "://" in root and not root.startswith("file://"):
            import fsspec

            self.fs, self.base = fsspec.core.url_to_fs(root, **(storage_options or {}))
        else:
            self.local = Path(root.removeprefix("file://"))

    def exists(self, rel: str) -> bool:
        if self.fs is None:
            return (self.local / rel).is_file()
        return bool(retry(lambda: self.fs.exists(f"{self.base.rstrip('/')}/{rel}"), f"{self.root}/{rel}: stat"))

    def read(self, rel: str) -> bytes | None:
        """The bytes of ``root/rel``; None when there is no such file (one request: no existence check first)."""
        if self.fs is None:
            try:
                return (self.local / rel).read_bytes()
            except FileNotFoundError:
                return None

        def attempt():
            try:
                return self.fs.cat_file(f"{self.base.rstrip('/')}/{rel}")
            except FileNotFoundError:
                return None  # not an error to retry

        return retry(attempt, f"{self.root}/{rel}: reading")

    def sizes(self, rels: list[str]) -> list[int]:
        """The sizes of ``root/rel`` for each ``rel``: one batched call remotely (fsspec runs them concurrently)."""
        if self.fs is None:
            return [(self.local / rel).stat().st_size for rel in rels]
        base = self.base.rstrip("/")
        return [int(n) for n in retry(lambda: self.fs.sizes([f"{base}/{rel}" for rel in rels]), f"{self.root}: stat")]

    def sqlite(self, rel: str) -> sqlite3.Connection:
        """A read-only connection to ``root/rel`` (a remote database is fetched whole into memory)."""
        if self.fs is None:
            return sqlite3.connect(f"file:{self.local / rel}?mode=ro", uri=True)
        db = sqlite3.connect(":memory:")
        db.deserialize(self.read(rel) or b"")
        return db


def is_energon_dir(root: str, storage_options: dict | None = None) -> bool:
    folder = Folder(root, storage_options)
    return folder.exists(f"{META_DIR}/index.sqlite") and folder.exists(f"{META_DIR}/.info.json")


def energon_splits(root: str, storage_options: dict | None = None) -> tuple[dict[str, str] | None, set[str]]:
    """``({shard name: split}, {excluded "shard/key"})`` from the directory's energon split config;
    ``(None, set())`` when it has none. A shard listed under two splits is an error (a headrace shard
    belongs to one split)."""
    import braceexpand
    import yaml

    folder = Folder(root, storage_options)
    found = next(
        ((name, data) for name in SPLIT_FILES if (data := folder.read(f"{META_DIR}/{name}")) is not None), None
    )
    if found is None:
        return None, set()
    path = f"{folder.root}/{META_DIR}/{found[0]}"
    config = yaml.safe_load(found[1])  # JSON is YAML: one parser for both files
    parts = config.get("split_parts") if isinstance(config, dict) else None
    if not isinstance(parts, dict) or not all(isinstance(p, list) for p in parts.values()):
        raise ValueError(f"{path}: expected `split_parts: {{split: [shard patterns], ...}}`")
    excluded = {name for pattern in config.get("exclude") or [] for name in braceexpand.braceexpand(pattern)}
    split_of: dict[str, str] = {}
    for split, patterns in parts.items():
        for name in (n for pattern in patterns for n in braceexpand.braceexpand(pattern)):
            if name not in excluded and split_of.setdefault(name, split) != split:
                raise ValueError(f"{path}: shard {name} is in split {split_of[name]!r} and in {split!r}")
    return split_of, {e for e in excluded if "/" in e}


def energon_subflavors(root: str, storage_options: dict | None = None) -> dict:
    """The ``subflavors`` of the directory's ``.nv-meta/dataset.yaml`` (energon starts every sample's
    ``__subflavors__`` from them); ``{}`` when it names none."""
    import yaml

    data = Folder(root, storage_options).read(f"{META_DIR}/dataset.yaml")
    config = yaml.safe_load(data) if data else None
    found = config.get("subflavors") if isinstance(config, dict) else None
    return dict(found) if isinstance(found, dict) else {}


def energon_index(root: str, storage_options: dict | None = None) -> DatasetIndex:
    """The headrace index of an energon-prepared directory or URL, built from its ``index.sqlite``, with
    each shard's split from its ``split.yaml``."""
    folder = Folder(root, storage_options)
    shard_counts = json.loads(folder.read(f"{META_DIR}/.info.json"))["shard_counts"]
    names = list(shard_counts)
    split_of, excluded_samples = energon_splits(root, storage_options)
    db = folder.sqlite(f"{META_DIR}/index.sqlite")
    try:
        rows = db.execute(
            "SELECT tar_file_id, sample_index, sample_key, byte_offset, byte_size FROM samples "
            "ORDER BY tar_file_id, sample_index"
        ).fetchall()
        parts = db.execute(
            "SELECT tar_file_id, sample_index, part_name, content_byte_offset, content_byte_size "
            "FROM sample_parts ORDER BY tar_file_id, sample_index, content_byte_offset"
        ).fetchall()
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
    samples["offset"] = [r[3] for r in rows]
    samples["size"] = [r[4] for r in rows]
    samples["member_start"] = starts
    samples["member_count"] = np.diff(np.append(starts, len(parts)))
    samples["tokens"] = -1
    samples["duration"] = np.nan
    keys = np.array([r[2].encode() for r in rows], dtype=np.bytes_) if rows else np.zeros(0, "S1")
    # Keep the shards some split lists (renumbered densely) and the samples not excluded.
    kept = [i for i, name in enumerate(names) if split_of is None or name in split_of]
    new_id = np.full(len(names), -1, dtype=np.int64)
    new_id[kept] = np.arange(len(kept))
    keep = new_id[sample_ids[:, 0]] >= 0
    if excluded_samples:
        keep &= [f"{names[r[0]]}/{r[2]}" not in excluded_samples for r in rows]
    samples["shard"] = np.maximum(new_id[sample_ids[:, 0]], 0)
    samples, keys = samples[keep], keys[keep]
    counts = np.bincount(samples["shard"], minlength=len(kept))
    sizes = folder.sizes([names[i] for i in kept])
    shards = [
        ShardInfo(name=names[i], split=split_of[names[i]] if split_of else "train", samples=int(n), bytes=size)
        for i, n, size in zip(kept, counts, sizes)
    ]
    return DatasetIndex(
        shards=shards,
        extensions=extensions,
        samples=samples,
        members=members,
        keys=keys,
        job={"source": "energon index.sqlite"},
    )


__all__ = ["Folder", "energon_index", "energon_splits", "energon_subflavors", "is_energon_dir"]


# ---------------------------------------------------------------------------------------- lhotse


def is_lhotse_manifest(path: str) -> bool:
    return path.endswith(LHOTSE_MANIFEST_SUFFIXES) and "cuts" in Path(path).name


def is_lhotse_shar(path: str) -> bool:
    return Path(path).is_dir() and any(Path(path).glob("cuts.*.jsonl*")) and any(Path(path).glob("recording.*.tar"))


def transcript_json(cut_id: str, text: str, duration: float) -> bytes:
    """The ``json`` member of a cut, as ``dataio shard`` writes it for audio samples (its first fields)."""
    return json.dumps(
        {"text": text, "id": cut_id, "duration": duration}, ensure_ascii=False, separators=(",", ":")
    ).encode()


def _join_texts(texts) -> str:
    """A cut's transcript: its supervisions' non-blank texts, space-joined (``dataio shard``'s rule)."""
    return " ".join(t for t in texts if t and t.strip())


class LhotseCutSource:
    """A Lhotse CutSet manifest (``cuts.jsonl.gz``) as a loader source: sample i is cut i.

    Members per cut: ``wav`` (the audio) and ``json`` (``transcript_json``). When a cut spans a whole
    untransformed single-file mono recording, ``wav`` is that file's bytes as they are (FLAC, WAV, ...;
    libsndfile recognises the content whatever the extension says) and decoding happens in
    ``headrace.dataio.stream.reading.decode`` like any shard; otherwise (trimmed cuts, URLs, multi-source or transformed
    recordings) lhotse loads the audio and it is re-encoded to an in-memory float WAV (one encode per
    cut). Cuts are read lazily through ``headrace.dataio.stream.sources.cuts_index`` (an index of keys and durations,
    built in one streaming pass and cached beside the manifest; cut i parsed when read), so duration
    bucketing needs no decoding and a second open does not read the manifest.
    """

    def __init__(self, path: str):
        self.path = path
        self.cuts = CutsIndex(path)
        n = len(self.cuts)
        samples = np.zeros(n, SAMPLE_DTYPE)
        samples["tokens"] = -1
        samples["duration"] = self.cuts.durations
        self.index = DatasetIndex(
            shards=[ShardInfo(name=Path(path).name, samples=n)],
            extensions=["json", "wav"],
            samples=samples,
            members=np.zeros(0, MEMBER_DTYPE),
            keys=self.cuts.keys,
            job={"source": "lhotse CutSet"},
        )
        self.shard_starts, self.shard_sizes = np.array([0]), np.array([n])

    def __len__(self) -> int:
        return len(self.cuts)

    def read(self, indices: np.ndarray) -> list[tuple[str, str, dict[str, bytes]]]:
        return [
            (
                c.id,
                self.path,
                {
                    "wav": self._audio(c),
                    "json": transcript_json(c.id, _join_texts(s.text for s in c.supervisions), c.duration),
                },
            )
            for c in (self.cuts.load(i) for i in indices)
        ]

    def _audio(self, cut) -> bytes:
        """The cut's audio bytes; a ``SampleDecodeError`` naming the manifest and the cut when there are none (no
        recording, a missing or unreadable file): the loader counts it against ``max_bad_samples``."""
        if not cut.has_recording:
            raise SampleDecodeError("the cut has no recording", shard=self.path, key=cut.id, member="wav")
        try:
            return _cut_audio_bytes(cut)
        except Exception as e:  # lhotse and libsndfile raise many types for missing or unreadable audio
            raise SampleDecodeError(
                f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", shard=self.path, key=cut.id, member="wav"
            ) from None


def _cut_audio_bytes(cut) -> bytes:
    import soundfile
    from lhotse import MonoCut

    rec = cut.recording if isinstance(cut, MonoCut) else None  # mixed and padding cuts have no one recording
    whole_file = (
        rec is not None
        and len(rec.sources) == 1
        and rec.sources[0].type == "file"
        and not rec.transforms
        and rec.num_channels == 1
        and cut.start == 0
        and abs(cut.duration - rec.duration) < 1e-3
    )
    if whole_file:
        with open(rec.sources[0].source, "rb") as f:
            return f.read()
    audio = cut.load_audio()  # (channels, samples) float32
    buf = io.BytesIO()
    soundfile.write(buf, audio.T, cut.sampling_rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def shar_index(root: str) -> DatasetIndex:
    """The in-memory index of a Lhotse Shar directory's ``recording.NNNNNN.tar`` shards (plain tars
    of ``{cut_id}.{audio ext}`` plus ``{cut_id}.json``), built with ``headrace.dataio.shards.tarscan`` like any tar."""
    names = sorted(p.name for p in Path(root).glob("recording.*.tar"))
    return merge_parts([scan_shard(root, name) for name in names], job={"source": "lhotse Shar"})


def shar_transcripts(root: str, index: DatasetIndex) -> tuple[bytes, np.ndarray]:
    """The ``transcript_json`` of every sample of ``index`` (a ``shar_index``), parsed once from the
    Shar's ``cuts.NNNNNN.jsonl[.gz]`` files: one buffer plus ``len(index) + 1`` offsets (compact, and
    shared copy-on-write with forked workers). Shar writes each cuts file in its tar's order; a cut
    that does not match the tar's key at the same place is an error naming both files."""
    shard_of = index.samples["shard"]
    chunks: list[bytes] = []
    for shard_id, shard in enumerate(index.shards):
        number = shard.name.split(".")[1]  # recording.000003.tar -> 000003
        cuts_path = next(
            (p for p in (Path(root) / f"cuts.{number}.jsonl.gz", Path(root) / f"cuts.{number}.jsonl") if p.exists()),
            None,
        )
        if cuts_path is None:
            raise FileNotFoundError(f"{root}: {shard.name} has no cuts.{number}.jsonl.gz beside it")
        keys = index.keys[shard_of == shard_id]
        opener = gzip.open if cuts_path.suffix == ".gz" else open
        with opener(cuts_path, "rt", encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        if len(records) != len(keys):
            raise ValueError(f"{cuts_path}: {len(records)} cuts, but {shard.name} holds {len(keys)} recordings")
        for line, (rec, key) in enumerate(zip(records, keys.tolist()), 1):
            if rec.get("id", "").encode() != key:
                raise ValueError(
                    f"{cuts_path}:{line}: cut {rec.get('id')!r}, but {shard.name} holds "
                    f"{key.decode(errors='replace')!r} at that place"
                )
            chunks.append(transcript_json(rec["id"], *_text_and_duration(rec)))
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum([len(c) for c in chunks], out=offsets[1:])
    return b"".join(chunks), offsets


def _text_and_duration(rec: dict) -> tuple[str, float]:
    """Transcript and duration of one serialised cut: read off the dict for a MonoCut (the common
    case, no lhotse object built); a MixedCut keeps them in its tracks, so lhotse resolves it."""
    if "supervisions" in rec and "duration" in rec:
        return _join_texts(s.get("text") for s in rec["supervisions"]), rec["duration"]
    from lhotse.serialization import deserialize_item

    cut = deserialize_item(rec)
    return _join_texts(s.text for s in cut.supervisions), cut.duration


class SharSource(ShardSource):
    """A Lhotse Shar directory as a loader source: the ``recording`` tars read like any shard (see
    ``ShardSource``), each sample's ``json`` member replaced by its cut's ``transcript_json`` (Shar's
    own ``json`` member is the recording's metadata, which the loader has no use for)."""

    def __init__(self, path: str, *, split: str = "train", open_shards=None):
        super().__init__(path, split=split, index=shar_index(path), open_shards=open_shards)
        self._transcripts, self._transcript_offsets = shar_transcripts(path, self.index)
        if "json" not in self.index.extensions:  # appended: the members' extension ids stay valid
            self.index.extensions.append("json")

    def read(self, indices: np.ndarray) -> list[tuple[str, str, dict]]:
        out = super().read(indices)
        offsets = self._transcript_offsets
        for i, (_, _, members) in zip(np.asarray(indices).tolist(), out):
            members["json"] = self._transcripts[offsets[i] : offsets[i + 1]]
        return out


__all__ += [
    "LhotseCutSource",
    "SharSource",
    "is_lhotse_manifest",
    "is_lhotse_shar",
    "shar_index",
    "shar_transcripts",
    "transcript_json",
]
