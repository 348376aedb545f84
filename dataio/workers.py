"""Worker processes: torch's DataLoader running a stateless batch function, read back in order.

Worker ``w`` of ``num_workers`` computes batches ``first + w, first + w + num_workers, ...`` of the
rank's stream with ``make_batch(b)``; torch's DataLoader asks its workers round-robin and returns
results in request order, so the main process sees batches ``first, first + 1, ...`` whatever the
worker timing. Batches cross the process boundary as shared-memory tensors (``dataio.collate``
allocates them there); tensors of at most 64 KB (keys' bookkeeping, lengths) travel by value instead,
which is cheaper than a shared-memory file each. The main process pins batches once if ``pin_memory``.

Why not torchdata's ``StatefulDataLoader``: it resumes by snapshotting each worker's iterator state
and needs the same worker count to restore it. Here a batch is a pure function of its number, so the
loader's state is the position the trainer has consumed; on resume the workers simply start at that
batch. Batches that were prefetched but not consumed are recomputed, never lost or repeated, and the
worker count may change freely. The plain DataLoader also gives the failure handling we want: a
worker that dies is reported by its watchdog ("worker (pid N) exited unexpectedly") and one that
hangs trips ``timeout`` (``worker_timeout``), both as errors in the main process.
"""

from __future__ import annotations

import random
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dataio.seeding import derive_seed


SMALL_TENSOR_BYTES = 64 << 10


class _Inline:
    """A small tensor travelling by value: pickling a few KB is cheaper than a shared-memory file and
    a file descriptor per tensor, which is what torch's queue does for every tensor otherwise."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array


def _to_wire(value):
    if isinstance(value, torch.Tensor) and value.nbytes <= SMALL_TENSOR_BYTES and not value.is_shared():
        return _Inline(value.numpy())
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def _from_wire(value):
    if isinstance(value, _Inline):
        return torch.from_numpy(value.array)
    if isinstance(value, dict):
        return {k: _from_wire(v) for k, v in value.items()}
    return value


class RankBatches(IterableDataset):
    """Batches ``first .. last-1`` (``last=None``: endless) of one rank, split over DataLoader workers."""

    def __init__(self, make_batch: Callable[[int], dict], *, first: int, last: int | None, seed: int,
                 dp_rank: int, epoch: int):
        self.make_batch, self.first, self.last = make_batch, first, last
        self.seed, self.dp_rank, self.epoch = seed, dp_rank, epoch

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:  # augmentation randomness in decoders: one stream per (rank, worker, epoch)
            s = derive_seed(self.seed, "worker", self.dp_rank, worker, self.epoch)
            torch.manual_seed(s)
            np.random.seed(s % 2**32)
            random.seed(s)
        b = self.first + worker
        while self.last is None or b < self.last:
            batch = self.make_batch(b)
            yield _to_wire(batch) if info is not None else batch
            b += num_workers


def iterate(batches: RankBatches, *, num_workers: int, prefetch: int, pin_memory: bool,
            timeout: float) -> Iterator[dict]:
    """Batches in order, computed in this process (``num_workers=0``) or in worker processes."""
    if num_workers == 0:
        return iter(batches)
    loader = DataLoader(batches, batch_size=None, num_workers=num_workers, prefetch_factor=prefetch,
                        pin_memory=pin_memory and torch.cuda.is_available(), timeout=timeout,
                        persistent_workers=False)
    return map(_from_wire, loader)


__all__ = ["RankBatches", "iterate"]
