"""An epochized blend: every epoch of the stream holds exactly ``counts[d]`` draws of dataset ``d``.

This is Megatron-Energon's ``blend_epochized`` (``headrace.dataio.stream.sources.metadataset``): dataset ``d`` of ``N_d``
samples with ``repetitions r_d`` contributes ``counts[d] = floor(r_d * N_d)`` draws to each epoch of
``S = sum(counts)`` positions. Draw ``k`` of a dataset is position ``k % N_d`` of its own epoch ``k // N_d``
(``headrace.dataio.stream.ordering.epoch_order``), so ``r = 2`` is two full passes in different orders and ``r = 0.5`` the first
half of one pass -- the next epoch goes on with the second half (energon restarts the pass, so the same
half may come again; here every sample comes once per two epochs).

Algorithm: ``headrace.dataio.stream.ordering.blend``'s closed form repeats a pattern of one period, which here would be
the whole epoch (millions of positions). Instead the datasets are the leaves of a balanced binary tree,
and a node of ``n`` positions gives its left child (``a`` of them) the positions where
``C(x) = floor((x a + n // 2) / n)`` steps up (a rounded Bresenham line): ``C(n) = a`` exactly, the left
child's index of node position ``x`` is ``C(x)`` and the right child's ``x - C(x)``. So position ->
(dataset, draw) is ``ceil(log2 datasets)`` integer steps, vectorised over a batch, with no tables and
no per-epoch memory; each level keeps its split within half a draw of even, so at every prefix of an
epoch each dataset's count is within ``~1 + log2(datasets)`` draws of its share. ``x a`` stays in int64
for epochs below ~3e9 positions; above that the steps use Python integers (exact, slower). Cost, CPU
per 1024-sample batch (``tools/bench_schedule.py``, BENCHMARKS.md): 49-71 us with 4 datasets, 123-146 us
with 64 (``BlendSchedule``: 13-21 us), 0.05-0.14 us a sample against the loader's ~6.5.
The loader's epoch is ``position // S``.
"""

from __future__ import annotations

import numpy as np

INT64_SAFE = 3_037_000_499  # epochs up to this: x * a < n * n fits int64


class EpochizedSchedule:
    """Which dataset (and which of its draws) sits at each global position; ``BlendSchedule``'s interface."""

    def __init__(self, counts: list[int], *, epochs: int | None = None):
        self.counts = np.asarray(counts, dtype=np.int64)
        if len(self.counts) == 0 or (self.counts <= 0).any():
            raise ValueError(f"every dataset of an epochized blend needs at least one draw, got {list(counts)}")
        self.period = int(self.counts.sum())  # positions per epoch
        self.end = None if epochs is None else epochs * self.period
        # The tree as arrays over node ids (0: the root), node covering datasets [lo, hi); a leaf is its own
        # left and right child holding all its positions, so every path takes `depth` steps, no masking.
        nodes: list[list[int]] = []  # [lo, hi, left, right]

        def build(lo: int, hi: int) -> int:
            me = len(nodes)
            nodes.append([lo, hi, me, me])
            if hi - lo > 1:
                mid = (lo + hi) // 2
                nodes[me][2], nodes[me][3] = build(lo, mid), build(mid, hi)
            return me

        build(0, len(self.counts))
        self.lo, self.hi, self.left, self.right = np.array(nodes, dtype=np.int64).T
        self.depth = (len(self.counts) - 1).bit_length()  # of a midpoint-split tree
        cum = np.concatenate([[0], np.cumsum(self.counts)])
        self.total = cum[self.hi] - cum[self.lo]  # positions of each node per epoch
        self.left_total = self.total[self.left]
        self.exact = self.period > INT64_SAFE

    def _count(self, node: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``C(x)`` of each node -- its left child's positions among its first ``x`` -- and whether position
        ``x`` is the left child's (``C(x + 1) > C(x)``: the remainder of ``C(x)``'s division is ``>= n - a``)."""
        a, n = self.left_total[node], self.total[node]
        if self.exact:  # Python integers (numpy's divmod does not take object arrays)
            x, a, n = x.astype(object), a.astype(object), n.astype(object)
            t = x * a + n // 2
            return (t // n).astype(np.int64), (t % n >= n - a).astype(bool)
        before, rem = np.divmod(x * a + n // 2, n)
        return before, rem >= n - a

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dataset, draw)`` of each global position."""
        epoch, x = np.divmod(np.asarray(positions, dtype=np.int64), self.period)
        node = np.zeros_like(x)
        for _ in range(self.depth):
            before, goes_left = self._count(node, x)
            x = np.where(goes_left, before, x - before)
            node = np.where(goes_left, self.left[node], self.right[node])
        dataset = self.lo[node]
        return dataset, epoch * self.counts[dataset] + x

    def draws_before(self, dataset: int, position: int) -> int:
        """How many draws ``dataset`` has at positions ``< position`` (counted down the tree's path to it)."""
        epoch, x = divmod(int(position), self.period)
        node = 0
        while self.left[node] != node:
            before = int(self._count(np.array([node]), np.array([x]))[0][0])
            left = int(self.left[node])
            node, x = (left, before) if dataset < self.hi[left] else (int(self.right[node]), x - before)
        return epoch * int(self.counts[dataset]) + x

    def epoch_at(self, position: int) -> int:
        return int(position) // self.period


__all__ = ["EpochizedSchedule"]
