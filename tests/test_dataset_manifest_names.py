"""Shard names in a dataset's index (``.nv-meta/headrace/shard_names.npy``, beside its ``manifest.json``) stay
inside the dataset (issue 34 item 3): a name that climbs out (``../``), is absolute, or has an empty or ``.`` part
is one line naming the manifest and the entry, through ``dataio verify`` / ``dataio inspect`` and the trainer's
loader, and the file it names is never opened."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import REPO
from tests.loader_util import make_text_dataset

from headrace.dataio.cli import main as dataio
from headrace.dataio.shards.index import INDEX_DIR

BAD = {
    "../../../../etc/passwd": "not a relative path inside the dataset directory",
    "/etc/passwd": "not a relative path inside the dataset directory",
    "a/./b.tar": "not a relative path inside the dataset directory",
}


def _plant(root, name):
    names = np.load(root / INDEX_DIR / "shard_names.npy").astype(object)
    names[0] = name.encode()
    np.save(root / INDEX_DIR / "shard_names.npy", names.astype(np.bytes_))
    return root / INDEX_DIR / "manifest.json"


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
    code = main(
        [
            "--config",
            str(REPO / "configs" / "debug_llama.yaml"),
            "logging.console=false",
            "checkpoint.export_hf=false",
            "trainer.max_steps=1",
            "data.seq_len=64",
            "data.packing_buffer=8",
            f"trainer.output_dir={tmp_path / 'out'}",
            f"data.datasets=[{{path: {tmp_path / 'd'}}}]",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{manifest}: shards[0]: " in err, err
