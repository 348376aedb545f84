"""Loader: exact coverage over (dp_size, num_workers), TP peers, resume (also elastic), errors."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from headrace.dataio import build_loader
from headrace.dataio.usererror import SampleDecodeError
from headrace.dataio.stream.sources.storage import ShardFormatError

from tests.loader_util import index_dir, make_text_dataset, npy_bytes
from tests.helpers import child_env

REPO = Path(__file__).resolve().parents[1]
SHARDS = [7, 5, 3, 1, 6]  # 22 samples: divides by none of dp 3, 4 or batch 3


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    return root, make_text_dataset(root, SHARDS)


def cfg(root, **kw):
    base = {
        "datasets": [{"path": str(root)}],
        "batch_size": 3,
        "epochs": 1,
        "num_workers": 0,
        "shuffle_window": 4,
        "seed": 7,
    }
    base.update(kw)
    return base


def keys_of(loader, limit=None):
    """Valid keys per batch; ``limit`` batches (a batch counts as consumed once it is yielded)."""
    batches = []
    for batch in itertools.islice(loader, limit):
        batches.append([k for k, v in zip(batch["__key__"], batch["__valid__"].tolist()) if v])
    return batches


def resume_everywhere(config, states, dp_size):
    """Every new rank restores the old ranks' states and runs to the end: its batches of valid keys."""
    rest = []
    for r in range(dp_size):
        loader = build_loader(config, dp_rank=r, dp_size=dp_size)
        loader.load_state_dict(states)
        rest.append(keys_of(loader))
    return rest


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_every_sample_once_and_equal_batch_counts(text, dp_size):
    root, all_keys = text
    reference = None
    for num_workers in (0, 1, 2):
        per_rank = [
            keys_of(build_loader(cfg(root, num_workers=num_workers), dp_rank=r, dp_size=dp_size))
            for r in range(dp_size)
        ]
        assert len({len(b) for b in per_rank}) == 1, "every rank must yield the same number of batches"
        served = [k for rank in per_rank for batch in rank for k in batch]
        assert sorted(served) == sorted(all_keys)
        if reference is None:
            reference = per_rank
        assert per_rank == reference, "the worker count must not change the stream"
    samples_per_rank = -(-len(all_keys) // dp_size)  # ceil
    assert len(per_rank[0]) == -(-samples_per_rank // 3)


def test_tp_peers_identical_and_ranks_disjoint(text):
    root, _ = text
    a = keys_of(build_loader(cfg(root, epochs=3), dp_rank=1, dp_size=2))
    b = keys_of(build_loader(cfg(root, epochs=3, num_workers=2), dp_rank=1, dp_size=2))
    other = keys_of(build_loader(cfg(root, epochs=3), dp_rank=0, dp_size=2))
    assert a == b
    assert sum(map(len, a)) + sum(map(len, other)) == 3 * sum(SHARDS)


def test_epochs_reshuffle_and_cover(text):
    root, all_keys = text
    batches = keys_of(build_loader(cfg(root, epochs=2, batch_size=11)))
    flat = [k for b in batches for k in b]
    assert sorted(flat[:22]) == sorted(all_keys) and sorted(flat[22:]) == sorted(all_keys)
    assert flat[:22] != flat[22:]
    unshuffled = keys_of(build_loader(cfg(root, shuffle=False, batch_size=22)))
    assert unshuffled[0] == all_keys


def test_endless_by_default_and_batches_carry_tokens(text):
    root, _ = text
    loader = build_loader(cfg(root, epochs=None, batch_size=4))
    batch = None
    for i, batch in enumerate(loader):
        if i == 20:  # 80 samples from 22: well into the fourth epoch
            break
    lengths = batch["__lengths__"]["tokens.npy"]
    assert batch["tokens.npy"].shape == (int(lengths.sum()),)
    first_tokens = batch["tokens.npy"][np.concatenate([[0], np.cumsum(lengths.numpy())[:-1]])]
    assert [f"doc{int(t):07d}" for t in first_tokens] == batch["__key__"]
    assert [j["n"] for j in batch["json"]] == first_tokens.tolist()


RESUME_SCRIPT = """
import itertools, json, sys
from headrace.dataio import build_loader
cfg, dp_ranks, dp_size, states, n = json.loads(sys.argv[1])
out = []
for dp_rank in dp_ranks:
    loader = build_loader(cfg, dp_rank=dp_rank, dp_size=dp_size)
    loader.load_state_dict(states)
    out.append([[k for k, v in zip(b["__key__"], b["__valid__"].tolist()) if v] for b in itertools.islice(loader, n)])
print(json.dumps(out))
"""


def resume_in_new_process(config, dp_ranks, dp_size, states, n=None):
    """Per new rank, its batches' keys after restoring ``states`` in a fresh Python process."""
    env = child_env()
    args = json.dumps([config, list(dp_ranks), dp_size, states, n])
    out = subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT, args], cwd=REPO, env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out)


def test_resume_in_a_new_process_continues_exactly(text):
    root, _ = text
    config = cfg(root, epochs=3, num_workers=2, seed="randomized")
    loader = build_loader(config)
    first = keys_of(loader, limit=5)
    state = json.loads(json.dumps(loader.state_dict()))
    assert len(json.dumps(state)) < 600  # positions and counters, not sample lists
    (rest,) = resume_in_new_process(config, [0], 1, [state])
    straight = build_loader(config)
    straight.load_state_dict({**state, "consumed": 0})  # same randomized seed, from the start
    assert first + rest == keys_of(straight)


@pytest.mark.parametrize(
    "old,new,new_process", [((4, 2), (2, 3), True), ((2, 0), (3, 1), False), ((3, 1), (1, 0), False)]
)
def test_elastic_resume_changes_dp_size_and_workers(text, old, new, new_process):
    root, all_keys = text
    (old_dp, old_workers), (new_dp, new_workers) = old, new
    config = cfg(root, epochs=2, num_workers=old_workers)
    served, states = [], []
    for r in range(old_dp):
        loader = build_loader(config, dp_rank=r, dp_size=old_dp)
        served += [k for b in keys_of(loader, limit=2) for k in b]
        states.append(loader.state_dict())
    new_config = {**config, "num_workers": new_workers}
    if new_process:
        rest = resume_in_new_process(new_config, range(new_dp), new_dp, states)
    else:
        rest = resume_everywhere(new_config, states, new_dp)
    assert len({len(b) for b in rest}) == 1
    served += [k for rank in rest for b in rank for k in b]
    assert sorted(served) == sorted(all_keys * 2)


def test_elastic_resume_after_unequal_consumption(text):
    """Ranks that consumed different counts (as with packing) leave skip ranges; still exactly once."""
    root, all_keys = text
    config = cfg(root, epochs=1, batch_size=2)
    served, states = [], []
    for r, n in enumerate([3, 1, 2]):
        loader = build_loader(config, dp_rank=r, dp_size=3)
        served += [k for b in keys_of(loader, limit=n) for k in b]
        states.append(loader.state_dict())
    for dp in (2, 4):
        rest = resume_everywhere(config, states, dp)
        assert len({len(b) for b in rest}) == 1
        assert sorted(served + [k for rank in rest for b in rank for k in b]) == sorted(all_keys)


def test_state_from_other_data_is_refused(text, tmp_path):
    root, _ = text
    state = build_loader(cfg(root)).state_dict()
    with pytest.raises(ValueError, match="other data"):
        build_loader(cfg(root, shuffle_window=5)).load_state_dict(state)


def test_blended_datasets_keep_proportions_and_resume(tmp_path):
    big = make_text_dataset(tmp_path / "big", [40, 40], prefix="big")
    small = make_text_dataset(tmp_path / "small", [6], prefix="small", seed=1)
    config = {
        "datasets": [
            {"path": str(tmp_path / "big"), "weight": 0.75},
            {"path": str(tmp_path / "small"), "weight": 0.25},
        ],
        "batch_size": 4,
        "epochs": 1,
        "num_workers": 0,
        "shuffle_window": 8,
    }
    batches = keys_of(build_loader(config))
    flat = [k for b in batches for k in b]
    assert sorted(k for k in flat if k.startswith("big")) == sorted(big)  # one pass, no restart
    n_small = sum(k.startswith("small") for k in flat)
    assert abs(n_small / len(flat) - 0.25) < 0.02 and n_small > len(small)  # the small one repeats
    loader = build_loader(config)
    head = keys_of(loader, limit=7)
    resumed = build_loader(config)
    resumed.load_state_dict(loader.state_dict())
    assert head + keys_of(resumed) == batches


def test_blended_datasets_with_different_member_names_keep_every_member(tmp_path):
    """One dataset names its tokens ``tokens.npy``, the other ``npy``: both fields survive collation."""
    for name, member in (("a", "tokens.npy"), ("b", "npy")):
        (tmp_path / name).mkdir()
        with wds.ShardWriter(str(tmp_path / name / "s-%06d.tar"), maxcount=10, verbose=0) as sink:
            for i in range(4):
                sink.write({"__key__": f"{name}{i}", member: npy_bytes(np.full(i + 1, i, dtype=np.int32))})
        index_dir(tmp_path / name)
    config = {
        "datasets": [{"path": str(tmp_path / "a")}, {"path": str(tmp_path / "b")}],
        "batch_size": 8,
        "epochs": 1,
        "shuffle": False,
        "num_workers": 0,
    }
    (batch,) = list(build_loader(config))
    for member, prefix in (("tokens.npy", "a"), ("npy", "b")):
        values = batch[member]
        assert [v is None for v in values] == [not k.startswith(prefix) for k in batch["__key__"]]
        assert sorted(int(v.numel()) for v in values if v is not None) == [1, 2, 3, 4]


def test_shardwriter_tars(tmp_path):
    pattern = str(tmp_path / "sw-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=4, verbose=0) as sink:
        for i in range(10):
            sink.write(
                {
                    "__key__": f"s{i:03d}",
                    "tokens.npy": npy_bytes(np.arange(i + 1, dtype=np.int64)),
                    "txt": f"sample {i}",
                }
            )
    index_dir(tmp_path)
    batches = list(
        build_loader(
            {"datasets": [{"path": str(tmp_path)}], "batch_size": 10, "epochs": 1, "shuffle": False, "num_workers": 0}
        )
    )
    assert batches[0]["__key__"] == [f"s{i:03d}" for i in range(10)]
    assert batches[0]["txt"][3] == "sample 3"
    assert batches[0]["__lengths__"]["tokens.npy"].tolist() == list(range(1, 11))


def test_fsspec_url_source(text):
    root, all_keys = text
    batches = keys_of(build_loader(cfg(f"file://{root}", batch_size=5)))
    assert sorted(k for b in batches for k in b) == sorted(all_keys)


def test_transient_storage_errors_are_retried(monkeypatch):
    from headrace.dataio.stream.sources import storage

    monkeypatch.setattr(storage, "BACKOFF_S", 0.0)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return b"ok"

    assert storage.retry(flaky, "test") == b"ok" and len(calls) == 3
    with pytest.raises(OSError, match="after 5 attempts"):
        storage.retry(lambda: (_ for _ in ()).throw(TimeoutError("slow")), "test")


# -- bad data ------------------------------------------------------------------------------------


def write_tar(root, name, samples):
    root.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(root / name)) as w:
        for s in samples:
            w.write(s)


def good(i):
    return {"__key__": f"k{i:03d}", "tokens.npy": npy_bytes(np.arange(3, dtype=np.int32) + i)}


def test_undecodable_member_names_shard_and_key_or_is_skipped_within_budget(tmp_path):
    samples = [good(i) for i in range(6)]
    samples[2]["tokens.npy"] = b"\x93NUMPY garbage"
    write_tar(tmp_path, "bad-000000.tar", samples)
    index_dir(tmp_path)
    config = {"datasets": [{"path": str(tmp_path)}], "batch_size": 2, "epochs": 1, "shuffle": False, "num_workers": 0}
    with pytest.raises(SampleDecodeError, match=r"bad-000000.tar.*k002|k002.*bad-000000.tar"):
        list(build_loader(config))
    for workers in (0, 2):
        loader = build_loader({**config, "max_bad_samples": 1, "num_workers": workers})
        keys = [k for b in loader for k in b["__key__"]]
        assert keys == ["k000", "k001", "k003", "k004", "k005"] and loader.bad_samples == 1


def test_pickle_member_refused(tmp_path):
    write_tar(tmp_path, "p-000000.tar", [{**good(0), "pyd": b"\x80\x04K\x01."}])
    index_dir(tmp_path)
    with pytest.raises(SampleDecodeError, match="pickle"):
        list(build_loader({"datasets": [{"path": str(tmp_path)}], "epochs": 1, "num_workers": 0}))


def test_truncated_shard(tmp_path):
    write_tar(tmp_path, "t-000000.tar", [good(i) for i in range(4)])
    index_dir(tmp_path)
    tar = tmp_path / "t-000000.tar"
    tar.write_bytes(tar.read_bytes()[:1500])
    with pytest.raises(ShardFormatError, match="truncated shard"):
        list(build_loader({"datasets": [{"path": str(tmp_path)}], "epochs": 1, "num_workers": 0}))


def test_index_that_disagrees_with_its_tar(tmp_path):
    write_tar(tmp_path, "x-000000.tar", [good(i) for i in range(4)])
    index_dir(tmp_path)
    write_tar(tmp_path, "x-000000.tar", [good(i + 10) for i in range(4)])  # rewritten, index stale
    with pytest.raises(ShardFormatError, match=r"k000.*does not hold|does not hold.*index out of date"):
        list(build_loader({"datasets": [{"path": str(tmp_path)}], "epochs": 1, "num_workers": 0, "shuffle": False}))


def test_config_errors_name_the_key(text):
    root, _ = text
    from headrace.config import ConfigError

    with pytest.raises(ConfigError, match=r"data.datasets\[0\].weight"):
        build_loader({"datasets": [{"path": str(root), "weight": "heavy"}]})
    with pytest.raises(ConfigError, match="data.batch_sise: unknown key"):
        build_loader({"datasets": [{"path": str(root)}], "batch_sise": 3})


def test_remote_source_through_fsspec_with_a_transient_failure(text, monkeypatch):
    """A non-local URL (fsspec memory://) goes through the block-cached remote path; a read that
    fails once with a connection error is retried and the data is still exact."""
    import fsspec

    from headrace.dataio.stream.sources import shard_source, storage

    root, all_keys = text
    fs = fsspec.filesystem("memory")
    for path in root.rglob("*"):
        if path.is_file():
            fs.pipe(f"/hr/{path.relative_to(root)}", path.read_bytes())
    monkeypatch.setattr(storage, "BACKOFF_S", 0.0)
    real_open = shard_source.open_remote
    failures = []

    def flaky_open(url, storage_options=None):
        if not failures:
            failures.append(1)
            raise ConnectionResetError("connection reset by peer")
        return real_open(url, storage_options)

    monkeypatch.setattr(shard_source, "open_remote", flaky_open)
    batches = keys_of(build_loader(cfg("memory://hr", batch_size=5)))
    assert failures and sorted(k for b in batches for k in b) == sorted(all_keys)
    local = keys_of(build_loader(cfg(str(root), batch_size=5)))
    assert batches == local
