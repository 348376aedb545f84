import numpy as np
import pytest

from headrace.dataio.stream.ordering.blend import BlendSchedule, integer_weights


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.123, 0.3, 0.577], [5, 1], [0.01, 0.99]])
def test_realized_proportions_within_one_percent_over_10k(weights):
    blend = BlendSchedule(weights, [1000] * len(weights))
    dataset, _ = blend.locate(np.arange(10_000))
    realized = np.bincount(dataset, minlength=len(weights)) / 10_000
    assert np.abs(realized - np.array(weights) / sum(weights)).max() < 0.01
    # ... and at every prefix each count is within about one sample of its share.
    counts = np.stack([np.cumsum(dataset == d) for d in range(len(weights))])
    ideal = np.outer(np.array(weights) / sum(weights), np.arange(1, 10_001))
    assert np.abs(counts - ideal).max() <= 2


def test_draw_numbers_count_each_dataset_and_match_draws_before():
    blend = BlendSchedule([0.6, 0.4], [10, 3])
    dataset, draw = blend.locate(np.arange(500))
    for d in range(2):
        assert np.array_equal(draw[dataset == d], np.arange(np.sum(dataset == d)))
        for p in (0, 1, 7, 123, 499):
            assert blend.draws_before(d, p) == np.sum(dataset[:p] == d)
        assert blend.position_of_draw(d, 17) == np.flatnonzero(dataset == d)[17]


def test_small_dataset_repeats_large_one_does_not_restart_and_stream_ends():
    blend = BlendSchedule([0.5, 0.5], [100, 10], epochs=1)
    assert blend.leader == 0
    dataset, draw = blend.locate(np.arange(blend.end))
    assert np.sum(dataset == 0) == 100  # exactly one pass of the large dataset
    assert np.sum(dataset == 1) >= 99  # the small one went round ~10 times
    first = BlendSchedule([0.5, 0.5], [100, 10], epochs=1, stop_on_first_exhausted=True)
    dataset, _ = first.locate(np.arange(first.end))
    assert np.sum(dataset == 1) == 10 and first.end <= 21


def test_integer_weights_are_exact_for_simple_ratios():
    assert integer_weights([0.7, 0.3]).tolist() == [7, 3]
    assert integer_weights([2, 2, 4]).tolist() == [1, 1, 2]


@pytest.mark.parametrize(
    "counts,exact_path",
    [
        ([3, 5, 2], False),
        ([100, 1, 37, 8], False),
        ([1], False),
        ([2_000, 3, 500, 7, 7, 90, 1, 64], False),
        ([200_000, 3, 50_000], False),
        ([100, 1, 37, 8], True),
        ([2_000, 3, 500, 7, 7, 90, 1, 64], True),
    ],
)
def test_epochized_epochs_hold_exact_counts_evenly(monkeypatch, exact_path, counts):
    """Each epoch has exactly counts[d] draws of d, numbered on across epochs, within 1 + log2(datasets)
    of the even share at every prefix, and draws_before agrees with locate (``exact_path``: the Python
    integer steps of epochs past int64's reach, forced)."""
    from headrace.dataio.stream.ordering import epochized

    if exact_path:
        monkeypatch.setattr(epochized, "INT64_SAFE", 0)
    schedule = epochized.EpochizedSchedule(counts, epochs=2)
    size = schedule.period
    assert size == sum(counts) and schedule.end == 2 * size and schedule.epoch_at(size) == 1
    dataset, draw = schedule.locate(np.arange(2 * size))
    for d, c in enumerate(counts):
        assert (np.sort(draw[dataset == d]) == np.arange(2 * c)).all()
        assert (np.sort(draw[:size][dataset[:size] == d]) == np.arange(c)).all()  # epoch 0: draws 0..c-1
        share = np.cumsum(dataset[:size] == d) - np.arange(1, size + 1) * c / size
        assert np.abs(share).max() <= 1 + np.log2(len(counts))
        for p in (0, 1, size // 3, size - 1, size, 2 * size - 1):
            assert schedule.draws_before(d, p) == np.count_nonzero(dataset[:p] == d)


def test_epochized_epoch_past_int64_products():
    """An epoch of 4e9 positions (x * a passes int64): the last positions still end every count exactly."""
    from headrace.dataio.stream.ordering.epochized import EpochizedSchedule

    counts = [4_000_000_000, 3, 1_000]
    schedule = EpochizedSchedule(counts)
    size = schedule.period
    dataset, draw = schedule.locate(np.arange(size - 5_000, size + 5))
    for d, c in enumerate(counts):
        mine = draw[dataset == d]
        assert schedule.draws_before(d, size - 5_000) + np.count_nonzero(mine < c) == c  # the epoch's last draws
        assert (mine[mine >= c] == np.arange(c, c + np.count_nonzero(mine >= c))).all()  # then epoch 1 starts
