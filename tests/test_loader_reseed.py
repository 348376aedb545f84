"""Per-job data seeds (``Loader.reseed``): a chained job's new seed reorders only the epochs no rank had begun;
the epochs in progress continue exactly, and every epoch of every blended dataset serves each sample once."""

import itertools
import json
from collections import defaultdict

import numpy as np
import pytest

from headrace.dataio import build_loader

from tests.loader_util import make_text_dataset

SIZES = {"a": [7, 5, 3, 1, 6], "b": [4, 5]}  # 22 and 9 samples, blended 2:1 over 3 epochs of "a"
DP = 2


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    root = tmp_path_factory.mktemp("reseed")
    keys = {name: make_text_dataset(root / name, shards, prefix=name) for name, shards in SIZES.items()}
    config = {
        "datasets": [{"path": str(root / "a"), "weight": 2.0}, {"path": str(root / "b"), "weight": 1.0}],
        "batch_size": 3,
        "epochs": 3,
        "num_workers": 0,
        "shuffle_window": 4,
        "seed": 7,
    }
    return config, keys


def run(config, states=None, seed=None, limit=None):
    """Each DP rank's valid keys (in its order) and state after ``limit`` batches, resumed from ``states``."""
    keys, out_states, firsts = [], [], []
    for r in range(DP):
        loader = build_loader(config, dp_rank=r, dp_size=DP)
        if states is not None:
            loader.load_state_dict(states)
        if seed is not None:
            firsts.append(loader.reseed(seed))
        mine = []
        for batch in itertools.islice(loader, limit):
            mine += [k for k, v in zip(batch["__key__"], batch["__valid__"].tolist()) if v]
        keys.append(mine)
        out_states.append(json.loads(json.dumps(loader.state_dict())))
    return keys, out_states, firsts


def global_stream(per_rank):
    """Keys by global position (rank r serves positions r + DP*j, the layout of headrace.dataio.stream.ordering.split)."""
    out = [None] * sum(map(len, per_rank))
    for r, keys in enumerate(per_rank):
        out[r::DP] = keys
    return out


def test_reseed_keeps_the_current_epoch_and_reorders_later_ones(blend):
    config, keys = blend
    straight = global_stream(run(config)[0])
    head, states, _ = run(config, limit=5)  # 30 positions: 20 draws of "a" (epoch 0 of 22), 10 of "b" (epoch 1 of 9)
    tail, resumed, firsts = run(config, states=states, seed=99)
    assert firsts[0] == firsts[1] == [1, 2], "the epochs in progress keep their seed; the next ones take the new"
    stream = global_stream([h + t for h, t in zip(head, tail)])
    assert len(stream) == len(straight)

    loader = build_loader(config)
    dataset, draw = loader.stream.blend.locate(np.arange(len(stream)))
    names = list(SIZES)
    epochs = defaultdict(list)
    for key, d, k in zip(stream, dataset, draw):
        assert key.startswith(names[d])  # the blend (closed form, no seed) is unchanged
        epochs[names[d], int(k) // len(keys[names[d]])].append(key)
    for (name, epoch), served in epochs.items():
        assert len(set(served)) == len(served), f"{name} epoch {epoch} repeats a sample"
        if len(served) == len(keys[name]):
            assert sorted(served) == sorted(keys[name]), f"{name} epoch {epoch} skips a sample"
    for d, name in enumerate(names):  # epochs before the switch: exactly the uninterrupted order
        same = [
            s == t
            for s, t, dd, k in zip(stream, straight, dataset, draw)
            if dd == d and k // len(keys[name]) < firsts[0][d]
        ]
        later = [
            s == t
            for s, t, dd, k in zip(stream, straight, dataset, draw)
            if dd == d and k // len(keys[name]) >= firsts[0][d]
        ]
        assert all(same) and len(same) >= len(keys[name])
        assert not all(later), f"{name}: the new seed must reorder the epochs it owns"
    assert resumed[0]["reseeds"] == [[99, [1, 2]]]

    again, _, _ = run(config, states=resumed)  # a state with a reseed resumes exactly (nothing left here)
    assert again == [[], []]
