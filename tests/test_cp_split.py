"""headrace.dataio.feed.cp_split: round trip, head-tail chunk layout, positions, per-rank work balance."""

import numpy as np
import pytest
import torch

from headrace.dataio.feed.cp_split import attention_work, cp_merge, cp_split
from headrace.dataio.batching.packing import IGNORE_INDEX, Packer, pack
from headrace.dataio.config import PackingConfig


def packed_batches(seed, seq_len=64, rows=2):
    rng = np.random.default_rng(seed)
    docs = [(i, rng.integers(0, 1000, int(rng.integers(1, 3 * seq_len)))) for i in range(30)]
    return list(
        pack(docs, Packer(PackingConfig(seq_len=seq_len, packing="best_fit", packing_buffer=8), rows_per_batch=rows))
    )


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_round_trip_and_layout(cp_size):
    for batch in packed_batches(cp_size):
        shards = cp_split(batch, cp_size)
        merged = cp_merge(shards)
        for k in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(merged[k], batch[k])
        cu = batch["cu_seqlens"].long()
        lengths = cu[1:] - cu[:-1]
        padded = (lengths + 2 * cp_size - 1) // (2 * cp_size) * (2 * cp_size)
        flat_pos = batch["position_ids"].reshape(-1)
        for r, s in enumerate(shards):
            local = s["cu_seqlens"].long()
            assert s["cu_seqlens"].dtype == torch.int32
            assert torch.equal(local[1:] - local[:-1], padded // cp_size)  # two chunks per segment
            assert int(local[-1]) == s["input_ids"].shape[1]
            assert torch.equal(s["cu_seqlens_padded"].long()[1:] - s["cu_seqlens_padded"].long()[:-1], padded)
            # segment by segment: chunk r then chunk 2c-1-r, positions of the full sequence
            pos = s["position_ids"].reshape(-1)
            for i in range(len(lengths)):
                c = int(padded[i]) // (2 * cp_size)
                seg = pos[int(local[i]) : int(local[i + 1])]
                start = int(flat_pos[int(cu[i])])
                expect = (
                    torch.cat(
                        [
                            torch.arange(r * c, (r + 1) * c),
                            torch.arange((2 * cp_size - 1 - r) * c, (2 * cp_size - r) * c),
                        ]
                    )
                    + start
                )
                assert torch.equal(seg, expect)
            # padding never carries a label
            real_tokens = sum(
                int(((lengths - k * c_).clamp(min=0)).minimum(c_).sum())
                for k, c_ in ((r, padded // (2 * cp_size)), (2 * cp_size - 1 - r, padded // (2 * cp_size)))
            )
            assert int((s["labels"] != IGNORE_INDEX).sum()) <= real_tokens


@pytest.mark.parametrize("cp_size", [2, 4])
def test_head_tail_balances_causal_work(cp_size):
    cu = torch.tensor([0, 4096, 4096 + 1000, 4096 + 1000 + 3096], dtype=torch.int32)
    report = attention_work(cu, cp_size)
    total = sum(((cu[1:] - cu[:-1]).long() * ((cu[1:] - cu[:-1]).long() + 1) // 2).tolist())
    assert sum(report["causal"]["work"]) == total == sum(report["causal_contiguous"]["work"])
    assert report["causal"]["imbalance"] < 1.01
    assert report["causal_contiguous"]["imbalance"] > 1.3
    assert report["sum_sq"]["imbalance"] < 1.01


def test_rejects_bad_input():
    batch = packed_batches(0)[0]
    with pytest.raises(ValueError, match="cp_size"):
        cp_split(batch, 0)
    bad = dict(batch, cu_seqlens=batch["cu_seqlens"][:-1])
    with pytest.raises(ValueError, match="span the batch"):
        cp_split(bad, 2)
