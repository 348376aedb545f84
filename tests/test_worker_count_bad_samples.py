"""``num_workers: auto`` with bad samples under a budget (issue 34 item 22): the measurement's throwaway loaders
neither warn about nor count the bad samples (each warning used to print 5-6 times and the count run past the
budget while re-reading the same samples); the job's loader counts each bad sample once. Through
``headrace.dataio.build_loader``, the measurement forced (this machine may give a rank one core)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import webdataset as wds

from tests.loader_util import index_dir, npy_bytes

from headrace.dataio import build_loader, worker_count

BAD = 8


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_count, "usable_cores", lambda: 2)
    monkeypatch.setattr(worker_count, "_chosen", {})
    root = tmp_path / "d"
    root.mkdir()
    with wds.TarWriter(str(root / "a-000000.tar")) as w:
        for i in range(24):
            tokens = np.ones(5, np.float32) if i % 3 == 0 else np.arange(1, 9, dtype=np.int32)
            w.write({"__key__": f"k{i:02d}", "npy": npy_bytes(tokens)})
    index_dir(root)
    return root


@pytest.mark.parametrize("budget", [100, BAD])  # BAD: the trial loaders alone would pass it, re-reading the data
def test_auto_workers_count_and_say_each_bad_sample_once(data, caplog, budget):
    caplog.set_level(logging.WARNING, logger="headrace.dataio.stream.reading.batches")
    loader = build_loader(
        {
            "datasets": [{"path": str(data)}],
            "num_workers": "auto",
            "seq_len": 16,
            "packing": "best_fit",
            "packing_buffer": 4,
            "batch_size": 1,
            "epochs": 1,
            "max_bad_samples": budget,
        },
        0,
        1,
    )
    assert loader.worker_choice is not None
    said = [r.getMessage() for r in caplog.records if "skipping bad sample" in r.getMessage()]
    assert said == [], said  # the measurement said nothing
    list(loader)
    assert loader.state_dict()["bad_samples"] == BAD
