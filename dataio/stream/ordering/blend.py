"""Deterministic weighted interleave of datasets, as a closed-form function of global position.

Algorithm: weights become integers ``c_d`` (exact for simple ratios like 0.7/0.3, rounded to 1e-5
otherwise) with period ``S = sum(c_d)``. Inside one period, dataset ``d``'s ``k``-th draw is placed at
the ideal time ``(k + 1/2) / c_d``; sorting all ``S`` times (ties by dataset id) gives a fixed pattern,
repeated forever. So position ``p`` belongs to dataset ``pattern[p % S]``, and it is that dataset's draw
number ``k = (p // S) * c_d + occurrence[p % S]`` -- no counters to carry, any position computable in
O(1), and at every prefix each dataset's count is within one sample of ``p * w_d`` (far inside the
1%-over-10,000-samples target; a random categorical draw is off by ~sqrt(p)).

Per-dataset epochs fall out of the draw number: draw ``k`` of a dataset with ``N`` samples is position
``k % N`` of its epoch ``k // N``. A small dataset therefore repeats (its epoch counter runs ahead) while
a large one keeps going without restarting. With ``epochs: E`` the stream ends when every dataset has
finished E passes (``stop_on_first_exhausted: false``; smaller ones repeat meanwhile) or when the first
one has (``true``). The loader's reported epoch is that of the dataset that decides the end.

Memory: O(S) for the pattern (S <= 100,000).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

MAX_PERIOD = 100_000


def integer_weights(weights: list[float]) -> np.ndarray:
    """Smallest integer counts per period with the given ratios (rounded when the period would be huge)."""
    total = sum(weights)
    fracs = [Fraction(w / total).limit_denominator(1000) for w in weights]
    lcm = math.lcm(*(f.denominator for f in fracs))
    if lcm <= MAX_PERIOD and all(f > 0 for f in fracs):
        counts = [int(f * lcm) for f in fracs]
    else:
        counts = [max(1, round(w / total * MAX_PERIOD)) for w in weights]
    g = math.gcd(*counts)
    return np.array([c // g for c in counts], dtype=np.int64)


class BlendSchedule:
    """Which dataset (and which of its draws) sits at each global position of the blended stream."""

    def __init__(
        self,
        weights: list[float],
        sizes: list[int],
        *,
        epochs: int | None = None,
        stop_on_first_exhausted: bool = False,
    ):
        if any(n <= 0 for n in sizes):
            raise ValueError(f"every blended dataset needs at least one sample, got sizes {sizes}")
        self.counts = integer_weights(weights)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.period = int(self.counts.sum())
        times = np.concatenate([(2 * np.arange(c) + 1) / (2 * c) for c in self.counts])
        owner = np.repeat(np.arange(len(self.counts)), self.counts)
        order = np.lexsort((owner, times))
        self.pattern = owner[order].astype(np.int64)
        self.occurrence = np.concatenate([np.arange(c) for c in self.counts])[order]
        # Positions (within the period) of each dataset's draws, for inverting draw -> position.
        self._slots = [np.flatnonzero(self.pattern == d) for d in range(len(self.counts))]
        # The dataset that decides the end of a finite stream (and whose passes count as epochs).
        passes = self.sizes / self.counts  # periods per pass
        self.leader = int(np.argmin(passes) if stop_on_first_exhausted else np.argmax(passes))
        self.end = None if epochs is None else self.position_of_draw(self.leader, epochs * int(self.sizes[self.leader]))

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset, draw)`` of each global position."""
        cycle, slot = np.divmod(np.asarray(positions, dtype=np.int64), self.period)
        dataset = self.pattern[slot]
        return dataset, cycle * self.counts[dataset] + self.occurrence[slot]

    def position_of_draw(self, dataset: int, draw: int) -> int:
        """The global position of ``dataset``'s draw number ``draw`` (its count before that position)."""
        cycle, k = divmod(int(draw), int(self.counts[dataset]))
        return cycle * self.period + int(self._slots[dataset][k])

    def draws_before(self, dataset: int, position: int) -> int:
        """How many draws ``dataset`` has at positions ``< position`` (its blend counter)."""
        cycle, slot = divmod(int(position), self.period)
        return cycle * int(self.counts[dataset]) + int(np.searchsorted(self._slots[dataset], slot))

    def epoch_at(self, position: int) -> int:
        """The loader's epoch at ``position``: completed passes of the deciding dataset."""
        return self.draws_before(self.leader, position) // int(self.sizes[self.leader])


__all__ = ["BlendSchedule", "integer_weights"]
