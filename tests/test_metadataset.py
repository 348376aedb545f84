"""Energon metadatasets (MetadatasetV2 YAML) as `data:` sources, against megatron-energon reading the same
files: the same sample multiset over a `blend_epochized` epoch, the same mixing proportions for `blend`
(energon draws at random, so within a tolerance), the same `split_part` selection and `__subflavors__`;
exactly once across an elastic resume (dp 2 -> dp 3); one-line errors naming file and key; a
metadataset and an energon directory behind an fsspec URL."""

import collections
import itertools
from pathlib import Path

import fsspec
import pytest
import yaml

from headrace.config import ConfigError
from headrace.dataio import build_loader

from tests.loader_util import energon_prepared
from tests.test_loader import keys_of, resume_everywhere

# energon's get_loader asks for pinned memory, which CPU-only torch warns about
pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")

HEAD = {"__module__": "megatron.energon", "__class__": "MetadatasetV2"}
BLEND_SAMPLES = 800  # energon: ~5 ms a sample here; a share's sd <= 0.018, so 0.06 is > 3 sd


def write_mds(path: Path, train: dict, **splits) -> Path:
    path.write_text(yaml.safe_dump({**HEAD, "splits": {"train": train, **splits}}))
    return path


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    """Three prepared datasets -- a: energon's sqlite only, train/val split parts; b: also headrace-indexed,
    subflavors in its dataset.yaml; c: energon's sqlite only -- and metadatasets over them."""
    base = tmp_path_factory.mktemp("mds")
    keys = {
        "a": energon_prepared(
            base / "a",
            [4, 3, 5],
            prefix="a",
            split_parts_patterns=[("train", r"a-00000[01]\.tar"), ("val", r"a-000002\.tar")],
        ),
        "b": energon_prepared(
            base / "b",
            [6, 5],
            prefix="b",
            keep_index=True,
            split_parts_ratio=[("train", 1.0)],
            subflavors={"origin": "b-yaml", "kind": "text"},
        ),
        "c": energon_prepared(base / "c", [4, 4], prefix="c", split_parts_ratio=[("train", 1.0)]),
    }
    write_mds(
        base / "inner_epochized.yaml",
        {"blend_epochized": [{"repetitions": 1.5, "path": "c", "subflavors": {"origin": "c-inner", "lang": "x"}}]},
    )
    write_mds(
        base / "epochized.yaml",
        {
            "blend_epochized": [
                {"repetitions": 2, "path": "a", "subflavors": {"origin": "a"}},
                {"repetitions": 1, "path": str(base / "b")},  # an absolute path
                {"repetitions": 1, "path": "inner_epochized.yaml", "subflavors": {"origin": "c-outer"}},
            ]
        },
    )
    write_mds(base / "inner_blend.yaml", {"blend": [{"weight": 1, "path": "c"}, {"weight": 1, "path": "a"}]})
    write_mds(
        base / "blend.yaml",
        {
            "blend": [
                {"weight": 3, "path": "a", "split_part": "val", "subflavors": {"origin": "a-val"}},
                {"weight": 1, "path": "b"},
                {"weight": 2, "path": "inner_blend.yaml", "subflavors": {"origin": "inner"}},
            ]
        },
    )
    return base, keys


def energon_samples(path: Path, n: int | None = None, *, repeat: bool) -> list[tuple[str, dict]]:
    """``(key, __subflavors__)`` of the samples megatron-energon's train loader yields for the metadataset."""
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        Sample,
        WorkerConfig,
        get_loader,
        get_train_dataset,
        stateless,
    )
    from megatron.energon.edataclass import edataclass

    @edataclass
    class Doc(Sample):
        json: bytes

    @stateless
    def cook(crude: dict) -> Doc:
        return Doc(
            __key__=crude["__key__"],
            __restore_key__=crude["__restore_key__"],
            __subflavors__=crude.get("__subflavors__"),
            __sources__=crude.get("__sources__"),
            json=crude["json"],
        )

    class Encoder(DefaultTaskEncoder):
        decoder = None
        cookers = [Cooker(cook)]

        def batch(self, batch):
            return batch

    ds = get_train_dataset(
        path,
        split_part="train",
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=1,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=repeat,
        task_encoder=Encoder(),
    )
    samples = (s for batch in get_loader(ds) for s in batch)
    return [(s.__key__, dict(s.__subflavors__ or {})) for s in itertools.islice(samples, n)]


def our_samples(config: dict, n: int | None = None) -> list[tuple[str, dict]]:
    out = []
    for batch in build_loader({"batch_size": 5, "num_workers": 0, **config}):
        out += [(k, f) for k, f, v in zip(batch["__key__"], batch["__subflavors__"], batch["__valid__"].tolist()) if v]
        if n is not None and len(out) >= n:
            return out[:n]
    return out


def flavors_by_dataset(samples) -> dict:
    """``{dataset letter: the one subflavors dict its samples carry}`` (an error if a dataset had two)."""
    seen = {}
    for key, flavors in samples:
        assert seen.setdefault(key[0], flavors) == flavors, key
    return seen


def test_blend_epochized_epoch_is_energons_multiset(mds):
    base, keys = mds
    theirs = energon_samples(base / "epochized.yaml", repeat=False)
    ours = our_samples({"datasets": [{"path": str(base / "epochized.yaml")}], "epochs": 1})
    count_theirs, count_ours = (collections.Counter(k for k, _ in s) for s in (theirs, ours))
    # a x2 (its train part only), b x1: exactly energon's multiset; c x1.5: floor(1.5 * 8) = 12 samples,
    # each once or twice (which half repeats is each loader's own shuffle)
    exact = {k: n for k, n in count_theirs.items() if k[0] != "c"}
    assert {k: n for k, n in count_ours.items() if k[0] != "c"} == exact
    assert exact == {**{k: 2 for k in keys["a"][:7]}, **{k: 1 for k in keys["b"]}}
    for counts in (count_theirs, count_ours):
        assert sum(n for k, n in counts.items() if k[0] == "c") == 12
        assert {k for k in counts if k[0] == "c"} == set(keys["c"]) and set(counts.values()) <= {1, 2}
    assert (
        flavors_by_dataset(ours)
        == flavors_by_dataset(theirs)
        == {"a": {"origin": "a"}, "b": {"origin": "b-yaml", "kind": "text"}, "c": {"origin": "c-outer", "lang": "x"}}
    )
    # Two epochs: c's second epoch goes on with the other half of its pass, so each c sample comes 3 times.
    two = collections.Counter(
        k for k, _ in our_samples({"datasets": [{"path": str(base / "epochized.yaml")}], "epochs": 2})
    )
    assert {k: two[k] for k in keys["c"]} == {k: 3 for k in keys["c"]}
    assert all(two[k] == 4 for k in keys["a"][:7]) and sum(two.values()) == 74


def test_blend_mixes_like_energon(mds):
    base, keys = mds
    group = {
        **{k: "a-val" for k in keys["a"][7:]},
        **{k: "a-train" for k in keys["a"][:7]},
        **{k: "b" for k in keys["b"]},
        **{k: "c" for k in keys["c"]},
    }
    # weights 3 : 1 : 2 x (1 : 1) normalised at each level, multiplied down the nesting
    want = {"a-val": 3 / 6, "b": 1 / 6, "c": 1 / 6, "a-train": 1 / 6}
    theirs = energon_samples(base / "blend.yaml", BLEND_SAMPLES, repeat=True)
    ours = our_samples({"datasets": [{"path": str(base / "blend.yaml")}], "batch_size": 100}, BLEND_SAMPLES)
    for samples, tolerance in ((theirs, 0.06), (ours, 0.005)):  # energon draws at random, ours by a fixed pattern
        assert all(k in group for k, _ in samples)  # only the named datasets and split parts
        share = collections.Counter(group[k] for k, _ in samples)
        assert {g: abs(share[g] / len(samples) - w) < tolerance for g, w in want.items()} == dict.fromkeys(want, True)
    flavors = {group[k]: f for k, f in ours}
    assert (
        flavors
        == {group[k]: f for k, f in theirs}
        == {
            "a-val": {"origin": "a-val"},
            "b": {"origin": "b-yaml", "kind": "text"},
            "c": {"origin": "inner"},
            "a-train": {"origin": "inner"},
        }
    )


def test_metadataset_blends_with_a_plain_entry_by_weight(mds):
    base, _ = mds
    config = {"datasets": [{"path": str(base / "blend.yaml"), "weight": 1}, {"path": str(base / "c"), "weight": 1}]}
    samples = our_samples(config, 600)
    c_share = sum(k[0] == "c" for k, _ in samples) / len(samples)
    assert abs(c_share - (1 / 2 + 1 / 12)) < 0.01  # the plain c, plus c's 1/6 inside blend.yaml's half
    assert {f.get("origin") for k, f in samples if k[0] == "c"} == {None, "inner"}  # a plain entry: {}


def test_elastic_resume_dp2_to_dp3_exactly_once(mds):
    base, _ = mds
    config = {
        "datasets": [{"path": str(base / "epochized.yaml")}],
        "epochs": 2,
        "batch_size": 3,
        "num_workers": 0,
        "shuffle_window": 4,
        "seed": 5,
    }
    reference = collections.Counter(k for b in keys_of(build_loader(config)) for k in b)
    served, states = [], []
    for r in range(2):
        loader = build_loader(config, dp_rank=r, dp_size=2)
        served += [k for b in keys_of(loader, limit=4) for k in b]
        states.append(loader.state_dict())
    rest = resume_everywhere({**config, "num_workers": 2}, states, 3)
    assert len({len(b) for b in rest}) == 1  # every new rank the same number of batches
    served += [k for rank in rest for b in rank for k in b]
    assert collections.Counter(served) == reference and sum(reference.values()) == 74


def test_metadataset_errors_are_one_line_naming_file_and_key(mds, tmp_path):
    base, _ = mds

    def error(train=None, *, path=None, split="train"):
        path = path or write_mds(tmp_path / "bad.yaml", train)
        with pytest.raises(ConfigError) as info:
            build_loader({"datasets": [{"path": str(path), "split": split}], "num_workers": 0})
        assert "\n" not in str(info.value)
        return str(info.value)

    bad = str(tmp_path / "bad.yaml")
    (tmp_path / "v1.yaml").write_text(
        yaml.safe_dump({"__module__": "megatron.energon", "__class__": "Metadataset", "splits": {}})
    )
    assert error(path=tmp_path / "v1.yaml").startswith(f"{tmp_path / 'v1.yaml'}: __class__: 'Metadataset'")
    assert error({"blend": [{"weight": 1}]}) == (
        f"{bad}: splits.train.blend[0].path: missing: every dataset entry "
        "needs the path of a prepared dataset or metadataset"
    )
    assert error({"blend": [{"path": "nope"}]}) == (
        f"{bad}: splits.train.blend[0].path: {tmp_path / 'nope'}: no such dataset"
    )
    assert error({"blend": [{"weight": 1, "path": str(base / "a")}, {"weight": -1, "path": str(base / "b")}]}) == (
        f"{bad}: splits.train.blend[1].weight: must be a finite number >= 0, got -1"
    )
    message = error({"blend": [{"path": str(base / "a"), "split_part": "bogus"}]})
    assert message.startswith(f"{bad}: splits.train.blend[0].split_part: ") and "no shards in split 'bogus'" in message
    assert error({"blend_epochized": [{"path": str(base / "blend.yaml")}]}) == (
        f"{bad}: splits.train.blend_epochized[0]: cannot mix blend with blend_epochized (energon's rule)"
    )
    assert error({"blend": [{"path": str(base / "a"), "subset": {"range": [0, 5]}}]}) == (
        f"{bad}: splits.train.blend[0].subset: subset ranges are not supported"
    )
    assert error({"blend": [{"path": str(base / "a"), "weigth": 2}]}).startswith(
        f"{bad}: splits.train.blend[0].weigth: unknown key"
    )
    assert error({"path": str(base / "a")}, split="val") == f"{bad}: splits: no split 'val' (has train)"
    with pytest.raises(
        ConfigError,
        match=r"data.datasets\[0\]: .*epochized.yaml is a blend_epochized metadataset: "
        r"it must be the only dataset",
    ):
        build_loader({"datasets": [{"path": str(base / "epochized.yaml")}, {"path": str(base / "c")}]})


def test_metadataset_and_energon_dirs_behind_a_url(mds):
    """A metadataset and the energon-only directory it names, in fsspec's memory store: the same epoch."""
    base, keys = mds
    fs = fsspec.filesystem("memory")
    for path in (base / "c").rglob("*"):
        if path.is_file():
            fs.pipe(f"/mdsurl/c/{path.relative_to(base / 'c').as_posix()}", path.read_bytes())
    text = yaml.safe_dump({**HEAD, "splits": {"train": {"blend_epochized": [{"repetitions": 2, "path": "c"}]}}})
    fs.pipe("/mdsurl/meta.yaml", text.encode())
    (base / "local_c.yaml").write_text(text)
    try:
        remote = our_samples({"datasets": [{"path": "memory://mdsurl/meta.yaml"}], "epochs": 1})
        assert remote == our_samples({"datasets": [{"path": str(base / "local_c.yaml")}], "epochs": 1})
        assert collections.Counter(k for k, _ in remote) == {k: 2 for k in keys["c"]}
        plain = [
            k
            for b in build_loader({"datasets": [{"path": "memory://mdsurl/c"}], "epochs": 1, "num_workers": 0})
            for k in b["__key__"]
        ]
        assert sorted(plain) == sorted(keys["c"])
    finally:
        fs.rm("/mdsurl", recursive=True)
