"""An epochized blend: every epoch of the stream holds exactly ``counts[d]`` draws of dataset ``d``.

This is Megatron-Energon's ``blend_epochized`` (``dataio.stream.metadataset``): dataset ``d`` of ``N_d``
samples with ``repetitions r_d`` contributes ``counts[d] = floor(r_d * N_d)`` draws to each epoch of
``S = sum(counts)`` positions. Draw ``k`` of a dataset is position ``k % N_d`` of its own epoch ``k // N_d``
(``dataio.stream.order``), so ``r = 2`` is two full passes in different orders and ``r = 0.5`` the first
half of one pass -- the next epoch goes on with the second half (energon restarts the pass, so the same
half may come again; here every sample comes once per two epochs).

Algorithm: ``dataio.stream.blend``'s closed form needs a pattern of one whole period, which here is the
epoch (millions of positions, not the <= 100,000 of a weight ratio). So the epoch is cut into
``M = ceil(S / CHUNK)`` chunks, chunk ``c`` holding ``floor(L_d (c+1) / M) - floor(L_d c / M)`` draws of
dataset ``d``; the chunk's start is ``sum_d floor(L_d c / M)`` (closed form), and inside it the draws are
interleaved like a blend period (``interleave``; built when a chunk is first touched, a few cached).
Position -> (dataset, draw) is therefore O(datasets) a position plus O(CHUNK log CHUNK) per new chunk
(~5 ms), memory O(CHUNK), and at every prefix each dataset's count is within two draws of its share.
The loader's epoch is the stream's: ``position // S``.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from dataio.stream.blend import interleave

CHUNK = 1 << 16


class EpochizedSchedule:
    """Which dataset (and which of its draws) sits at each global position; ``BlendSchedule``'s interface."""

    def __init__(self, counts: list[int], *, epochs: int | None = None):
        self.counts = np.asarray(counts, dtype=np.int64)
        if len(self.counts) == 0 or (self.counts <= 0).any():
            raise ValueError(f"every dataset of an epochized blend needs at least one draw, got {list(counts)}")
        self.period = int(self.counts.sum())  # positions per epoch
        self.chunks = -(-self.period // CHUNK)
        self.end = None if epochs is None else epochs * self.period
        self._patterns: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _before(self, chunks: np.ndarray) -> np.ndarray:
        """Draws of each dataset before each chunk: ``floor(L_d c / M)``, shape ``(len(chunks), datasets)``
        (split so that no product passes int64)."""
        c = np.asarray(chunks, dtype=np.int64)[:, None]
        whole, part = np.divmod(self.counts, self.chunks)
        return whole * c + (part * c) // self.chunks

    def _chunk_of(self, within: np.ndarray) -> np.ndarray:
        """The chunk of each position inside an epoch (chunk ``c`` starts within ``datasets`` below ``c S / M``)."""
        guess = np.minimum(within * self.chunks // self.period, self.chunks - 1)
        lo = max(0, int(guess.min()) - 1)  # the chunk is >= guess; above it by at most ~2 datasets / CHUNK
        hi = min(self.chunks, int(guess.max()) + 2 * len(self.counts) // CHUNK + 3)
        starts = self._before(np.arange(lo, hi + 1)).sum(axis=1)
        return lo + np.searchsorted(starts, within, side="right") - 1

    def _pattern(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        entry = self._patterns.get(chunk)
        if entry is None:
            first, last = self._before(np.array([chunk, chunk + 1]))
            entry = self._patterns[chunk] = interleave(last - first)
            if len(self._patterns) > 4:  # batches walk through chunks in order; a few suffice
                self._patterns.popitem(last=False)
        return entry

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset, draw)`` of each global position."""
        epoch, within = np.divmod(np.asarray(positions, dtype=np.int64), self.period)
        chunk = self._chunk_of(within)
        dataset, draw = np.empty_like(within), np.empty_like(within)
        for c in np.unique(chunk):
            at = chunk == c
            first = self._before(np.array([c]))[0]
            pattern, occurrence = self._pattern(int(c))
            slot = within[at] - first.sum()
            dataset[at] = pattern[slot]
            draw[at] = first[pattern[slot]] + occurrence[slot]
        return dataset, epoch * self.counts[dataset] + draw

    def draws_before(self, dataset: int, position: int) -> int:
        """How many draws ``dataset`` has at positions ``< position``."""
        epoch, within = divmod(int(position), self.period)
        chunk = int(self._chunk_of(np.array([within]))[0])
        first = self._before(np.array([chunk]))[0]
        pattern, _ = self._pattern(chunk)
        slot = within - int(first.sum())
        here = int(np.count_nonzero(pattern[:slot] == dataset))
        return epoch * int(self.counts[dataset]) + int(first[dataset]) + here

    def epoch_at(self, position: int) -> int:
        return int(position) // self.period


__all__ = ["CHUNK", "EpochizedSchedule"]
