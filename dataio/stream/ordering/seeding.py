"""Every random stream of the data path, derived from one base seed by one function.

``derive_seed(base_seed, purpose, *coords)`` feeds the base seed as entropy and ``(purpose, *coords)``
as the spawn key of a ``numpy.random.SeedSequence``: streams for different coordinates are
statistically independent (SeedSequence hashes them, unlike ``base_seed + rank`` which makes rank 1 of
run 0 equal rank 0 of run 1), cost about 10 microseconds, and need no state. The coordinates used in
the data path:

- ``("shards", dataset, epoch)``: the shard order of one dataset's epoch (``headrace.dataio.stream.ordering.epoch_order``).
- ``("window", dataset, epoch, window)``: the in-window permutation of one shuffle window.
- ``("worker", dp_rank, worker, epoch)``: the per-(DP rank, worker, epoch) seed given to
  ``torch``/``numpy``/``random`` in a worker, for decoders that draw random numbers (augmentation).

The trainer's per-rank streams (torch's global RNG once the model is built, SpecAugment's generator) take
``rank_seed(base_seed, dp_rank)``: distinct per data-parallel rank, shared by a rank's TP/CP/PP peers (they must
draw the same numbers), one rule for every such stream.

The sample order depends on neither the DP rank nor the worker: it is a function of global position
only, which is what makes resume with a different ``dp_size`` or ``num_workers`` exact.

``seed: randomized`` draws the base seed once from the OS (``fresh_seed``); the loader logs it and
stores it in its state so that a resumed run continues the same stream.

Per-job reseeding (``SeedSchedule``): a chained job may bring a new seed (``Loader.reseed``). It applies
only to the epochs of each dataset that had not begun when the job resumed; every epoch already begun
keeps the seed it began with. An epoch's order is a permutation of that dataset's samples, so as long
as one epoch never mixes two seeds nothing within it repeats or is skipped. The blend needs no seed
(``headrace.dataio.stream.ordering.blend`` is closed-form), so the mixture is the same whatever the seeds.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np
import numpy.random  # noqa: F401  numpy imports it lazily: ~0.14 s paid at import, not by the first batch

PURPOSES = ("shards", "window", "worker")


def derive_seed(base_seed: int, purpose: str, *coords: int) -> int:
    """The 63-bit seed of stream ``purpose`` at integer coordinates ``coords`` under ``base_seed``."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown seed purpose {purpose!r} (known: {', '.join(PURPOSES)})")
    key = (PURPOSES.index(purpose), *(int(c) for c in coords))
    seq = np.random.SeedSequence(entropy=int(base_seed), spawn_key=key)
    return int(seq.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def rank_seed(base_seed: int, dp_rank: int) -> int:
    """The seed of a per-DP-rank random stream of the trainer: ``base_seed + 1,000,003 * dp_rank``. The large
    prime stride keeps rank r of seed s from repeating rank 0 of seed s + r (the flaw of ``base_seed + rank``)
    for any seeds less than 1,000,003 apart."""
    return base_seed + 1_000_003 * dp_rank


def rng(base_seed: int, purpose: str, *coords: int) -> np.random.Generator:
    """A numpy Generator seeded with ``derive_seed(base_seed, purpose, *coords)``."""
    return np.random.Generator(np.random.PCG64(derive_seed(base_seed, purpose, *coords)))


@dataclass
class SeedSchedule:
    """The base seed of each (dataset, epoch): ``base``, then each reseed ``(seed, first)`` from epoch
    ``first[dataset]`` on (reseeds are appended in time order, so their ``first`` never decrease)."""

    base: int
    reseeds: list[tuple[int, list[int]]] = field(default_factory=list)

    def at(self, dataset: int, epoch: int) -> int:
        seed = self.base
        for s, first in self.reseeds:
            if epoch >= first[dataset]:
                seed = s
        return seed

    @property
    def latest(self) -> int:
        """The newest seed (worker augmentation streams switch to it at once: they order nothing)."""
        return self.reseeds[-1][0] if self.reseeds else self.base


def fresh_seed() -> int:
    """A new random base seed (for ``seed: randomized``)."""
    return secrets.randbits(62)


__all__ = ["SeedSchedule", "derive_seed", "fresh_seed", "rank_seed", "rng"]
