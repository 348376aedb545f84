"""`dataio inspect` figures from known samples; `dataio verify` passes clean data and names the shard,
key and byte offset of each kind of corruption, with exit status 1."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest

from headrace.dataio.shards.index import INDEX_DIR, load_index
from tests.test_energon_interop import make_samples, run_verb, write_shards


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify") / "ds"
    samples = make_samples(n=10, seed=1)
    write_shards(root, samples, per_shard=4)
    assert run_verb("index", str(root), "--checksum", "--quiet", "--workers", "1") == 0
    return root, samples


def _copy(clean, tmp_path):
    root = tmp_path / "ds"
    shutil.copytree(clean[0], root)
    return root


def _fail(root, capsys) -> str:
    capsys.readouterr()
    assert run_verb("verify", str(root), "--quiet", "--workers", "2") == 1
    return capsys.readouterr().err


def test_inspect_json_fields(clean, capsys):
    root, samples = clean
    capsys.readouterr()
    assert run_verb("inspect", str(root), "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["shards"] == 3 and got["samples"] == len(samples)
    assert got["bytes"] == sum(p.stat().st_size for p in root.glob("*.tar"))
    assert got["tokens"] == sum(s["_tokens"] for s in samples)
    assert got["audio_hours"] == pytest.approx(sum(s["_duration"] for s in samples) / 3600, rel=1e-5)
    assert got["samples_with_tokens"] == got["samples_with_duration"] == len(samples)
    assert got["splits"] == {
        "train": {
            "shards": 3,
            "samples": len(samples),
            "bytes": got["bytes"],
            "audio_hours": pytest.approx(got["audio_hours"]),
            "tokens": got["tokens"],
        }
    }
    assert sorted(got["extensions"]) == ["json", "tokens.npy", "txt", "wav"]
    for name, values in (
        ("tokens", [s["_tokens"] for s in samples]),
        ("duration_s", [s["_duration"] for s in samples]),
    ):
        h = got["histograms"][name]
        assert sum(h["counts"]) == len(samples)
        assert h["edges"][0] <= min(values) and max(values) < h["edges"][-1]
        assert h["counts"] == np.histogram(values, bins=h["edges"])[0].tolist()


def test_inspect_table_renders(clean, capsys):
    assert run_verb("inspect", str(clean[0])) == 0
    out = capsys.readouterr().out
    assert "audio hours" in out and "tokens per sample" in out and "train" in out


def test_verify_clean_passes(clean, capsys):
    capsys.readouterr()
    assert run_verb("verify", str(clean[0]), "--quiet") == 0
    assert "OK" in capsys.readouterr().out


def test_verify_flipped_payload_byte_fails_checksum(clean, tmp_path, capsys):
    root = _copy(clean, tmp_path)
    index = load_index(root)
    offset, _ = index.sample_members(5)["wav"]
    shard = index.shards[int(index.samples["shard"][5])].name
    with open(root / shard, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    err = _fail(root, capsys)
    assert shard in err and "sha256" in err


def test_verify_truncated_tar(clean, tmp_path, capsys):
    root = _copy(clean, tmp_path)
    index = load_index(root)
    shard = root / index.shards[1].name
    cut = int(index.samples["offset"][6]) + 700  # inside sample 6 (second of shard 1)
    shard.write_bytes(shard.read_bytes()[:cut])
    err = _fail(root, capsys)
    assert index.shards[1].name in err and repr(index.key(6)) in err and f"byte {cut}" in err


def test_verify_index_offset_disagrees(clean, tmp_path, capsys):
    root = _copy(clean, tmp_path)
    path = root / INDEX_DIR / "samples.npy"
    samples = np.load(path)
    samples["offset"][2] += 512
    np.save(path, samples)
    err = _fail(root, capsys)
    index = load_index(root)
    assert index.shards[0].name in err and repr(index.key(2)) in err
    assert f"byte {int(samples['offset'][2])}" in err


def _bad_member_dataset(tmp_path, member: str, payload: bytes):
    samples = make_samples(n=6, seed=2)
    samples[4][member] = payload
    root = tmp_path / "bad"
    write_shards(root, samples, per_shard=3)
    assert run_verb("index", str(root), "--quiet", "--workers", "1") == 0
    index = load_index(root)
    return root, index.key(4), index.sample_members(4)[member][0], index.shards[1].name


def test_verify_undecodable_audio(tmp_path, capsys):
    root, key, offset, shard = _bad_member_dataset(tmp_path, "wav", b"RIFF\x00\x01\x00\x00WAVEjunk" * 20)
    err = _fail(root, capsys)
    assert shard in err and repr(key) in err and f"byte {offset}" in err and ".wav" in err


def test_verify_bad_npy(tmp_path, capsys):
    npy = io.BytesIO()
    np.save(npy, np.arange(10, dtype=np.uint16))
    truncated = npy.getvalue()[:-6]  # header promises 20 bytes of data, 14 are there
    root, key, offset, shard = _bad_member_dataset(tmp_path, "tokens.npy", truncated)
    err = _fail(root, capsys)
    assert shard in err and repr(key) in err and f"byte {offset}" in err and "npy" in err


def test_verify_pickled_npy_refused(tmp_path, capsys):
    npy = io.BytesIO()
    np.save(npy, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    root, key, offset, shard = _bad_member_dataset(tmp_path, "tokens.npy", npy.getvalue())
    err = _fail(root, capsys)
    assert repr(key) in err and "pickle" in err


def test_verify_tar_idx_disagrees(clean, tmp_path, capsys):
    root = _copy(clean, tmp_path)
    idx = root / (load_index(root).shards[2].name + ".idx")
    entries = np.fromfile(idx, dtype="=u8")
    entries[1] += 512
    entries.tofile(idx)
    err = _fail(root, capsys)
    assert idx.name in err and "entry 1" in err


def test_verify_without_index_is_a_clear_error(tmp_path, capsys):
    assert run_verb("verify", str(tmp_path)) == 2
    assert "dataio index" in capsys.readouterr().err
