"""The tar header scanner against `tarfile` on every header flavour, and `write_dataset_metadata`:
split parts, collapse against energon's, atomic failure."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import yaml

from headrace.dataio.shards.index import merge_parts
from headrace.dataio.shards.metadata import collapse_names, write_dataset_metadata
from headrace.dataio.shards.tarscan import TarFormatError, scan_members, scan_shard, split_name
from tests.test_energon_interop import make_samples, write_shards


def _tar(fmt: int, names: list[str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        tar.addfile(tarfile.TarInfo("somedir"), None)  # directory-ish entry of size 0
        d = tarfile.TarInfo("adir")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        for i, name in enumerate(names):
            data = bytes([i % 251]) * (i * 300 + 1)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


NAMES = [
    "a/b/k1.txt",
    "a/b/k1.json",
    "p" * 150 + "/key2.wav",
    "key3." + "e" * 120,
    "ü-ключ.txt",
    "__meta__/x.json",
    "noext",
]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_scan_matches_tarfile(fmt):
    names = NAMES if fmt != tarfile.USTAR_FORMAT else [n for n in NAMES if "e" * 120 not in n]
    data = _tar(fmt, names)
    members, end = scan_members(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        want = [(m.name, m.offset, m.offset_data, m.size) for m in tar if m.isreg()]
        tar_end = tar.offset
    assert [(m.name, m.header_offset, m.offset, m.size) for m in members] == want
    assert end == tar_end


def test_split_name_is_webdatasets_rule():
    from webdataset.tariterators import base_plus_ext

    for name in ["a/b/k1.txt", "a.b/c.d.e", "k.tokens.npy", "noext", "dir/.hidden", "x/y"]:
        expected = base_plus_ext(name)
        assert split_name(name) == (None if expected[0] is None else expected)
    assert split_name("__meta__/x.json") is None


def test_scan_rejects_bad_checksum_and_truncation():
    data = bytearray(_tar(tarfile.PAX_FORMAT, ["k.txt", "k.json"]))
    members, _ = scan_members(bytes(data))
    broken = bytearray(data)
    broken[members[1].offset - 512 + 10] ^= 0xFF  # inside the second member's ustar header
    with pytest.raises(TarFormatError, match="checksum") as e:
        scan_members(bytes(broken), path="x.tar")
    assert "x.tar" in str(e.value) and e.value.offset == members[1].offset - 512
    with pytest.raises(TarFormatError, match="truncated"):
        scan_members(bytes(data[: members[1].offset + 10]))


def test_collapse_matches_energon():
    from megatron.energon.bracecollapse import collapse

    cases = [
        [],
        ["a-000.tar"],
        [f"s-{i:06d}.tar" for i in range(12)],
        ["a-000.tar", "a-001.tar", "a-003.tar", "b/x-1.tar", "b/x-2.tar", "p0/s-09.tar", "p0/s-10.tar"],
        ["a8.tar", "a9.tar", "a10.tar"],
        ["n0/s-00.tar", "n0/s-01.tar", "n1/s-00.tar", "n1/s-01.tar"],
    ]
    for names in cases:
        assert collapse_names(names) == collapse(names, keep_order=True)


def _index(root, splits):
    names = sorted(p.name for p in root.glob("*.tar"))
    parts = [scan_shard(root, n, split=s) for n, s in zip(names, splits)]
    return merge_parts(parts)


def test_splits_from_shard_info_and_energon_reads_val(tmp_path):
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    samples = make_samples(n=9, seed=3)
    write_shards(tmp_path, samples, per_shard=3)
    write_dataset_metadata(tmp_path, _index(tmp_path, ["train", "val", "train"]), workers=2)
    split = yaml.safe_load((tmp_path / ".nv-meta" / "split.yaml").read_text())
    assert split == {
        "split_parts": {"train": ["shard-000000.tar", "shard-000002.tar"], "val": ["shard-000001.tar"], "test": []},
        "exclude": [],
    }
    from tests.test_energon_interop import _encoder

    ds = get_val_dataset(
        tmp_path,
        split_part="val",
        batch_size=1,
        task_encoder=_encoder(),
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
    )
    assert [u.__key__ for b in get_loader(ds) for u in b] == [s["__key__"] for s in samples[3:6]]


def test_rewrite_is_deterministic_and_failure_leaves_no_complete_set(tmp_path):
    samples = make_samples(n=6, seed=4)
    write_shards(tmp_path, samples, per_shard=3)
    index = _index(tmp_path, ["train", "train"])
    write_dataset_metadata(tmp_path, index)
    meta = tmp_path / ".nv-meta"
    before = {p.name: p.read_bytes() for p in meta.iterdir() if p.is_file() and p.name != "index.sqlite"}
    write_dataset_metadata(tmp_path, index)
    assert before == {p.name: p.read_bytes() for p in meta.iterdir() if p.is_file() and p.name != "index.sqlite"}

    index.keys = index.keys.copy()
    index.keys[4] = index.keys[1]  # a key in both shards: energon's UNIQUE constraint
    with pytest.raises(ValueError, match=r"duplicate sample key .*shard-000000.tar and shard-000001.tar"):
        write_dataset_metadata(tmp_path, index)
    assert not (meta / ".info.json").exists()  # energon will not take the directory as prepared
    assert not [p for p in meta.rglob("*") if ".tmp-" in p.name]


def test_empty_shard_is_refused(tmp_path):
    (tmp_path / "shard-000000.tar").write_bytes(_tar(tarfile.PAX_FORMAT, ["noext"]))
    with pytest.raises(ValueError, match="no samples"):
        write_dataset_metadata(tmp_path, _index(tmp_path, ["train"]))


def test_lengths_from_npy_and_audio_headers(tmp_path):
    samples = make_samples(n=5, seed=5)
    write_shards(tmp_path, samples, per_shard=5)
    part = scan_shard(tmp_path, "shard-000000.tar")
    assert part.samples["tokens"].tolist() == [s["_tokens"] for s in samples]
    np.testing.assert_allclose(part.samples["duration"], [s["_duration"] for s in samples], rtol=1e-6)
