"""An energon-prepared directory (no headrace index) streams through the loader from its index.sqlite."""

import sys
from pathlib import Path

from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

from dataio import build_loader
from dataio.index import INDEX_DIR

sys.path.insert(0, str(Path(__file__).parent))
from loader_util import make_text_dataset  # noqa: E402


def test_energon_prepared_directory(tmp_path):
    keys = make_text_dataset(tmp_path, [5, 3])
    for p in (tmp_path / INDEX_DIR).iterdir():  # leave only what `energon prepare` writes
        p.unlink()
    (tmp_path / INDEX_DIR).rmdir()
    WebdatasetPreparator.prepare_dataset(tmp_path, ["doc-000000.tar", "doc-000001.tar"],
                                         split_parts_ratio=[("train", 1.0)], workers=1)
    batches = list(build_loader({"datasets": [{"path": str(tmp_path)}], "batch_size": 8, "epochs": 1,
                                 "shuffle": False, "num_workers": 0}))
    assert batches[0]["__key__"] == keys
    assert [j["n"] for j in batches[0]["json"]] == list(range(8))
    assert batches[0]["__lengths__"]["tokens.npy"].sum() == batches[0]["tokens.npy"].numel()


def test_lhotse_cut_manifest_and_shar(tmp_path):
    import numpy as np
    import soundfile
    from lhotse import CutSet, Recording, SupervisionSegment

    cuts = []
    for i in range(5):
        path = tmp_path / f"a{i}.flac"
        soundfile.write(path, (np.sin(np.arange(1600 * (i + 1)) / 5) * 0.3).astype(np.float32), 16000)
        rec = Recording.from_file(path, recording_id=f"rec{i}")
        cut = rec.to_cut()
        cut.supervisions = [SupervisionSegment(id=f"s{i}", recording_id=rec.id, start=0, duration=rec.duration,
                                               text=f"words {i}")]
        cuts.append(cut)
    cutset = CutSet.from_cuts(cuts)
    manifest = tmp_path / "cuts.jsonl.gz"
    cutset.to_file(manifest)
    trimmed = tmp_path / "trimmed_cuts.jsonl.gz"
    CutSet.from_cuts([c.truncate(duration=0.05) for c in cuts]).to_file(trimmed)

    (batch,) = build_loader({"datasets": [{"path": str(manifest)}], "batch_size": 5, "epochs": 1,
                             "shuffle": False, "num_workers": 0})
    assert batch["__key__"] == [c.id for c in cuts]
    assert batch["txt"] == [f"words {i}" for i in range(5)]
    assert batch["__lengths__"]["wav"].tolist() == [1600 * (i + 1) for i in range(5)]
    (short,) = build_loader({"datasets": [{"path": str(trimmed)}], "batch_size": 5, "epochs": 1,
                             "shuffle": False, "num_workers": 0})
    assert short["wav"].shape == (5, 800)  # lhotse loaded the trimmed cuts (equal lengths: stacked)

    shar = tmp_path / "shar"
    shar.mkdir()
    cutset.to_shar(shar, fields={"recording": "flac"}, shard_size=2)
    keys = sorted(k for b in build_loader({"datasets": [{"path": str(shar)}], "batch_size": 2, "epochs": 1,
                                           "num_workers": 0}) for k in b["__key__"])
    assert keys == sorted(c.id for c in cuts)
