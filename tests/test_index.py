"""`dataio index`: merges `.nv-meta/parts` sidecars (rescanning only shards without a usable one),
agrees with the metadata `dataio shard` wrote, and fails with one clear line on bad shard sets."""

from __future__ import annotations

import json
import shutil
import sqlite3

import numpy as np
import pytest

from headrace.dataio.shards.index import PARTS_DIR, ShardPart, load_index
from tests.test_energon_interop import make_samples, run_verb, write_shards


def _energon_files(root):
    """Everything energon reads, with sqlite reduced to its rows."""
    files = {p.name: p.read_bytes() for p in sorted(root.glob("*.tar.idx"))}
    for name in ("split.yaml", ".info.json", "dataset.yaml", "index.uuid"):
        files[name] = (root / ".nv-meta" / name).read_bytes()
    db = sqlite3.connect(root / ".nv-meta" / "index.sqlite")
    files["samples"] = list(db.execute("SELECT * FROM samples ORDER BY tar_file_id, sample_index"))
    files["parts"] = list(db.execute("SELECT * FROM sample_parts ORDER BY tar_file_id, sample_index, part_name"))
    db.close()
    return files


def test_parts_are_merged_and_only_missing_or_stale_ones_rescanned(tmp_path, capsys):
    write_shards(tmp_path, make_samples(n=12, seed=6), per_shard=3)
    assert run_verb("index", str(tmp_path), "--quiet", "--workers", "2") == 0
    assert "0 from parts, 4 scanned" in capsys.readouterr().out
    reference = _energon_files(tmp_path)
    parts_dir = tmp_path / PARTS_DIR

    # A part marked as "val" proves it was merged rather than rescanned (a scan says "train").
    marked = ShardPart.load(parts_dir / "shard-000001.tar.npz")
    marked.info.split = "val"
    marked.save(tmp_path)
    (parts_dir / "shard-000002.tar.npz").unlink()  # missing: rescanned
    stale = ShardPart.load(parts_dir / "shard-000003.tar.npz")
    stale.info.bytes += 512  # recorded for another version of the file: rescanned
    stale.info.split = "val"
    stale.save(tmp_path)

    assert run_verb("index", str(tmp_path), "--quiet", "--workers", "1") == 0
    assert "2 from parts, 2 scanned" in capsys.readouterr().out
    index = load_index(tmp_path)
    assert [s.split for s in index.shards] == ["train", "val", "train", "train"]
    now = _energon_files(tmp_path)
    assert now.pop("split.yaml") != reference.pop("split.yaml")
    now.pop("index.uuid"), reference.pop("index.uuid")  # derived from the splits too
    assert now == reference


def test_index_agrees_with_dataio_shard(tmp_path, capsys):
    pytest.importorskip("headrace.dataio.commands.shard")
    rng = np.random.default_rng(7)
    words = "the quick brown fox jumps over a lazy dog while rivers run to the sea".split()
    manifest = tmp_path / "text.jsonl"
    manifest.write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(3, 60))))}) + "\n" for _ in range(40))
    )
    out = tmp_path / "out"
    assert run_verb("shard", str(manifest), "--output", str(out), "--samples-per-shard", "7", "--quiet") == 0
    written = _energon_files(out)
    shard_index = load_index(out, mmap=False)

    shutil.rmtree(out / PARTS_DIR)  # as if the tars came from elsewhere: full rescan
    for name in ("index.sqlite", ".info.json", "split.yaml", "index.uuid"):
        (out / ".nv-meta" / name).unlink()
    for idx in out.glob("*.tar.idx"):
        idx.unlink()
    assert run_verb("index", str(out), "--quiet") == 0
    assert _energon_files(out) == written
    scanned = load_index(out, mmap=False)
    assert scanned.keys.tolist() == shard_index.keys.tolist()
    assert scanned.samples["offset"].tolist() == shard_index.samples["offset"].tolist()
    assert [scanned.sample_members(i) for i in range(len(scanned))] == [
        shard_index.sample_members(i) for i in range(len(shard_index))
    ]
    capsys.readouterr()
    assert run_verb("verify", str(out), "--quiet") == 0


def test_no_shards(tmp_path, capsys):
    assert run_verb("index", str(tmp_path)) == 2
    assert "no .tar shards" in capsys.readouterr().err


def test_truncated_shard_names_file_and_byte(tmp_path, capsys):
    write_shards(tmp_path, make_samples(n=4, seed=8), per_shard=2)
    shard = tmp_path / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:3000])
    assert run_verb("index", str(tmp_path), "--quiet", "--workers", "2") == 2
    err = capsys.readouterr().err
    assert "shard-000001.tar: byte" in err and "truncated" in err
    assert not (tmp_path / ".nv-meta" / ".info.json").exists()


def test_duplicate_keys_across_shards(tmp_path, capsys):
    samples = make_samples(n=4, seed=9)
    samples[3]["__key__"] = samples[0]["__key__"]
    write_shards(tmp_path, samples, per_shard=2)
    assert run_verb("index", str(tmp_path), "--quiet") == 2
    err = capsys.readouterr().err
    assert f"duplicate sample key {samples[0]['__key__']!r}" in err and "shard-000001.tar" in err
    assert not (tmp_path / ".nv-meta" / ".info.json").exists()


def test_split_assigns_whole_shards_by_name(tmp_path, capsys):
    import yaml

    from headrace.dataio.prepare.plan import assign_shard_splits, parse_splits

    samples = make_samples(n=24, seed=10)
    write_shards(tmp_path, samples, per_shard=2)  # 12 shards
    assert run_verb("index", str(tmp_path), "--quiet", "--split", "train=0.5,val=0.5") == 0
    out = capsys.readouterr().out
    names = [f"shard-{i:06d}.tar" for i in range(12)]
    expected = assign_shard_splits(names, parse_splits("train=0.5,val=0.5"))
    assert set(expected) == {"train", "val"}  # both splits get shards with this seed of names
    index = load_index(tmp_path)
    assert [s.split for s in index.shards] == expected
    split_yaml = yaml.safe_load((tmp_path / ".nv-meta" / "split.yaml").read_text())
    listed = {part: len(v) for part, v in split_yaml["split_parts"].items()}
    assert listed["val"] > 0 and listed["train"] > 0
    assert f"val {expected.count('val')} shards / {2 * expected.count('val')} samples" in out

    # The split lives in the sidecars: a later run without --split keeps it ...
    assert run_verb("index", str(tmp_path), "--quiet") == 0
    assert [s.split for s in load_index(tmp_path).shards] == expected
    # ... and a shard's split depends on its name alone, so adding shards moves none of the others.
    assert assign_shard_splits(names + ["shard-000012.tar"], parse_splits("train=0.5,val=0.5"))[:12] == expected
    # Another --split reassigns every shard (sidecars included), e.g. everything to train:
    assert run_verb("index", str(tmp_path), "--quiet", "--split", "train=1") == 0
    assert {s.split for s in load_index(tmp_path).shards} == {"train"}


def test_split_fraction_too_small_for_the_shards_is_reported(tmp_path, capsys):
    write_shards(tmp_path, make_samples(n=4, seed=11), per_shard=2)
    assert run_verb("index", str(tmp_path), "--quiet", "--split", "train=0.999,val=0.001") == 0
    assert "no shard fell into val" in capsys.readouterr().out
    assert run_verb("index", str(tmp_path), "--quiet", "--split", "train=0.9") == 2
    assert "sum to 1" in capsys.readouterr().err


def test_index_on_many_nodes_then_one_merge(tmp_path, capsys):
    """``--num-nodes 3 --node-rank R``: each node scans every third shard and leaves its sidecars, no
    index; a plain ``dataio index`` then merges them all, scanning nothing, into the files a one-node
    run writes. A node rank outside ``0..N-1`` is a one-line error (exit 2)."""
    single = tmp_path / "single"
    write_shards(single, make_samples(n=21, seed=7), per_shard=3)
    assert run_verb("index", str(single), "--quiet") == 0
    reference = _energon_files(single)
    nodes = tmp_path / "nodes"
    write_shards(nodes, make_samples(n=21, seed=7), per_shard=3)
    for rank in range(3):
        assert run_verb("index", str(nodes), "--quiet", "--num-nodes", "3", "--node-rank", str(rank)) == 0
        assert f"node {rank}/3: 0 shards already had sidecars" in capsys.readouterr().out
        assert not (nodes / ".nv-meta" / "headrace").exists()  # no index until the merge
    assert len(list((nodes / PARTS_DIR).glob("*.npz"))) == 7
    assert run_verb("index", str(nodes), "--quiet") == 0
    assert "7 from parts, 0 scanned" in capsys.readouterr().out
    assert _energon_files(nodes) == reference
    assert run_verb("index", str(nodes), "--quiet", "--num-nodes", "2", "--node-rank", "2") == 2
    assert "node rank 2 is outside 0..1" in capsys.readouterr().err
