"""Sample keys stay distinct (issue 34 item 21): ids that differ only in characters a key cannot hold ('文档' and
'资料', ``a.b`` and ``a_b``, ``a//b`` and ``a/b``) are escaped, not collapsed, so such corpora shard; a NeMo manifest
whose records carry an ``id`` is keyed by it, as the duplicate-key advice says; without one, by the audio path
relative to the manifest's folder, the same in any folder on any machine (issue 48). Through ``dataio shard`` and the
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


def _shard_keys(manifest, out, capsys) -> list[str]:
    assert dataio(["shard", str(manifest), "-o", str(out), "--quiet"]) == 0, capsys.readouterr().err
    return _keys(out)


def _corpus(root, manifest_dir=None, absolute=False):
    """``root/audio/spk{1,2}/u{0,1}.flac`` and a NeMo manifest of them (and one segment) in ``manifest_dir`` (default:
    ``root``), audio paths relative to the manifest's folder or absolute."""
    manifest_dir = manifest_dir or root
    lines = []
    for spk in ("spk1", "spk2"):
        (root / "audio" / spk).mkdir(parents=True)
        for u in range(2):
            soundfile.write(root / "audio" / spk / f"u{u}.flac", np.full(3200, 0.1, np.float32), 16000)
            path = root / "audio" / spk / f"u{u}.flac"
            lines.append({"audio_filepath": str(path if absolute else path.relative_to(manifest_dir)), "duration": 0.2})
    lines.append({**lines[0], "offset": 0.1, "duration": 0.1})
    manifest_dir.mkdir(parents=True, exist_ok=True)
    manifest = manifest_dir / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({**r, "text": "hi"}) + "\n" for r in lines))
    return manifest


def test_nemo_keys_are_relative_to_the_manifest_and_the_same_in_any_folder(tmp_path, capsys):
    """The same corpus sharded from two machines' folders (relative paths, absolute ones, a folder reached through
    a link) gives the same keys, holding none of the machine's folders; absolute paths outside the manifest's folder
    keep their last folder and file name (was: the escaped absolute path, ``%2Fhome%2Fuser%2F...``)."""
    inside = ["audio/spk1/u0", "audio/spk1/u0_100", "audio/spk1/u1", "audio/spk2/u0", "audio/spk2/u1"]
    alice, mnt = tmp_path / "home" / "alice" / "asr", tmp_path / "mnt" / "data" / "asr"
    assert _shard_keys(_corpus(alice), tmp_path / "a", capsys) == inside
    assert _shard_keys(_corpus(mnt, absolute=True), tmp_path / "b", capsys) == inside
    (tmp_path / "link").symlink_to(mnt)  # absolute paths written through a link to the manifest's folder
    through_link = tmp_path / "link" / "through_link.jsonl"
    through_link.write_text((mnt / "manifest.jsonl").read_text().replace(str(mnt), str(tmp_path / "link")))
    assert _shard_keys(through_link, tmp_path / "c", capsys) == inside
    outside = [k.removeprefix("audio/") for k in inside]
    for name, root in (("d", tmp_path / "srv" / "asr"), ("e", tmp_path / "scratch" / "asr")):
        manifest = _corpus(root, manifest_dir=tmp_path / "manifests" / name, absolute=True)
        assert _shard_keys(manifest, tmp_path / name, capsys) == outside
