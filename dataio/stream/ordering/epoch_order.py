"""Deterministic epoch order of one dataset: a pure function of (seed, dataset, epoch, position).

Algorithm (``shuffle: true``): the epoch's shards are permuted (seed ``("shards", dataset, epoch)``)
and laid end to end; the resulting sequence is cut into windows of ``window`` consecutive samples and
each window is permuted on its own (seed ``("window", dataset, epoch, w)``). Position ``i`` of the
epoch maps to a sample index by two vectorised look-ups (window permutation, then ``searchsorted``
over the permuted shards' cumulative sizes). ``shuffle: false`` is the identity (shards in manifest
order, samples in tar order).

Trade-off, against webdataset's shuffle buffer: a buffer of size B gives the same locality (reads stay
within ~B samples of the stream) but its contents are the state of the stream, so it must be saved and
refilled on resume (webdataset cannot resume at all). Here nothing is saved: the permutation of window
``w`` is recomputed from its seed in ~50 us per 8k samples. Within a window every order is equally
likely, which a buffer does not give (a buffer's output is biased toward recent inputs); samples
never move across windows, so mixing across distant shards comes only from the shard shuffle.
Memory is O(shards + window), independent of the epoch length.
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
    ):
        self.shard_starts = np.asarray(shard_starts, dtype=np.int64)
        self.shard_sizes = np.asarray(shard_sizes, dtype=np.int64)
        self.size = int(self.shard_sizes.sum())
        self.seeds = seed if isinstance(seed, SeedSchedule) else SeedSchedule(base=seed)
        self.dataset, self.shuffle, self.window = dataset, shuffle, max(1, int(window))
        self._identity_ends = np.cumsum(self.shard_sizes)
        self._shards: tuple[int, np.ndarray, np.ndarray] | None = None  # (epoch, permutation, ends)
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return self.size

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Global sample indices at ``positions`` (ascending, each in ``[0, len(self))``) of ``epoch``."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            shard_perm, ends, source = None, self._identity_ends, positions
        else:
            shard_perm, ends = self._shard_layout(epoch)
            source = self._unwindow(epoch, positions)
        slot = np.searchsorted(ends, source, side="right")
        shard = slot if shard_perm is None else shard_perm[slot]
        return self.shard_starts[shard] + (source - (ends[slot] - self.shard_sizes[shard]))

    def _shard_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if self._shards is None or self._shards[0] != epoch:
            seed = self.seeds.at(self.dataset, epoch)
            perm = rng(seed, "shards", self.dataset, epoch).permutation(len(self.shard_sizes))
            self._shards = (epoch, perm, np.cumsum(self.shard_sizes[perm]))
        return self._shards[1], self._shards[2]

    def _unwindow(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        window = positions // self.window
        within = positions - window * self.window
        first, last = (int(window[0]), int(window[-1])) if len(window) else (0, 0)  # ascending: the ends bound it
        if first == last:  # the common case: a whole batch inside one window
            return first * self.window + self._window_perm(epoch, first)[within]
        out = np.empty_like(positions)
        for w, at in by_value(window):
            out[at] = w * self.window + self._window_perm(epoch, w)[within[at]]
        return out

    def _window_perm(self, epoch: int, w: int) -> np.ndarray:
        perm = self._windows.get((epoch, w))
        if perm is None:
            length = min(self.window, self.size - w * self.window)
            perm = rng(self.seeds.at(self.dataset, epoch), "window", self.dataset, epoch, w).permutation(length)
            self._windows[(epoch, w)] = perm
            if len(self._windows) > 4:  # workers move through windows in order; a few suffice
                self._windows.popitem(last=False)
        return perm


__all__ = ["EpochOrder"]
