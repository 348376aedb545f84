"""Datasets prepared by other tools, read through the same loader.

``energon_index(root)``: a directory prepared by Megatron-Energon (``energon prepare``) but never
indexed by headrace. Energon's ``.nv-meta/index.sqlite`` already holds what the loader needs --
``samples(tar_file_id, sample_key, sample_index, byte_offset, byte_size)`` and
``sample_parts(tar_file_id, sample_index, part_name, content_byte_offset, content_byte_size)`` -- and
``.nv-meta/.info.json`` lists the shards in ``tar_file_id`` order. Two SQL queries and a few numpy
operations turn them into an in-memory ``DatasetIndex`` (nothing is written into the directory);
cost is one pass over the sqlite rows (~1 s per 1M parts). Every shard counts as split ``train``
(energon's ``split.yaml`` patterns are not interpreted); token counts and durations are unknown.

Lhotse: a cuts manifest (``cuts.jsonl.gz``) becomes a ``LhotseCutSource`` (random access to cut i,
audio + transcript members); a Shar directory's ``recording.NNNNNN.tar`` files are plain tars, so
they are indexed in memory with ``dataio.tarscan`` and read like any shard (``shar_index``; the
transcripts in Shar's ``cuts.NNNNNN.jsonl.gz`` are not attached yet).
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


# ---------------------------------------------------------------------------------------- lhotse

LHOTSE_MANIFEST_SUFFIXES = (".jsonl.gz", ".jsonl", ".json", ".json.gz")


def is_lhotse_manifest(path: str) -> bool:
    return path.endswith(LHOTSE_MANIFEST_SUFFIXES) and "cuts" in Path(path).name


def is_lhotse_shar(path: str) -> bool:
    return Path(path).is_dir() and any(Path(path).glob("cuts.*.jsonl*")) and any(Path(path).glob("recording.*.tar"))


class LhotseCutSource:
    """A Lhotse CutSet manifest (``cuts.jsonl.gz``) as a loader source: sample i is cut i.

    Members per cut: ``wav`` (the audio) and ``txt`` (its supervisions' text, space-joined). When a
    cut spans a whole single-file recording, ``wav`` is that file's bytes as they are (FLAC, WAV, ...;
    libsndfile recognises the content whatever the extension says) and decoding happens in
    ``dataio.decode`` like any shard; otherwise (trimmed cuts, URLs, multi-source recordings) lhotse
    loads the audio and it is re-encoded to an in-memory float WAV (costs one encode per cut).
    The cuts live in memory (lhotse's eager CutSet: ~1 KB per cut); durations come from the manifest,
    so duration bucketing needs no decoding.
    """

    def __init__(self, path: str):
        from lhotse import CutSet

        self.path = path
        self.cuts = list(CutSet.from_file(path))
        n = len(self.cuts)
        samples = np.zeros(n, SAMPLE_DTYPE)
        samples["tokens"] = -1
        samples["duration"] = [c.duration for c in self.cuts]
        keys = np.array([c.id.encode() for c in self.cuts], dtype=np.bytes_) if n else np.zeros(0, "S1")
        self.index = DatasetIndex(shards=[ShardInfo(name=Path(path).name, samples=n)], extensions=["txt", "wav"],
                                  samples=samples, members=np.zeros(0, MEMBER_DTYPE), keys=keys,
                                  job={"source": "lhotse CutSet"})
        self.shard_starts, self.shard_sizes = np.array([0]), np.array([n])

    def __len__(self) -> int:
        return len(self.cuts)

    def read(self, indices: np.ndarray) -> list[tuple[str, str, dict[str, bytes]]]:
        return [(c.id, self.path, {"wav": _cut_audio_bytes(c), "txt": _cut_text(c).encode()})
                for c in (self.cuts[int(i)] for i in indices)]


def _cut_text(cut) -> str:
    return " ".join(s.text for s in cut.supervisions if s.text)


def _cut_audio_bytes(cut) -> bytes:
    import io

    import soundfile

    rec = getattr(cut, "recording", None)
    whole_file = (rec is not None and len(rec.sources) == 1 and rec.sources[0].type == "file"
                  and rec.num_channels == 1 and cut.start == 0 and abs(cut.duration - rec.duration) < 1e-3)
    if whole_file:
        with open(rec.sources[0].source, "rb") as f:
            return f.read()
    audio = cut.load_audio()  # (channels, samples) float32
    buf = io.BytesIO()
    soundfile.write(buf, audio.T, cut.sampling_rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def shar_index(root: str) -> DatasetIndex:
    """The in-memory index of a Lhotse Shar directory's ``recording.NNNNNN.tar`` shards (plain tars
    of ``{cut_id}.{audio ext}`` plus ``{cut_id}.json``), built with ``dataio.tarscan`` like any tar."""
    from dataio.index import merge_parts
    from dataio.tarscan import scan_shard

    names = sorted(p.name for p in Path(root).glob("recording.*.tar"))
    return merge_parts([scan_shard(root, name) for name in names], job={"source": "lhotse Shar"})


__all__ += ["LhotseCutSource", "is_lhotse_manifest", "is_lhotse_shar", "shar_index"]
