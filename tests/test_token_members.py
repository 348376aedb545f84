"""Token members the loader refuses are refused alike by ``dataio verify`` and counted as bad samples by the loader
(issue 34 items 6 and 7): a pickle member, uint64 ids at or past 2**63 (they used to wrap to negative ids in the
batch, past the negative-id check), negative ids. Through ``dataio verify`` (``dataio``'s ``main``) and
``headrace.dataio.build_loader``."""

from __future__ import annotations

import numpy as np
import pytest
import webdataset as wds

from tests.loader_util import index_dir, npy_bytes

from headrace.dataio import build_loader
from headrace.dataio.cli import main as dataio
from headrace.dataio.config import DataConfig, DatasetSpec

BAD = {
    "pickle": ("pkl", b"\x80\x04K\x01.", "pickle-based member"),
    "uint64_past_int64": ("tokens.npy", npy_bytes(np.array([5, 2**63], dtype=np.uint64)), "does not fit int64"),
    "uint64_max": ("tokens.npy", npy_bytes(np.array([2**64 - 1], dtype=np.uint64)), "does not fit int64"),
    "negative": ("tokens.npy", npy_bytes(np.array([3, -1], dtype=np.int32)), "negative token id"),
}


def _dataset(root, member: str, payload: bytes, *, dtype=np.uint64):
    """Six good documents (ids 1..6 in ``dtype``) and, third, a bad one holding ``member``."""
    root.mkdir()
    with wds.TarWriter(str(root / "a-000000.tar")) as w:
        for i in range(6):
            w.write({"__key__": f"k{i}", "tokens.npy": npy_bytes(np.arange(1, 7, dtype=dtype))})
            if i == 2:
                w.write(
                    {"__key__": "bad", "tokens.npy": npy_bytes(np.arange(1, 7, dtype=dtype)), member: payload}
                    if member != "tokens.npy"
                    else {"__key__": "bad", member: payload}
                )
    index_dir(root)


@pytest.mark.parametrize("case", list(BAD))
def test_verify_fails_what_the_loader_refuses(tmp_path, capsys, case):
    member, payload, reason = BAD[case]
    _dataset(tmp_path / "d", member, payload)
    assert dataio(["verify", str(tmp_path / "d"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "sample 'bad'" in err and reason in err, err


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("packing", ["none", "best_fit"])
def test_loader_counts_the_bad_sample_and_batches_hold_no_negative_id(tmp_path, case, packing):
    member, payload, _ = BAD[case]
    _dataset(tmp_path / "d", member, payload)
    cfg = DataConfig(
        datasets=[DatasetSpec(path=str(tmp_path / "d"))],
        seq_len=16,
        packing=packing,
        batch_size=1,
        num_workers=0,
        max_bad_samples=1,
        epochs=1,
    )
    loader = build_loader(cfg, dp_rank=0, dp_size=1)
    ids = [int(v) for batch in loader for v in batch["input_ids"].reshape(-1)]
    assert loader.state_dict()["bad_samples"] == 1
    assert min(ids) >= 0 and 2**63 - 1 not in ids


PLAIN_BAD = {**{k: BAD[k] for k in ("uint64_past_int64", "uint64_max")}, "not_npy": ("tokens.npy", b"garbage", "")}


@pytest.mark.parametrize("case", list(PLAIN_BAD))
@pytest.mark.parametrize("workers", [0, 2])
def test_plain_batches_of_one_count_the_bad_sample_and_serve_every_other_once(tmp_path, case, workers):
    """Plain batches (no seq_len) of one sample (issue 46 items 5, 6): a uint64 id past int64 is refused as packing
    refuses it (it used to wrap negative), and the bad sample is counted, never replaced by another sample nor
    delivered as an empty batch."""
    member, payload, _ = PLAIN_BAD[case]
    _dataset(tmp_path / "d", member, payload)
    loader = build_loader(
        {
            "datasets": [{"path": str(tmp_path / "d")}],
            "batch_size": 1,
            "epochs": 1,
            "shuffle": False,
            "num_workers": workers,
            "max_bad_samples": 1,
        }
    )
    batches = list(loader)
    assert all(len(b["__key__"]) == 1 for b in batches)
    assert [k for b in batches for k in b["__key__"]] == [f"k{i}" for i in range(6)]
    assert all(int(b["tokens.npy"].numpy().max()) < 2**63 for b in batches)
    assert loader.state_dict()["bad_samples"] == 1
