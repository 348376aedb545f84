import numpy as np
import pytest

from headrace.dataio.stream.ordering.epoch_order import EpochOrder, window_starts


@pytest.mark.parametrize("window_shards", [0, 1, 2])
@pytest.mark.parametrize(
    "sizes,window", [([7, 5, 3, 1], 4), ([10], 3), ([1, 1, 1], 8), ([100, 37, 64], 16), ([0, 3, 0, 0, 2], 2)]
)
def test_each_epoch_is_a_permutation_and_deterministic(sizes, window, window_shards):
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    order = EpochOrder(starts, sizes, seed=3, shuffle=True, window=window, window_shards=window_shards)
    n = sum(sizes)
    epochs = []
    for epoch in range(3):
        full = order.indices(epoch, np.arange(n))
        assert sorted(full.tolist()) == list(range(n))
        # Any chunking of the positions gives the same answer (workers ask for scattered batches).
        for i in range(3):
            assert np.array_equal(order.indices(epoch, np.arange(n)[i::3]), full[i::3])
        again = EpochOrder(starts, sizes, seed=3, shuffle=True, window=window, window_shards=window_shards)
        again = again.indices(epoch, np.arange(n))
        assert np.array_equal(full, again)
        epochs.append(full)
    if n > 5:
        assert not np.array_equal(epochs[0], epochs[1])
        other_seed = EpochOrder(starts, sizes, seed=4, shuffle=True, window=window, window_shards=window_shards)
        other_seed = other_seed.indices(0, np.arange(n))
        assert not np.array_equal(epochs[0], other_seed)


def test_no_shuffle_is_the_identity_and_windows_bound_the_displacement():
    sizes = [50, 50, 50, 50]
    starts = np.array([0, 50, 100, 150])
    assert np.array_equal(EpochOrder(starts, sizes, seed=0, shuffle=False).indices(5, np.arange(200)), np.arange(200))
    out = EpochOrder(starts, sizes, seed=0, shuffle=True, window=10).indices(0, np.arange(200))
    # The shard shuffle moves whole shards; inside a window of 10, samples of at most two shards mix.
    for w in range(20):
        shards = set((out[w * 10 : (w + 1) * 10] // 50).tolist())
        assert len(shards) <= 2


def test_split_subset_uses_global_starts():
    order = EpochOrder(np.array([10, 30]), np.array([3, 2]), seed=1, shuffle=True, window=2)
    assert sorted(order.indices(0, np.arange(5)).tolist()) == [10, 11, 12, 30, 31]


def test_a_shard_window_bounds_the_shards_a_batch_reads():
    """With ``window_shards`` a window holds at most that many shards (and ``window`` samples), so a
    batch no longer than a window spans at most two windows' shards; without it (the sample window) a window of
    small shards spans window / shard-size shards. The sample window's cuts are every ``window`` samples."""
    sizes = np.full(1000, 10)
    starts = np.arange(0, 10_000, 10)
    windows = window_starts(np.cumsum(sizes), 128, 8)
    assert np.array_equal(windows, np.arange(0, 10_000, 80))  # 8 shards of 10 samples a window
    assert np.array_equal(window_starts(np.cumsum(sizes), 128, 0), np.arange(0, 10_000, 128))
    assert window_starts(np.array([5, 300, 310]), 100, 2).tolist() == [0, 100, 200, 300]  # a big shard: cut by samples
    order = EpochOrder(starts, sizes, seed=2, window=8192, window_shards=8)
    out = order.indices(1, np.arange(10_000))
    for a in range(0, 10_000, 64):
        assert len(set((out[a : a + 64] // 10).tolist())) <= 16  # a batch no longer than a window: two windows
    for w in range(0, 10_000, 80):
        assert len(set((out[w : w + 80] // 10).tolist())) == 8
    wide = EpochOrder(starts, sizes, seed=2, window=8192).indices(1, np.arange(10_000))
    assert max(len(set((wide[a : a + 64] // 10).tolist())) for a in range(0, 10_000, 64)) > 50
