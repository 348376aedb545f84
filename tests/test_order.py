import numpy as np
import pytest

from headrace.dataio.stream.ordering.epoch_order import EpochOrder


@pytest.mark.parametrize("sizes,window", [([7, 5, 3, 1], 4), ([10], 3), ([1, 1, 1], 8), ([100, 37, 64], 16)])
def test_each_epoch_is_a_permutation_and_deterministic(sizes, window):
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    order = EpochOrder(starts, sizes, seed=3, shuffle=True, window=window)
    n = sum(sizes)
    epochs = []
    for epoch in range(3):
        full = order.indices(epoch, np.arange(n))
        assert sorted(full.tolist()) == list(range(n))
        # Any chunking of the positions gives the same answer (workers ask for scattered batches).
        for i in range(3):
            assert np.array_equal(order.indices(epoch, np.arange(n)[i::3]), full[i::3])
        again = EpochOrder(starts, sizes, seed=3, shuffle=True, window=window).indices(epoch, np.arange(n))
        assert np.array_equal(full, again)
        epochs.append(full)
    if n > 5:
        assert not np.array_equal(epochs[0], epochs[1])
        other_seed = EpochOrder(starts, sizes, seed=4, shuffle=True, window=window).indices(0, np.arange(n))
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
