"""Every random stream of the data path, derived from one base seed by one function.

``derive_seed(base_seed, purpose, *coords)`` feeds the base seed as entropy and ``(purpose, *coords)``
as the spawn key of a ``numpy.random.SeedSequence``: streams for different coordinates are
statistically independent (SeedSequence hashes them, unlike ``base_seed + rank`` which makes rank 1 of
run 0 equal rank 0 of run 1), cost about 10 microseconds, and need no state. The coordinates used in
the data path:

- ``("shards", dataset, epoch)``: the shard order of one dataset's epoch (``dataio.stream.order``).
- ``("window", dataset, epoch, window)``: the in-window permutation of one shuffle window.
- ``("worker", dp_rank, worker, epoch)``: the per-(DP rank, worker, epoch) seed given to
  ``torch``/``numpy``/``random`` in a worker, for decoders that draw random numbers (augmentation).

The sample order depends on neither the DP rank nor the worker: it is a function of global position
only, which is what makes resume with a different ``dp_size`` or ``num_workers`` exact.

``seed: randomized`` draws the base seed once from the OS (``fresh_seed``); the loader logs it and
stores it in its state so that a resumed run continues the same stream.
"""

from __future__ import annotations

import secrets

import numpy as np

PURPOSES = ("shards", "window", "worker")


def derive_seed(base_seed: int, purpose: str, *coords: int) -> int:
    """The 63-bit seed of stream ``purpose`` at integer coordinates ``coords`` under ``base_seed``."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown seed purpose {purpose!r} (known: {', '.join(PURPOSES)})")
    key = (PURPOSES.index(purpose), *(int(c) for c in coords))
    seq = np.random.SeedSequence(entropy=int(base_seed), spawn_key=key)
    return int(seq.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def rng(base_seed: int, purpose: str, *coords: int) -> np.random.Generator:
    """A numpy Generator seeded with ``derive_seed(base_seed, purpose, *coords)``."""
    return np.random.Generator(np.random.PCG64(derive_seed(base_seed, purpose, *coords)))


def fresh_seed() -> int:
    """A new random base seed (for ``seed: randomized``)."""
    return secrets.randbits(62)


__all__ = ["derive_seed", "fresh_seed", "rng"]
