"""headrace.dataio.batching.bucketing: rank-synced duration buckets (simulated ranks) and audio collation."""

import numpy as np
import pytest
import torch

from headrace.dataio.batching.bucketing import collate_audio, consumed_indices, estimate_bucket_edges, plan_epoch
from headrace.dataio.config import BucketingConfig


def durations(n, seed=0):
    return np.random.default_rng(seed).gamma(3.0, 1.5, n) + 0.2  # ~4.7 s mean, long tail


def check_plan(plan, indices, dur_of, dp_size, max_duration):
    # buckets are disjoint duration ranges, shortest first
    assert (plan.bucket_range[1:, 0] >= plan.bucket_range[:-1, 1]).all()
    served = []
    for step, bucket in zip(plan.steps, plan.step_bucket):
        assert len(step) == dp_size  # every rank has a batch at every step
        for batch in step:
            assert len(batch) >= 1
            d = dur_of[batch]
            assert len(batch) * d.max() <= max_duration or len(batch) == 1
            served.append(batch)
        # rank-synced: every rank's batch at this step comes from the step's bucket
        low, high = plan.bucket_range[bucket]
        assert all(low <= dur_of[b].min() and dur_of[b].max() <= high for b in step)
    served = np.concatenate(served)
    assert np.array_equal(np.sort(served), np.sort(indices))  # each sample exactly once


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [7, 100, 1001])
def test_plan_covers_each_sample_once_with_equal_steps(dp_size, n):
    indices = np.arange(n) * 3 + 5  # global ids, not positions
    dur = durations(n, seed=n)
    dur_of = np.zeros(indices.max() + 1)
    dur_of[indices] = dur
    cfg = BucketingConfig(max_duration=30.0, num_buckets=6)
    plan = plan_epoch(indices, dur, seed=11, epoch=2, dp_size=dp_size, cfg=cfg)
    check_plan(plan, indices, dur_of, dp_size, cfg.max_duration)
    ranks = [plan.rank_batches(r) for r in range(dp_size)]
    assert len({len(r) for r in ranks}) == 1
    # pure: every rank computes the same plan; a new epoch reshuffles
    again = plan_epoch(indices, dur, seed=11, epoch=2, dp_size=dp_size, cfg=cfg)
    assert all(np.array_equal(a, b) for s, t in zip(plan.steps, again.steps) for a, b in zip(s, t))
    other = plan_epoch(indices, dur, seed=11, epoch=3, dp_size=dp_size, cfg=cfg)
    if n > 100:
        assert any(not np.array_equal(a[0], b[0]) for a, b in zip(plan.steps, other.steps))


def test_oversized_sample_is_kept_alone_and_tiny_sets_fail_clearly():
    dur = np.array([1.0, 2.0, 50.0, 1.5])
    plan = plan_epoch(
        np.arange(4), dur, seed=0, epoch=0, dp_size=1, cfg=BucketingConfig(max_duration=10.0, num_buckets=2)
    )
    assert plan.oversized == 1 and any(list(b) == [2] for s in plan.steps for b in s)
    with pytest.raises(ValueError, match="dp_size=8"):
        plan_epoch(np.arange(4), dur, seed=0, epoch=0, dp_size=8, cfg=BucketingConfig(max_duration=10.0))
    with pytest.raises(ValueError, match="NaN"):
        estimate_bucket_edges(np.array([1.0, np.nan]), 2)


def test_edges_split_total_duration_evenly():
    dur = durations(20000)
    edges = estimate_bucket_edges(dur, 4)
    totals = [dur[np.searchsorted(edges, dur, side="right") == b].sum() for b in range(4)]
    assert max(totals) / min(totals) < 1.05


def test_elastic_resume_plans_the_rest():
    n = 500
    dur = durations(n, seed=3)
    cfg = BucketingConfig(max_duration=40.0)
    old = plan_epoch(np.arange(n), dur, seed=1, epoch=0, dp_size=4, cfg=cfg)
    done = consumed_indices(old, 10)
    rest = np.setdiff1d(np.arange(n), done)
    new = plan_epoch(rest, dur[rest], seed=1, epoch=0, dp_size=3, cfg=cfg)
    served = np.concatenate([done] + [b for s in new.steps for b in s])
    assert np.array_equal(np.sort(served), np.arange(n))


def test_collate_audio_pads_and_keeps_lengths():
    samples = [
        {"__key__": f"u{i}", "audio": np.full(n, i + 1, np.float32), "tokens": np.arange(m) + 1}
        for i, (n, m) in enumerate([(5, 3), (2, 4), (7, 1)])
    ]
    batch = collate_audio(samples, pad_id=0)
    assert batch["audio"].shape == (3, 7) and batch["audio"].dtype == torch.float32
    assert batch["audio_lens"].tolist() == [5, 2, 7] and batch["token_lens"].tolist() == [3, 4, 1]
    for i, s in enumerate(samples):
        assert torch.equal(batch["audio"][i, : len(s["audio"])], torch.from_numpy(s["audio"]))
        assert (batch["audio"][i, len(s["audio"]) :] == 0).all()
        assert (batch["labels"][i, len(s["tokens"]) :] == -100).all()
    assert batch["__key__"] == ["u0", "u1", "u2"]
    with pytest.raises(ValueError, match="u9.*mono"):
        collate_audio([{"__key__": "u9", "audio": np.zeros((2, 3)), "tokens": [1]}])
