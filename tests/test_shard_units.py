"""Unit tests of the shard writer's parts: the ustar writer, sizes, splits, planning and nodes."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

from dataio.readers import Entry
from dataio.sharding import assign_splits, key_hashes, parse_size, parse_splits, plan_job, resolve_node
from dataio.tarwriter import TarWriter, tar_header


def test_tar_writer_offsets_match_tarfile_and_headers_are_fixed():
    buf = io.BytesIO()
    tar = TarWriter(buf, sha256=True)
    long_name = "deep/" * 30 + "key.flac"  # > 100 bytes: uses the ustar prefix field
    payloads = {"a.txt": b"hello", long_name: b"x" * 1000, "b.json": b"", "c.npy": bytes(range(256)) * 3}
    spans = {name: tar.add(name, data) for name, data in payloads.items()}
    size = tar.close()
    data = buf.getvalue()
    assert size == len(data) and size % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        members = t.getmembers()
        assert [m.name for m in members] == list(payloads)
        for m in members:
            assert (m.offset_data, m.size) == (spans[m.name].offset, spans[m.name].size)
            assert (m.mtime, m.uid, m.gid, m.mode, m.uname, m.gname) == (0, 0, 0, 0o644, "", "")
            assert t.extractfile(m).read() == payloads[m.name]
    import hashlib

    assert tar.hexdigest() == hashlib.sha256(data).hexdigest()


def test_tar_header_limits():
    with pytest.raises(ValueError, match="too long"):
        tar_header("x" * 101, 1)
    with pytest.raises(ValueError, match="ustar limit"):
        tar_header("a.bin", 8**11)


@pytest.mark.parametrize("text, value", [("512MB", 512_000_000), ("1GiB", 1 << 30), ("100k", 100_000),
                                         ("4096", 4096), ("1.5 GB", 1_500_000_000)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_and_splits_reject_bad_values():
    for bad in ("", "12XB", "-1MB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError, match="sum to 1"):
        parse_splits("train=0.9,val=0.2")
    with pytest.raises(ValueError, match="NAME=FRACTION"):
        parse_splits("train")
    assert parse_splits(None) == [("train", 1.0)]


def test_split_assignment_is_a_function_of_the_key():
    keys = [f"doc-{i}" for i in range(20000)]
    splits = parse_splits("train=0.9,val=0.05,test=0.05")
    a = assign_splits(key_hashes(keys), splits)
    b = assign_splits(key_hashes(keys[::-1]), splits)[::-1]
    np.testing.assert_array_equal(a, b)
    fractions = np.bincount(a, minlength=3) / len(keys)
    np.testing.assert_allclose(fractions, [0.9, 0.05, 0.05], atol=0.01)


class FakeInput:
    def __init__(self, path, sizes):
        self.path, self.sizes = path, sizes

    def scan(self):
        for i, size in enumerate(self.sizes):
            yield Entry(key=f"{self.path}-{i}", est_bytes=size, line=i + 1)


def test_plan_cuts_by_size_and_count_and_assigns_nodes_round_robin():
    inputs = [FakeInput("a", [100] * 10), FakeInput("b", [250] * 4)]
    plan = plan_job(inputs, splits=[("train", 1.0)], shard_bytes=500, samples_per_shard=None)
    assert [len(s.entries) for s in plan.shards] == [5, 5, 2, 2]
    assert all(s.est_bytes <= 500 for s in plan.shards)
    assert [s.name for s in plan.shards] == [f"train-{i:06d}.tar" for i in range(4)]
    by_count = plan_job(inputs, splits=[("train", 1.0)], shard_bytes=None, samples_per_shard=6)
    assert [len(s.entries) for s in by_count.shards] == [6, 6, 2]
    nodes = [[s.name for s in by_count.for_node(2, r)] for r in range(2)]
    assert nodes == [["train-000000.tar", "train-000002.tar"], ["train-000001.tar"]]
    one_big = plan_job([FakeInput("c", [10_000])], splits=[("train", 1.0)], shard_bytes=500, samples_per_shard=None)
    assert [len(s.entries) for s in one_big.shards] == [1]  # an oversized sample still gets a shard


def test_resolve_node_from_flags_and_slurm():
    assert resolve_node(None, None, env={}) == (1, 0)
    assert resolve_node(4, 3, env={"SLURM_ARRAY_TASK_COUNT": "9", "SLURM_ARRAY_TASK_ID": "1"}) == (4, 3)
    assert resolve_node(None, None, env={"SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_ID": "3",
                                         "SLURM_ARRAY_TASK_MIN": "1"}) == (4, 2)
    assert resolve_node(None, None, env={"SLURM_NTASKS": "8", "SLURM_PROCID": "5"}) == (8, 5)
    with pytest.raises(ValueError, match="outside"):
        resolve_node(2, 2, env={})
