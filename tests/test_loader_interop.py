"""Sources prepared by other tools stream through the loader: an energon-prepared directory (no
headrace index; its split.yaml decides which shards a split reads), a Lhotse cuts manifest and a
Lhotse Shar directory (transcripts carried as the `json` member `dataio shard` writes)."""

from pathlib import Path

import numpy as np
import pytest
import soundfile
import yaml

pytest.importorskip("megatron.energon", reason="megatron-energon is the bench extra (tools/setup.sh installs it)")
from megatron.energon.epathlib import EPath  # noqa: E402
from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta  # noqa: E402

from headrace.dataio import build_loader

from tests.loader_util import energon_prepared


def stream_keys(path: Path, **entry) -> list[str]:
    return [
        k
        for b in build_loader(
            {
                "datasets": [{"path": str(path), **entry}],
                "batch_size": 4,
                "epochs": 1,
                "shuffle": False,
                "num_workers": 0,
            }
        )
        for k in b["__key__"]
    ]


def test_energon_prepared_directory(tmp_path):
    keys = energon_prepared(tmp_path, [5, 3], split_parts_ratio=[("train", 1.0)])
    batches = list(
        build_loader(
            {"datasets": [{"path": str(tmp_path)}], "batch_size": 8, "epochs": 1, "shuffle": False, "num_workers": 0}
        )
    )
    assert batches[0]["__key__"] == keys
    assert [j["n"] for j in batches[0]["json"]] == list(range(8))
    assert batches[0]["__lengths__"]["tokens.npy"].sum() == batches[0]["tokens.npy"].numel()


def test_energon_split_yaml_selects_the_split(tmp_path):
    sizes = [3, 2, 4, 1, 2]
    keys = energon_prepared(
        tmp_path, sizes, split_parts_patterns=[("train", r"doc-00000[0-2]\.tar"), ("val", r"doc-00000[34]\.tar")]
    )
    split_file = tmp_path / ".nv-meta" / "split.yaml"
    assert "{" in split_file.read_text()  # energon wrote brace patterns (doc-{000000..000002}.tar)
    # Exclude one whole shard and one sample, the two forms energon's `exclude` takes.
    config = yaml.safe_load(split_file.read_text())
    config["exclude"] = ["doc-000001.tar", f"doc-000002.tar/{keys[6]}"]
    split_file.write_text(yaml.safe_dump(config))

    shard_keys = dict(
        zip([f"doc-{i:06d}.tar" for i in range(len(sizes))], np.split(np.array(keys), np.cumsum(sizes)[:-1]))
    )
    for split in ("train", "val"):  # energon's own reading of the split is the oracle
        meta = WebdatasetMeta.from_config(EPath(tmp_path), split_part=split)
        expected = [k for s in meta.shards for k in shard_keys[s.name] if f"{s.name}/{k}" not in meta.sample_excludes]
        assert stream_keys(tmp_path, split=split) == expected
    assert stream_keys(tmp_path, split="val") == keys[9:]
    assert keys[6] not in stream_keys(tmp_path) and keys[3] not in stream_keys(tmp_path)
    with pytest.raises(ValueError, match=r"no shards in split 'test' \(splits: train, val\)"):
        build_loader({"datasets": [{"path": str(tmp_path), "split": "test"}], "num_workers": 0})


def test_energon_split_yaml_errors(tmp_path):
    energon_prepared(tmp_path, [2, 2], split_parts_ratio=[("train", 1.0)])
    split_file = tmp_path / ".nv-meta" / "split.yaml"
    split_file.write_text(
        yaml.safe_dump({"split_parts": {"train": ["doc-{000000..000001}.tar"], "val": ["doc-000001.tar"]}})
    )
    with pytest.raises(ValueError, match=r"split.yaml: shard doc-000001.tar is in split 'train' and in 'val'"):
        build_loader({"datasets": [{"path": str(tmp_path)}], "num_workers": 0})
    split_file.write_text("split_parts: [doc-000000.tar]\n")
    with pytest.raises(ValueError, match=r"split.yaml: expected `split_parts"):
        build_loader({"datasets": [{"path": str(tmp_path)}], "num_workers": 0})


@pytest.fixture
def cutset(tmp_path):
    """Five whole-recording FLAC cuts (1600 * (i + 1) samples at 16 kHz) with transcripts."""
    from lhotse import CutSet, Recording, SupervisionSegment

    cuts = []
    for i in range(5):
        path = tmp_path / f"a{i}.flac"
        soundfile.write(path, (np.sin(np.arange(1600 * (i + 1)) / 5) * 0.3).astype(np.float32), 16000)
        rec = Recording.from_file(path, recording_id=f"rec{i}")
        cut = rec.to_cut()
        cut.supervisions = [
            SupervisionSegment(id=f"s{i}", recording_id=rec.id, start=0, duration=rec.duration, text=f"words {i}")
        ]
        cuts.append(cut)
    return CutSet.from_cuts(cuts)


def transcript(cut) -> dict:
    """The `json` member `dataio shard` writes for a cut (its text / id / duration fields)."""
    return {"text": " ".join(s.text for s in cut.supervisions), "id": cut.id, "duration": cut.duration}


def test_lhotse_cut_manifest(tmp_path, cutset):
    from lhotse import CutSet

    manifest = tmp_path / "cuts.jsonl.gz"
    cutset.to_file(manifest)
    (batch,) = build_loader(
        {"datasets": [{"path": str(manifest)}], "batch_size": 5, "epochs": 1, "shuffle": False, "num_workers": 0}
    )
    assert batch["__key__"] == [c.id for c in cutset]
    assert batch["json"] == [transcript(c) for c in cutset]
    assert batch["__lengths__"]["wav"].tolist() == [1600 * (i + 1) for i in range(5)]

    trimmed = tmp_path / "trimmed_cuts.jsonl.gz"
    CutSet.from_cuts([c.truncate(duration=0.05) for c in cutset]).to_file(trimmed)
    (short,) = build_loader(
        {"datasets": [{"path": str(trimmed)}], "batch_size": 5, "epochs": 1, "shuffle": False, "num_workers": 0}
    )
    assert short["wav"].shape == (5, 800)  # lhotse loaded the trimmed cuts (equal lengths: stacked)
    assert [j["duration"] for j in short["json"]] == [0.05] * 5


def test_lhotse_shar_carries_transcripts(tmp_path, cutset):
    shar = tmp_path / "shar"
    shar.mkdir()
    cutset.to_shar(shar, fields={"recording": "flac"}, shard_size=2)
    expected = {c.id: transcript(c) for c in cutset}
    for workers in (0, 2):
        batches = list(
            build_loader({"datasets": [{"path": str(shar)}], "batch_size": 2, "epochs": 1, "num_workers": workers})
        )
        got = {k: j for b in batches for k, j in zip(b["__key__"], b["json"])}
        assert got == expected
    bucketed = list(
        build_loader(
            {
                "datasets": [{"path": str(shar)}],
                "epochs": 1,
                "num_workers": 0,
                "bucketing": {"max_duration": 0.6, "num_buckets": 2},
            }
        )
    )
    texts = {k: t for b in bucketed for k, t in zip(b["__key__"], b["text"])}
    assert texts == {c.id: f"words {i}" for i, c in enumerate(cutset)}


def test_lhotse_shar_mismatched_cuts_file(tmp_path, cutset):
    import gzip

    shar = tmp_path / "shar"
    shar.mkdir()
    cutset.to_shar(shar, fields={"recording": "flac"}, shard_size=2)
    cuts_file = shar / "cuts.000001.jsonl.gz"
    lines = gzip.decompress(cuts_file.read_bytes()).splitlines(keepends=True)
    cuts_file.write_bytes(gzip.compress(b"".join(lines[::-1])))  # cuts out of their tar's order
    with pytest.raises(
        ValueError,
        match=r"cuts.000001.jsonl.gz:1: cut 'rec3', but recording.000001.tar holds "
        r"'rec2' at that place",
    ):
        build_loader({"datasets": [{"path": str(shar)}], "num_workers": 0})


def test_lhotse_manifest_is_indexed_once_and_read_lazily(tmp_path, cutset):
    """The first open streams the manifest into an index cached beside it; a second open reads only the
    cache (the manifest's bytes are replaced by junk of the same size and mtime: same batch); a changed
    manifest is re-indexed. Durations match lhotse's, so bucketing works unchanged."""
    import os

    from headrace.dataio.stream.sources.cuts_index import BLOCK_LINES, CutsIndex

    manifest = tmp_path / "cuts.jsonl.gz"
    many = cutset.repeat(times=30, preserve_id=False)  # 150 cuts: three compressed blocks
    many.to_file(manifest)
    assert len(many) > 2 * BLOCK_LINES
    config = {"datasets": [{"path": str(manifest)}], "batch_size": 7, "epochs": 1, "shuffle": True, "num_workers": 0}
    first = [(b["__key__"], b["json"]) for b in build_loader(config)]
    assert sorted(k for keys, _ in first for k in keys) == sorted(c.id for c in many)
    index = CutsIndex(str(manifest))
    assert index.durations.tolist() == [c.duration for c in many]
    assert index.load(BLOCK_LINES + 3).to_dict() == many[BLOCK_LINES + 3].to_dict()

    stat = manifest.stat()
    manifest.write_bytes(b"x" * stat.st_size)
    os.utime(manifest, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert [(b["__key__"], b["json"]) for b in build_loader(config)] == first  # the manifest was not read

    cutset.to_file(manifest)  # a different manifest (size and mtime change): indexed again
    assert len(CutsIndex(str(manifest))) == 5
