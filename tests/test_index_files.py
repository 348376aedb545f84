"""The index files and the paths ``dataio get`` writes (issue 46 items 2, 7, 12), through ``dataio``'s ``main``: every
index file damaged in type, shape, range or agreement with the others is one line naming the file from
``dataio verify`` (and from ``dataio get`` where the damage is in what it reads), exit 2; ``get --out`` never
writes onto the dataset it reads, and a full device is one line."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tests.loader_util import make_text_dataset

from headrace.dataio.cli import main
from headrace.dataio.shards.index import INDEX_DIR
from headrace.dataio.shards.lookup import open_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("index") / "d"
    make_text_dataset(root, [30, 20])
    return root


def _edit(name: str, fn):
    def apply(index_dir):
        path = index_dir / name
        if name.endswith(".npy"):
            np.save(path, fn(np.load(path)))
        else:
            path.write_text(fn(path.read_text()))

    return apply


def _field(name: str, field: str, value):
    def set_value(array):
        array[field][-1] = value
        return array

    return _edit(name, set_value)


def _overwrite(name: str, at: int, data: bytes):
    """``data`` written over ``name``'s bytes at ``at`` (found by the fuzz target ``indexfiles``: a header numpy
    cannot tokenize raised ``TokenError`` through ``dataio verify``)."""

    def apply(index_dir):
        raw = bytearray((index_dir / name).read_bytes())
        raw[at : at + len(data)] = data
        (index_dir / name).write_bytes(bytes(raw))

    return apply


def _reversed(array):
    return array[::-1].copy()


# name -> (edit of the index folder, file named, words of the rule, whether `dataio get` also refuses it)
DAMAGE = {
    "key_order_unsorted": (_edit("key_order.npy", _reversed), "key_order.npy", "does not sort keys.npy", False),
    "key_order_short": (_edit("key_order.npy", lambda a: a[:3]), "key_order.npy", "not 50 sample indices", True),
    "key_order_range": (_edit("key_order.npy", lambda a: a + 1000), "key_order.npy", "outside 0..49", True),
    "key_order_float": (_edit("key_order.npy", lambda a: a.astype(np.float32)), "key_order.npy", "float32", True),
    "key_order_repeats": (_edit("key_order.npy", lambda a: np.zeros_like(a)), "key_order.npy", "permutation", False),
    "table_count": (_field("shards.npy", "samples", 7), "shards.npy", "listed with 7 samples", False),
    "table_short": (_edit("shards.npy", lambda a: a[:1]), "shards.npy", "not 2 rows", True),
    "sample_shard": (_field("samples.npy", "shard", 9), "samples.npy", "names a shard past", False),
    "sample_members": (_field("samples.npy", "member_start", 10**6), "samples.npy", "member rows past", False),
    "samples_type": (_edit("samples.npy", lambda a: np.zeros(5)), "samples.npy", "float64", True),
    "member_ext": (_field("members.npy", "ext", 500), "members.npy", "extension past", False),
    "keys_short": (_edit("keys.npy", lambda a: a[:2]), "keys.npy", "not 50 byte strings", True),
    "names_type": (_edit("shard_names.npy", lambda a: np.arange(2)), "shard_names.npy", "not names", True),
    "npy_garbage": (lambda d: (d / "members.npy").write_bytes(b"\x93NUMPY junk"), "members.npy", "index array", True),
    "npy_header_untokenizable": (_overwrite("members.npy", 15, b"\0" * 8), "members.npy", "index array", True),
    "npy_header_cut": (_overwrite("samples.npy", 154, b"\0"), "samples.npy", "index array", True),
    "manifest_deep": (_edit("manifest.json", lambda t: "[" * 100_000 + "]" * 100_000), "manifest.json", "JSON", True),
    "manifest_list": (_edit("manifest.json", lambda t: "[]"), "manifest.json", "JSON list", True),
    "manifest_extensions": (
        _edit("manifest.json", lambda t: json.dumps({**json.loads(t), "extensions": [1]})),
        "manifest.json",
        "'extensions' is not a list of names",
        True,
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_index_files_are_one_line_naming_the_file(dataset, tmp_path, capsys, case):
    edit, name, rule, get_refuses = DAMAGE[case]
    root = tmp_path / "d"
    shutil.copytree(dataset, root)
    key = open_dataset(root).index.key(3)
    edit(root / INDEX_DIR)
    capsys.readouterr()
    assert main(["verify", str(root), "--quiet", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{root / INDEX_DIR / name}: " in err and rule in err, err
    code = main(["get", str(root), key])
    err = capsys.readouterr().err
    if get_refuses:
        assert code == 2 and err.count("\n") == 1 and name in err, err
    else:  # what get reads holds (or it names a present key missing: verify is what says so)
        assert code in (0, 2) and "Traceback" not in err and err.count("\n") <= 1, err


def test_get_out_never_writes_onto_the_dataset_and_a_full_device_is_one_line(dataset, tmp_path, capsys):
    root = tmp_path / "d"
    shutil.copytree(dataset, root)
    index = open_dataset(root).index
    key, shard = index.key(3), root / index.shards[0].name
    (tmp_path / "elsewhere").mkdir()
    os.link(shard, tmp_path / "elsewhere" / "hard.tar")
    (tmp_path / "elsewhere" / "soft.tar").symlink_to(shard)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    for out in (
        shard,
        root / INDEX_DIR / "keys.npy",
        root / "new.npy",
        tmp_path / "elsewhere" / "hard.tar",
        tmp_path / "elsewhere" / "soft.tar",
    ):
        assert main(["get", str(root), key, "--member", "tokens.npy", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {out}: is" in err and "input" in err, err
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert main(["get", str(root), key, "--member", "tokens.npy", "--out", "/dev/full"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "dataio get: error: --out /dev/full: cannot write: No space left on device", err
    assert main(["get", str(root), key, "--member", "tokens.npy", "--out", str(tmp_path / "t.npy")]) == 0
    assert (tmp_path / "t.npy").read_bytes() == open_dataset(root)[key]["tokens.npy"]


def test_shard_output_may_not_be_an_input(tmp_path, capsys):
    """The same rule for ``dataio shard --output``: the input manifest given as the output folder is refused in one
    line before anything is written."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"word {i}"}) + "\n" for i in range(5)))
    before = docs.read_bytes()
    assert main(["shard", str(docs), "--output", str(docs), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--output {docs}: is the input {docs}" in err, err
    assert docs.read_bytes() == before
