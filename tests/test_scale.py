"""Datasets with more shards than a process may open files: the loader's descriptors and maps stay
within a budget (``headrace.dataio.stream.openshards``), a shard reopened after eviction is still checked
for being the version first read, and the loader's state does not grow with the data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import loader_util
from helpers import REPO, child_env
from headrace.dataio.loader import build_loader
from headrace.dataio.stream.decode import SampleDecodeError

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
    run = subprocess.run([sys.executable, "-c", CHILD, str(root), str(NOFILE)], capture_output=True, text=True,
                         cwd=REPO, env=child_env(), timeout=600)
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
    for name in ["doc-000000.tar", "doc-000001.tar", "doc-000002.tar", "doc-000003.tar", "doc-000004.tar",
                 "doc-000005.tar"]:
        os.link(root / name, src / name)
    loader_util.index_dir(src)
    cfg = {"datasets": [{"path": str(src)}], "batch_size": 1, "epochs": 1, "num_workers": 0, "shuffle": False,
           "max_open_shards": 4}
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
