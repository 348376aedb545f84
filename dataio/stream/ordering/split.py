"""Which global positions a DP rank serves, batch by batch, and how a resume changes the layout.

Rule: from the layout's ``start`` position, DP rank ``r`` of ``n`` takes the global positions
``start + r + n*j`` for ``j = 0, 1, ...`` (its local stream). DP ranks are disjoint and together cover
every position exactly once; TP/PP/CP peers share ``r`` and so get identical data. Batch ``b`` of a rank
is its local positions ``[j0 + b*B, j0 + (b+1)*B)``. Worker processes take whole batches
(in tasks of consecutive batches, round-robin) and the main process reads them back in batch order, so the stream does not
depend on the worker count or timing.

The tail of a finite stream: with ``T`` positions left, every rank yields exactly
``ceil(ceil(T / n) / B)`` batches; the last one may be short, and a rank left with no position at all
gets one padding sample flagged ``__valid__ = False`` (so no rank runs out first and hangs a
collective, and no real sample is served twice).

Resume: a rank's state is ``(layout, j)`` where ``j`` counts local positions consumed. Restored with
the same layout, each rank continues at its own ``j``. Restored with another ``dp_size``, the new
layout starts at the lowest position not yet consumed by any old rank; the old ranks' positions
beyond it (there are some only when ranks consumed different counts, e.g. with packing) go into
``skips`` and are passed over. Skip layouts are dropped once every rank is past them, so the state
stays a handful of integers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(kw_only=True)
class ConsumedLayout:
    """Positions ``start + r + dp_size*j`` with ``j < consumed[r]`` were consumed by an old layout."""

    start: int
    dp_size: int
    consumed: list[int]

    def frontier(self) -> int:
        """The lowest position this layout did not consume."""
        return min(self.start + r + self.dp_size * c for r, c in enumerate(self.consumed))

    def end(self) -> int:
        """One past the highest position this layout consumed."""
        return max(self.start + r + self.dp_size * c - self.dp_size + 1 for r, c in enumerate(self.consumed))

    def covers(self, positions: np.ndarray) -> np.ndarray:
        rel = positions - self.start
        rank = rel % self.dp_size
        return (rel >= 0) & (rel // self.dp_size < np.asarray(self.consumed)[rank])


@dataclass(kw_only=True)
class Layout:
    start: int = 0
    dp_size: int = 1
    skips: list[ConsumedLayout] = field(default_factory=list)

    def positions(self, dp_rank: int, local: np.ndarray) -> np.ndarray:
        return self.start + dp_rank + self.dp_size * np.asarray(local, dtype=np.int64)

    def skipped(self, positions: np.ndarray) -> np.ndarray:
        mask = np.zeros(len(positions), dtype=bool)
        for s in self.skips:
            mask |= s.covers(positions)
        return mask

    def local_count(self, dp_rank: int, end: int | None) -> int | None:
        """Local positions of ``dp_rank`` before global position ``end`` (None: endless)."""
        if end is None:
            return None
        return max(0, -(-(end - self.start - dp_rank) // self.dp_size))

    def num_batches(self, end: int | None, first_local: int, batch_size: int) -> int | None:
        """Batches every rank yields from local position ``first_local`` until ``end`` (same for all ranks)."""
        if end is None:
            return None
        longest = self.local_count(0, end)  # rank 0 has the most positions
        return max(0, -(-(longest - first_local) // batch_size))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        return cls(
            start=int(d["start"]), dp_size=int(d["dp_size"]), skips=[ConsumedLayout(**s) for s in d.get("skips", [])]
        )


def relayout(old: Layout, consumed: list[int]) -> Layout:
    """The layout for a new ``dp_size`` after ``old`` ranks consumed ``consumed[r]`` local positions each.

    Everything below the returned ``start`` was consumed; consumed positions above it are in ``skips``
    (the new ``dp_size`` is filled in by the caller; positions do not depend on it)."""
    if len(consumed) != old.dp_size:
        raise ValueError(f"need the state of every old DP rank: got {len(consumed)}, old dp_size is {old.dp_size}")
    layers = [*old.skips, ConsumedLayout(start=old.start, dp_size=old.dp_size, consumed=list(consumed))]
    start = layers[-1].frontier()
    while any(s.covers(np.array([start]))[0] for s in layers):  # an older skip layer may reach further
        start += 1
    return Layout(start=start, skips=[s for s in layers if s.end() > start])


def same_layout(old: list[dict | None], dp_rank: int, dp_size: int) -> bool:
    """Whether the old states continue exactly on this rank: the same ``dp_size`` and this rank's own
    state given. Otherwise every old rank's state is there (``Loader.load_state_dict`` checks) and
    stages re-lay their state out over the new ranks."""
    return len(old) == dp_size and old[dp_rank] is not None


__all__ = ["ConsumedLayout", "Layout", "relayout", "same_layout"]
