"""A packed loader whose read chunk holds no good sample at all (every one bad, counted under
``max_bad_samples``) goes on to the next chunk (issue 34 item 13); it used to end in ``KeyError: 'npy'`` in the
packing stage after counting them. Through ``headrace.dataio.build_loader`` with 0 and 2 workers, and through the
trainer."""

from __future__ import annotations

import numpy as np
import pytest
import webdataset as wds

from tests.helpers import REPO
from tests.loader_util import index_dir, npy_bytes

from headrace.dataio import build_loader

BAD, GOOD = 60, 6


def _dataset(root):
    """``BAD`` samples whose tokens are floats (packing refuses them), then ``GOOD`` documents."""
    root.mkdir()
    with wds.TarWriter(str(root / "a-000000.tar")) as w:
        for i in range(BAD):
            w.write({"__key__": f"bad{i:03d}", "npy": npy_bytes(np.ones(40_000, dtype=np.float32))})
        for i in range(GOOD):
            w.write({"__key__": f"good{i}", "npy": npy_bytes(np.arange(1, 9, dtype=np.int32))})
    index_dir(root)


@pytest.mark.parametrize("workers", [0, 2])
def test_chunks_of_only_bad_samples_are_skipped_and_counted(tmp_path, workers):
    _dataset(tmp_path / "d")
    loader = build_loader(
        {
            "datasets": [{"path": str(tmp_path / "d")}],
            "seq_len": 16,
            "packing": "best_fit",
            "packing_buffer": 4,
            "batch_size": 1,
            "shuffle": False,
            "epochs": 1,
            "num_workers": workers,
            "max_bad_samples": BAD,
        },
        0,
        1,
    )
    docs = sum(int(b["num_docs"]) for b in loader)
    assert docs == GOOD and loader.state_dict()["bad_samples"] == BAD


def test_trainer_counts_them_then_stops_at_the_budget(tmp_path, capsys, monkeypatch):
    from headrace.training.__main__ import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HEADRACE_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    _dataset(tmp_path / "d")
    code = main(
        [
            "--config",
            str(REPO / "configs" / "debug_llama.yaml"),
            "logging.console=false",
            "checkpoint.export_hf=false",
            "trainer.max_steps=3",
            "data.seq_len=16",
            "data.packing_buffer=4",
            "data.shuffle=false",
            f"data.max_bad_samples={BAD - 1}",
            f"trainer.output_dir={tmp_path / 'out'}",
            f"data.datasets=[{{path: {tmp_path / 'd'}}}]",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error") and f"more than max_bad_samples={BAD - 1}" in err[-1], err[-3:]
