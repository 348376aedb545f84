"""Sample keys stay distinct (issue 34 item 21): ids that differ only in characters a key cannot hold ('文档' and
'资料', ``a.b`` and ``a_b``, ``a//b`` and ``a/b``) are escaped, not collapsed, so such corpora shard; a NeMo manifest
whose records carry an ``id`` is keyed by it, as the duplicate-key advice says. Through ``dataio shard`` and the
loader reading the keys back."""

from __future__ import annotations

import json

import numpy as np
import soundfile

from headrace.dataio import build_loader
from headrace.dataio.cli import main as dataio

IDS = ["文档", "资料", "a.b", "a_b", "a//b", "a/b", "/a/b", "a%2Eb", "x y", "x_y"]


def _keys(root):
    return sorted(
        k
        for b in build_loader({"datasets": [{"path": str(root)}], "batch_size": 64, "epochs": 1, "num_workers": 0})
        for k in b["__key__"]
    )


def test_ids_that_used_to_collide_shard_to_distinct_keys(tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text(
        "".join(json.dumps({"id": i, "text": f"doc {n}"}, ensure_ascii=False) + "\n" for n, i in enumerate(IDS))
    )
    assert dataio(["shard", str(tmp_path / "t.jsonl"), "-o", str(tmp_path / "out"), "--quiet"]) == 0, (
        capsys.readouterr().err
    )
    keys = _keys(tmp_path / "out")
    assert len(set(keys)) == len(IDS) and all("." not in k and not k.startswith("/") for k in keys), keys


def test_nemo_manifest_records_are_keyed_by_their_id(tmp_path, capsys):
    soundfile.write(tmp_path / "same.flac", np.full(1600, 0.1, np.float32), 16000)
    lines = [{"audio_filepath": "same.flac", "duration": 0.1, "text": "hi", "id": f"utt{i}"} for i in range(3)]
    (tmp_path / "m.json").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert dataio(["shard", str(tmp_path / "m.json"), "-o", str(tmp_path / "out"), "--quiet"]) == 0, (
        capsys.readouterr().err
    )
    assert _keys(tmp_path / "out") == ["utt0", "utt1", "utt2"]
