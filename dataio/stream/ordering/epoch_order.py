"""Deterministic epoch order of one dataset: a pure function of (seed, dataset, epoch, position).

Algorithm (``shuffle: true``): the epoch's shards are permuted (seed ``("shards", dataset, epoch)``)
and laid end to end; the resulting sequence is cut into windows (``window_starts``) and each window is
permuted on its own (seed ``("window", dataset, epoch, w)``). A window ends after ``window`` samples
and, with ``window_shards`` (``data.shuffle_window_shards``, default 64), also at every
``window_shards``-th shard boundary: a shard window. Then a batch no longer than a window reads the
shards of at most two windows, whatever the shard size, so the open-shard budget (128 at
``ulimit -n 1024``) holds them and a shuffled epoch over many small shards reopens a shard about once
per window instead of once per batch (the way webdataset, litdata and streaming bound open shards:
shuffle the shard order, then samples within a few shards). Position ``i`` of the epoch maps to a sample
index by three vectorised look-ups (its window, the window's permutation, then ``searchsorted`` over
the permuted shards' cumulative sizes). ``shuffle: false`` is the identity (shards in manifest order,
samples in tar order).

Quality (BENCHMARKS.md "Shuffle quality", ``tools/shuffle_quality.py``): the mean gap and position
correlation are those of the sample window at every shard size; consecutive samples come from one shard
at most ~1/window_shards of the time (the sample window: ~size / window when small shards make a window
span more shards).

Trade-off, against webdataset's shuffle buffer: a buffer of size B gives the same locality (reads stay
within ~B samples of the stream) but its contents are the state of the stream, so it must be saved and
refilled on resume (webdataset cannot resume at all). Here nothing is saved: the permutation of window
``w`` is recomputed from its seed in ~50 us per 8k samples. Within a window every order is equally
likely, which a buffer does not give (a buffer's output is biased toward recent inputs); samples
never move across windows, so mixing across distant shards comes only from the shard shuffle.
Memory is O(shards + window + epoch / window) (the window starts), and nothing is saved: the order is a
pure function of seed, dataset and epoch, so elastic resume is a position as before.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from headrace.dataio.stream.ordering.seeding import SeedSchedule, rng
from headrace.dataio.stream.sources.shard_source import by_value


class EpochOrder:
    """Maps epoch positions to global sample indices for one dataset (one split of one index)."""

    def __init__(
        self,
        shard_starts: np.ndarray,
        shard_sizes: np.ndarray,
        *,
        seed: int | SeedSchedule,
        dataset: int = 0,
        shuffle: bool = True,
        window: int = 8192,
        window_shards: int = 0,
    ):
        self.shard_starts = np.asarray(shard_starts, dtype=np.int64)
        self.shard_sizes = np.asarray(shard_sizes, dtype=np.int64)
        self.size = int(self.shard_sizes.sum())
        self.seeds = seed if isinstance(seed, SeedSchedule) else SeedSchedule(base=seed)
        self.dataset, self.shuffle, self.window = dataset, shuffle, max(1, int(window))
        self.window_shards = max(0, int(window_shards))
        self._identity_ends = np.cumsum(self.shard_sizes)
        self._shards: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None  # epoch, perm, ends, windows
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return self.size

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Global sample indices at ``positions`` (ascending, each in ``[0, len(self))``) of ``epoch``."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            shard_perm, ends, source = None, self._identity_ends, positions
        else:
            shard_perm, ends, windows = self._shard_layout(epoch)
            source = self._unwindow(epoch, windows, positions)
        slot = np.searchsorted(ends, source, side="right")
        shard = slot if shard_perm is None else shard_perm[slot]
        return self.shard_starts[shard] + (source - (ends[slot] - self.shard_sizes[shard]))

    def _shard_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._shards is None or self._shards[0] != epoch:
            seed = self.seeds.at(self.dataset, epoch)
            perm = rng(seed, "shards", self.dataset, epoch).permutation(len(self.shard_sizes))
            ends = np.cumsum(self.shard_sizes[perm])
            self._shards = (epoch, perm, ends, window_starts(ends, self.window, self.window_shards))
        return self._shards[1], self._shards[2], self._shards[3]

    def _unwindow(self, epoch: int, windows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        window = np.searchsorted(windows, positions, side="right") - 1
        within = positions - windows[window]
        first, last = (int(window[0]), int(window[-1])) if len(window) else (0, 0)  # ascending: the ends bound it
        if first == last:  # the common case: a whole batch inside one window
            return windows[first] + self._window_perm(epoch, windows, first)[within]
        out = np.empty_like(positions)
        for w, at in by_value(window):
            out[at] = windows[w] + self._window_perm(epoch, windows, w)[within[at]]
        return out

    def _window_perm(self, epoch: int, windows: np.ndarray, w: int) -> np.ndarray:
        perm = self._windows.get((epoch, w))
        if perm is None:
            length = int((windows[w + 1] if w + 1 < len(windows) else self.size) - windows[w])
            perm = rng(self.seeds.at(self.dataset, epoch), "window", self.dataset, epoch, w).permutation(length)
            self._windows[(epoch, w)] = perm
            if len(self._windows) > 4:  # workers move through windows in order; a few suffice
                self._windows.popitem(last=False)
        return perm


def window_starts(ends: np.ndarray, window: int, window_shards: int) -> np.ndarray:
    """The first position of each window of an epoch whose shards, in shuffled order, end at ``ends``:
    every ``window`` samples; with ``window_shards``, also at every ``window_shards``-th shard boundary
    (and ``window`` samples on from each), so no window spans more than ``window_shards`` shards."""
    size = int(ends[-1]) if len(ends) else 0
    if not window_shards or window_shards >= len(ends):
        return np.arange(0, max(size, 1), window, dtype=np.int64)
    group_ends = ends[window_shards - 1 :: window_shards]
    if group_ends[-1] != size:
        group_ends = np.append(group_ends, size)
    group_starts = np.concatenate([[0], group_ends[:-1]])
    keep = group_ends > group_starts  # a group of empty shards holds no window
    group_starts, group_ends = group_starts[keep], group_ends[keep]
    count = -(-(group_ends - group_starts) // window)
    first = np.cumsum(count) - count
    step = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first, count)
    starts = np.repeat(group_starts, count) + step * window
    return starts if len(starts) else np.zeros(1, dtype=np.int64)


__all__ = ["EpochOrder", "window_starts"]
