"""Datasets with more shards than a process may open files: the loader's descriptors and maps stay
within a budget (``headrace.dataio.stream.sources.openshards``), a shard reopened after eviction is still checked
for being the version first read, and the loader's state does not grow with the data."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from headrace.dataio.loader import build_loader
from headrace.dataio.usererror import SampleDecodeError
from tests import loader_util
from tests.helpers import REPO, child_env

SHARDS, PER_SHARD, NOFILE = 300, 3, 240  # more shards than descriptors allowed

# Runs in a child with RLIMIT_NOFILE lowered (the test process keeps its own limit): one full epoch
# per (workers, packed), the keys or document pieces served, and the most descriptors open at a batch.
CHILD = textwrap.dedent("""
    import collections, json, os, resource, sys
    root, nofile = sys.argv[1], int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    from headrace.dataio.loader import build_loader
    out = {}
    for workers in (0, 2):
        for packed in (False, True):
            cfg = {"datasets": [{"path": root}], "batch_size": 8, "epochs": 1, "num_workers": workers,
                   "shuffle": True, "seed": 1}
            if packed:
                cfg.update(packing="greedy", seq_len=64)
            keys, docs, fds = [], collections.Counter(), 0
            for batch in build_loader(cfg):
                fds = max(fds, len(os.listdir("/proc/self/fd")))
                if packed:
                    for row in batch["__docs__"]:
                        for ref, _, length in row:
                            docs[str(ref)] += length
                else:
                    keys += batch["__key__"]
            out[f"{workers}-{packed}"] = {"keys": keys, "docs": docs, "fds": fds}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale") / "d"
    keys = loader_util.make_text_dataset(root, [PER_SHARD] * SHARDS)
    loader_util.index_dir(root)
    return root, keys


def test_more_shards_than_descriptors_stream_every_sample_once(many_shards):
    """300 shards under ``ulimit -n 240``: with 0 and 2 workers, packed and unpacked, a shuffled epoch
    serves every sample exactly once, and the main process never holds over a quarter of the limit."""
    root, keys = many_shards
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(NOFILE)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_env(),
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    lengths = {}
    for workers in (0, 2):
        plain, packed = out[f"{workers}-False"], out[f"{workers}-True"]
        assert sorted(plain["keys"]) == sorted(keys) and len(plain["keys"]) == len(keys)
        assert len(packed["docs"]) == len(keys)  # every document, its pieces summing to the same lengths
        lengths.setdefault("docs", packed["docs"])
        assert packed["docs"] == lengths["docs"]
        assert plain["fds"] <= NOFILE // 4 and packed["fds"] <= NOFILE // 4, (plain["fds"], packed["fds"])


def test_budget_and_a_shard_replaced_between_two_opens(many_shards, tmp_path):
    """With a budget of 4 open shards a process holds at most 4 maps; a shard evicted, then replaced in
    place (a new file renamed over it), is an error naming it when the loader opens it again."""
    root, keys = many_shards
    src = tmp_path / "d"
    src.mkdir()
    for name in [
        "doc-000000.tar",
        "doc-000001.tar",
        "doc-000002.tar",
        "doc-000003.tar",
        "doc-000004.tar",
        "doc-000005.tar",
    ]:
        os.link(root / name, src / name)
    loader_util.index_dir(src)
    cfg = {
        "datasets": [{"path": str(src)}],
        "batch_size": 1,
        "epochs": 1,
        "num_workers": 0,
        "shuffle": False,
        "max_open_shards": 4,
    }
    loader = build_loader(cfg)
    source = loader.stream.sources[0]
    assert [b["__key__"] for b in loader] == [[k] for k in keys[: 6 * PER_SHARD]]
    assert source.open_shards.peak == 4 and len(source.open_shards) == 4

    loader = build_loader(cfg)
    it = iter(loader)
    for _ in range(PER_SHARD):
        next(it)  # shard 0 mapped, its version recorded
    replacement = src / ".new.tar"
    replacement.write_bytes((src / "doc-000000.tar").read_bytes())  # same bytes, another file
    for _ in range(4 * PER_SHARD):
        next(it)  # shards 1-4: shard 0 evicted
    os.replace(replacement, src / "doc-000000.tar")
    loader.stream.sources[0]._entry(1)  # still open: fine
    with pytest.raises(SampleDecodeError, match=r"doc-000000\.tar'?: shard changed since the loader first read it"):
        loader.stream.sources[0].array(0)
    with pytest.raises(ValueError, match="max_open_shards must be >= 1"):
        build_loader({**cfg, "max_open_shards": 0})

    # two datasets (as a blend or a metadataset's leaves would be): one budget across both
    other = tmp_path / "e"
    other.mkdir()
    for name in ["doc-000010.tar", "doc-000011.tar", "doc-000012.tar"]:
        os.link(root / name, other / name)
    loader_util.index_dir(other)
    loader = build_loader(
        {
            **cfg,
            "datasets": [{"path": str(other)}, {"path": str(other), "split": "train"}],
            "shuffle": True,
            "max_open_shards": 3,
        }
    )
    assert len(list(loader)) == 6 * PER_SHARD
    a, b = loader.stream.sources
    assert a.open_shards is b.open_shards and a.open_shards.peak == 3


def test_state_size_does_not_grow_with_the_dataset(many_shards, tmp_path):
    """The loader's state after a few batches is the same size over 20 shards as over 300 holding the
    same first samples (plain and packed): positions, seeds and the packing buffer's open rows, nothing
    per sample or per shard (numbers count as one character: they have more digits in a larger dataset)."""
    root, _ = many_shards
    small = tmp_path / "small"
    small.mkdir()
    for shard in range(20):
        os.link(root / f"doc-{shard:06d}.tar", small / f"doc-{shard:06d}.tar")
    loader_util.index_dir(small)
    for extra in ({}, {"packing": "greedy", "seq_len": 64, "packing_buffer": 4}):
        sizes = []
        for path in (small, root):
            loader = build_loader(
                {"datasets": [{"path": str(path)}], "batch_size": 2, "num_workers": 0, "shuffle": False, **extra}
            )
            it = iter(loader)
            next(it), next(it)
            state = {**loader.state_dict(), "fingerprint": ""}  # a digest: its digits vary, not its size
            sizes.append(len(re.sub(r"\d+", "0", json.dumps(state))))
        assert sizes[0] == sizes[1], (extra, sizes)


def test_get_reads_one_sample_by_key(many_shards, tmp_path, capsys):
    """``dataio get`` and ``open_dataset`` find a key by binary search over the mapped index: the member
    bytes as written; a missing key or member is a one-line error (exit 2); an old index without the key
    table is searched linearly; a tar that no longer matches its index is an error, not other bytes."""
    from headrace.dataio.cli import main
    from headrace.dataio.shards.index import INDEX_DIR, load_index
    from headrace.dataio.shards.lookup import SampleNotFound, open_dataset

    root, keys = many_shards
    index = load_index(root)
    assert isinstance(index.keys, np.memmap) and isinstance(index.key_order, np.memmap)  # mapped, not in the heap
    dataset = open_dataset(root)
    for n in (0, 1, 457, len(keys) - 1):
        sample = dataset[keys[n]]
        assert sample["json"] == f'{{"n": {n}}}'.encode()
        assert np.load(io.BytesIO(sample["tokens.npy"]))[0] == n
    assert "doc9999999" not in dataset and keys[5] in dataset
    with pytest.raises(SampleNotFound, match="no sample with key 'doc9999999'"):
        dataset["doc9999999"]

    out = tmp_path / "m.json"
    assert main(["get", str(root), keys[457], "--member", "json", "--out", str(out)]) == 0
    assert out.read_bytes() == b'{"n": 457}'
    assert main(["get", str(root), keys[457]]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["shard"] == "doc-000152.tar" and set(info["members"]) == {"json", "tokens.npy"}
    assert main(["get", str(root), "nokey"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"dataio get: error: {root}: no sample with key 'nokey' ({len(keys)} samples)"
    )
    assert main(["get", str(root), keys[0], "--member", "flac"]) == 2
    assert "has no member 'flac' (it has: json, tokens.npy)" in capsys.readouterr().err

    old = tmp_path / "old"  # an index written before key_order.npy
    old.mkdir()
    for name in ("doc-000000.tar", "doc-000001.tar"):
        os.link(root / name, old / name)
    loader_util.index_dir(old)
    (old / INDEX_DIR / "key_order.npy").unlink()
    assert open_dataset(old)[keys[4]]["json"] == b'{"n": 4}'
    (old / "doc-000001.tar").unlink()
    (old / "doc-000001.tar").write_bytes((root / "doc-000002.tar").read_bytes())  # other samples, same offsets
    assert main(["get", str(old), keys[4]]) == 2
    assert "does not hold sample 'doc0000004'" in capsys.readouterr().err


# One batch over more shards than the budget: each process's RLIMIT_NOFILE leaves room for the budget
# (8 maps at ``max_open_shards: 8``) and the interpreter, not for a map per shard of a batch, so holding
# every shard a batch touches fails with EMFILE; the most shard maps seen in any process at a batch is printed.
SPAN_CHILD = textwrap.dedent("""
    import collections, json, os, resource, sys
    tokens, audio, nofile = sys.argv[1], sys.argv[2], int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    from headrace.dataio.loader import build_loader

    def shard_maps(pid):
        with open(f"/proc/{pid}/maps") as f:
            return len({line.split()[-1] for line in f if line.rstrip().endswith(".tar")})

    def children():
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(p) for p in f.read().split()]

    out = {}
    for workers in (0, 2):
        for mode in ("plain", "packed", "audio"):
            cfg = {"datasets": [{"path": tokens}], "batch_size": 32, "epochs": 1, "num_workers": workers,
                   "shuffle": True, "seed": 3, "max_open_shards": 8}
            if mode == "packed":
                cfg.update(packing="best_fit", seq_len=64, batch_size=4)
            if mode == "audio":
                del cfg["batch_size"]
                cfg.update(datasets=[{"path": audio}],
                           bucketing={"max_duration": 8.0, "num_buckets": 2}, decode={"sample_rate": 8000})
            served, maps, spans = collections.Counter(), 0, 0
            for batch in build_loader(cfg):
                maps = max([maps] + [shard_maps(p) for p in [os.getpid(), *children()]])
                if mode == "packed":
                    for row in batch["__docs__"]:
                        for ref, _, length in row:
                            served[str(ref)] += length
                else:
                    served.update(batch["__key__"])
                    spans = max(spans, len(batch["__key__"]))
            out[f"{workers}-{mode}"] = {"served": served, "maps": maps, "spans": spans}
    print(json.dumps(out))
""")


def _token_shards(root, shards: int, per_shard: int) -> list[str]:
    """Token-only shards (one ``tokens.npy`` member a sample: the batch-level gather's path)."""
    import webdataset as wds

    root.mkdir(parents=True)
    keys = []
    for shard in range(shards):
        with wds.TarWriter(str(root / f"t-{shard:06d}.tar")) as w:
            for _ in range(per_shard):
                n = len(keys)
                keys.append(f"t{n:07d}")
                w.write(
                    {"__key__": keys[-1], "tokens.npy": loader_util.npy_bytes(np.arange(n % 7 + 1, dtype=np.int32))}
                )
    loader_util.index_dir(root)
    return keys


def _audio_shards(root, shards: int) -> list[str]:
    import soundfile
    import webdataset as wds

    root.mkdir(parents=True)
    keys = []
    for shard in range(shards):
        with wds.TarWriter(str(root / f"a-{shard:06d}.tar")) as w:
            buf = io.BytesIO()
            soundfile.write(buf, np.zeros(800 + 8 * shard, dtype=np.float32), 8000, format="FLAC")
            keys.append(f"a{shard:07d}")
            w.write({"__key__": keys[-1], "flac": buf.getvalue(), "tokens.npy": loader_util.npy_bytes(np.arange(3))})
    loader_util.index_dir(root)
    return keys


def test_one_batch_spans_four_times_the_open_shard_budget(tmp_path):
    """Batches of 32 samples from 32 shards (4x ``max_open_shards: 8``), plain token batches (the gather),
    packed (best_fit) and bucketed audio, 0 and 2 workers, under a descriptor limit that leaves no room
    for a map per shard of a batch: every sample once, and no process ever holds more than the budget's
    maps plus the one shard being copied."""
    tokens, audio = tmp_path / "tokens", tmp_path / "audio"
    keys, audio_keys = _token_shards(tokens, 160, 2), _audio_shards(audio, 160)
    run = subprocess.run(
        [sys.executable, "-c", SPAN_CHILD, str(tokens), str(audio), "64"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_env(),
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for workers in (0, 2):
        plain, packed, bucketed = (out[f"{workers}-{m}"] for m in ("plain", "packed", "audio"))
        assert sorted(plain["served"]) == keys and set(plain["served"].values()) == {1}
        assert plain["spans"] == 32
        assert len(packed["served"]) == len(keys)  # every document, whole or in pieces
        assert sorted(bucketed["served"]) == audio_keys and set(bucketed["served"].values()) == {1}
        assert bucketed["spans"] >= 32, bucketed["spans"]  # 4x the budget or more
        for mode in (plain, packed, bucketed):
            assert mode["maps"] <= 9, (workers, out)
