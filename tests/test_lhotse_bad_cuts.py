"""Lhotse cuts whose audio is missing (issue 34 item 19): read by the loader, each is a counted bad sample naming the
manifest and the cut, within ``max_bad_samples`` (was a raw ``AudioLoadingError`` / ``AttributeError`` that ignored the
budget); ``dataio shard`` skips a cut with no recording naming it (was "'NoneType' object has no attribute 'T'"); a
manifest whose name lacks "cuts" gets a hint, not only "not a directory"."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile

from headrace.dataio import build_loader
from headrace.dataio.cli import main as dataio
from headrace.dataio.usererror import SampleDecodeError


@pytest.fixture
def manifest(tmp_path):
    """Four cuts: two whole FLAC recordings, one whose file was deleted, one trimmed (lhotse loads it) from a
    deleted file; and a fifth with no recording at all."""
    from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

    cuts = []
    for i in range(4):
        path = tmp_path / f"a{i}.flac"
        soundfile.write(path, np.full(1600 * (i + 1), 0.1, np.float32), 16000)
        rec = Recording.from_file(path, recording_id=f"rec{i}")
        cut = rec.to_cut()
        cut.supervisions = [
            SupervisionSegment(id=f"s{i}", recording_id=rec.id, start=0, duration=rec.duration, text=f"words {i}")
        ]
        cuts.append(cut.truncate(duration=0.05) if i == 3 else cut)
    cuts.append(
        MonoCut(
            id="no-recording",
            start=0,
            duration=1.0,
            channel=0,
            supervisions=[SupervisionSegment(id="s", recording_id="none", start=0, duration=1.0, text="hi")],
        )
    )
    (tmp_path / "a2.flac").unlink()
    (tmp_path / "a3.flac").unlink()
    CutSet.from_cuts(cuts).to_file(tmp_path / "cuts.jsonl.gz")
    return tmp_path / "cuts.jsonl.gz"


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batch_size", [5, 1])
def test_loader_counts_cuts_without_audio_and_names_them(manifest, workers, batch_size, caplog):
    """Bad cuts are counted and named; at batch_size 1 (issue 46) none is replaced by a repeat or an empty batch."""
    config = {
        "datasets": [{"path": str(manifest)}],
        "batch_size": batch_size,
        "epochs": 1,
        "shuffle": False,
        "num_workers": workers,
        "max_bad_samples": 3,
    }
    loader = build_loader(config)
    batches = list(loader)
    keys = [k for b in batches for k in b["__key__"]]
    assert keys == ["rec0", "rec1"] and loader.state_dict()["bad_samples"] == 3
    assert all(len(b["__key__"]) for b in batches)
    named = rf"shard '{manifest}', key '(rec2|rec3|no-recording)'.*max_bad_samples=2"
    with pytest.raises(SampleDecodeError, match=named):
        list(build_loader({**config, "max_bad_samples": 2}))


def test_dataio_shard_names_a_cut_without_recording(manifest, tmp_path, capsys):
    code = dataio(["shard", str(manifest), "-o", str(tmp_path / "out"), "--quiet", "--skip-errors", "3"])
    assert code == 0, capsys.readouterr().err
    skipped = (tmp_path / "out" / "skipped.jsonl").read_text()
    assert "cut no-recording has no recording" in skipped and "NoneType" not in skipped, skipped


def test_a_manifest_without_cuts_in_its_name_gets_a_hint(manifest, tmp_path):
    renamed = manifest.rename(tmp_path / "train.jsonl.gz")
    with pytest.raises(Exception, match="its name must contain 'cuts'.*train_cuts.jsonl.gz"):
        build_loader({"datasets": [{"path": str(renamed)}], "num_workers": 0})
