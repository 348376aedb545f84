"""Shard names in a dataset's ``.nv-meta/headrace/manifest.json`` stay inside the dataset (issue 34 item 3): a
name that climbs out (``../``), is absolute, or an entry with unknown fields is one line naming the manifest and
the entry, through ``dataio verify`` / ``dataio inspect`` and the trainer's loader, and the file it names is never
opened."""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO
from tests.loader_util import make_text_dataset

from headrace.dataio.cli import main as dataio
from headrace.dataio.shards.index import INDEX_DIR

BAD = {"../../../../etc/passwd": "not a relative path inside the dataset directory",
       "/etc/passwd": "not a relative path inside the dataset directory",
       "a/./b.tar": "not a relative path inside the dataset directory",
       None: "unexpected keyword argument 'evil'"}


def _plant(root, name):
    manifest = root / INDEX_DIR / "manifest.json"
    data = json.loads(manifest.read_text())
    if name is None:
        data["shards"][0]["evil"] = 1
    else:
        data["shards"][0]["name"] = name
    manifest.write_text(json.dumps(data))
    return manifest


@pytest.mark.parametrize("name", list(BAD))
def test_dataio_refuses_a_shard_name_leaving_the_dataset(tmp_path, capsys, name):
    make_text_dataset(tmp_path / "d", [5, 6])
    manifest = _plant(tmp_path / "d", name)
    for verb in ("verify", "inspect"):
        assert dataio([verb, str(tmp_path / "d")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{manifest}: shards[0]: " in err and BAD[name] in err, err


def test_trainer_refuses_a_shard_name_leaving_the_dataset(tmp_path, capsys, monkeypatch):
    from headrace.training.__main__ import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HEADRACE_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    make_text_dataset(tmp_path / "d", [20])
    manifest = _plant(tmp_path / "d", "../../../../etc/passwd")
    code = main(["--config", str(REPO / "configs" / "debug_llama.yaml"), "logging.console=false",
                 "checkpoint.export_hf=false", "trainer.max_steps=1", "data.seq_len=64", "data.packing_buffer=8",
                 f"trainer.output_dir={tmp_path / 'out'}", f"data.datasets=[{{path: {tmp_path / 'd'}}}]"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{manifest}: shards[0]: " in err, err
