"""2D bucketing (audio duration x output tokens) with simulated ranks: every sample once per epoch across
DP ranks, equal steps per rank, every batch within its bucket's limits, resume onto another dp_size."""

from __future__ import annotations

import numpy as np
import pytest

from headrace.dataio.batching.bucketing import consumed_indices, estimate_2d_bins, plan_epoch
from headrace.dataio.config import BucketingConfig


def _corpus(n: int = 1500, seed: int = 0):
    rng = np.random.default_rng(seed)
    durations = rng.gamma(2.0, 3.0, n).clip(0.3, 30.0)
    tokens = (durations * rng.uniform(1.0, 6.0, n)).astype(np.int64) + 1  # speaking rate varies
    return np.arange(n), durations, tokens


def _check_plan(plan, indices, durations, tokens, bins, sizes, dp_size):
    served = [b for step in plan.steps for b in step]
    assert all(len(step) == dp_size for step in plan.steps)  # equal steps per rank, rank-synced
    assert sorted(np.concatenate(served).tolist()) == sorted(indices.tolist())  # each sample exactly once
    for step in plan.steps:
        # one bucket per step: every rank's batch fits the same bin (the first that holds all its samples)
        for batch in step:
            fit = np.flatnonzero((durations[batch].max() <= bins[:, 0]) & (tokens[batch].max() <= bins[:, 1]))
            assert len(fit), (durations[batch], tokens[batch])
            assert len(batch) <= sizes[fit[0]]


def test_2d_bins_exactly_once_equal_steps_within_limits_and_resume_on_other_dp_size():
    indices, durations, tokens = _corpus()
    bins = estimate_2d_bins(durations, tokens, 4, 3)
    assert bins.shape[1] == 2 and len(bins) == 12
    assert (np.diff(bins[:, 0]) >= 0).all()
    sizes = [max(1, int(600 / (d * 2 + t))) for d, t in bins]  # shorter buckets take bigger batches
    cfg = BucketingConfig(bucket_duration_bins=bins.tolist(), bucket_batch_size=sizes)
    plan = plan_epoch(indices, durations, tokens=tokens, seed=3, epoch=0, dp_size=4, cfg=cfg)
    assert plan.merges == 0  # so every batch keeps its own bin's size
    _check_plan(plan, indices, durations, tokens, bins, sizes, 4)
    # the same plan is computed on every rank; rank r takes batch r of each step
    again = plan_epoch(indices, durations, tokens=tokens, seed=3, epoch=0, dp_size=4, cfg=cfg)
    assert all((a == b).all() for s, t in zip(plan.steps, again.steps) for a, b in zip(s, t))
    # resume after 7 steps onto 3 ranks: the rest of the epoch, planned again over the same bins
    done = consumed_indices(plan, 7)
    rest = np.setdiff1d(indices, done)
    replanned = plan_epoch(
        rest, durations[rest], tokens=tokens[rest], seed=3, epoch=0, dp_size=3, cfg=cfg, edges=plan.edges
    )
    served = np.concatenate([done, *[b for step in replanned.steps for b in step]])
    assert sorted(served.tolist()) == indices.tolist()
    _check_plan(replanned, rest, durations, tokens, bins, sizes, 3)


def test_2d_greedy_cut_by_padded_duration_and_tokens():
    indices, durations, tokens = _corpus(800, seed=1)
    cfg = BucketingConfig(max_duration=60.0, max_tokens=200, num_buckets=3, num_token_buckets=2)
    plan = plan_epoch(indices, durations, tokens=tokens, seed=0, epoch=0, dp_size=2, cfg=cfg)
    for step in plan.steps:
        for batch in step:
            if len(batch) > 1:
                assert len(batch) * durations[batch].max() <= 60.0
                assert len(batch) * tokens[batch].max() <= 200


def test_2d_config_errors():
    with pytest.raises(ValueError, match="one per bin"):
        BucketingConfig(bucket_duration_bins=[[5, 20], [10, 40]], bucket_batch_size=[4])
    with pytest.raises(ValueError, match="sorted"):
        BucketingConfig(max_duration=10, bucket_duration_bins=[[10, 40], [5, 20]])
    with pytest.raises(ValueError, match="max_duration .* or bucket_batch_size"):
        BucketingConfig()
    with pytest.raises(ValueError, match="token count"):
        plan_epoch(
            np.arange(4),
            np.ones(4),
            seed=0,
            epoch=0,
            dp_size=1,
            cfg=BucketingConfig(max_duration=10, num_token_buckets=2),
            tokens=np.array([1, 2, -1, 3]),
        )
