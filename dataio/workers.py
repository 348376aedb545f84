"""Worker processes: torch's DataLoader running a stateless batch function, read back in order.

Worker ``w`` of ``num_workers`` computes batches ``first + w, first + w + num_workers, ...`` of the
rank's stream with ``make_batch(b)``; torch's DataLoader asks its workers round-robin and returns
results in request order, so the main process sees batches ``first, first + 1, ...`` whatever the
worker timing.

Transport: before the workers fork, the main process maps one shared-memory ring per worker of
``prefetch + 2`` slots. A worker collates each batch straight into its next slot (``allocate``, used
by ``dataio.collate``) and sends only ``(offset, shape, dtype)`` of each tensor; the main process
copies the tensor out of the slot (one memcpy, into pinned memory with ``pin_memory``) before the
DataLoader can hand that worker the task that reuses the slot (a worker holds at most ``prefetch``
unreturned tasks). Versus torch's default -- a new shared-memory file per tensor per batch, its file
descriptor passed over a socket and mapped again in the main process -- this costs one copy and no
system calls per batch; a batch too big for its slot falls back to that default path. Tensors of at
most 64 KB (lengths, references) travel by value in the pickle.

Why not torchdata's ``StatefulDataLoader``: it resumes by snapshotting each worker's iterator state
and needs the same worker count to restore it. Here a batch is a pure function of its number, so the
loader's state is the position the trainer has consumed; on resume the workers simply start at that
batch. Batches that were prefetched but not consumed are recomputed, never lost or repeated, and the
worker count may change freely. The plain DataLoader also gives the failure handling we want: a
worker that dies is reported by its watchdog ("worker (pid N) exited unexpectedly") and one that
hangs trips ``timeout`` (``worker_timeout``), both as errors in the main process.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dataio.seeding import derive_seed

SMALL_TENSOR_BYTES = 64 << 10
ALIGN = 64


class SharedRing:
    """``num_workers`` x ``slots`` reusable shared-memory slots of ``slot_bytes``, mapped before fork."""

    def __init__(self, num_workers: int, slots: int, slot_bytes: int):
        slot_bytes = -(-slot_bytes // ALIGN) * ALIGN  # every slot starts aligned for any dtype
        self.slots, self.slot_bytes = slots, slot_bytes
        self.buffer = torch.empty(num_workers * slots * slot_bytes, dtype=torch.uint8).share_memory_()
        self.base = self.buffer.untyped_storage().data_ptr()
        self._next = 0  # worker side: the slot of the next batch
        self._slot_start = self._used = 0

    def begin_batch(self, worker: int) -> None:
        """Worker side: start filling this worker's next slot."""
        self._slot_start = (worker * self.slots + self._next % self.slots) * self.slot_bytes
        self._next += 1
        self._used = 0

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor in the current slot, or None when the slot is full."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self._used // ALIGN) * ALIGN
        if start + nbytes > self.slot_bytes:
            return None
        self._used = start + nbytes
        offset = self._slot_start + start
        return self.buffer[offset : offset + nbytes].view(dtype).view(shape)

    def holds(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self.base


_active_ring: SharedRing | None = None  # set in a worker process while it makes a batch


def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Storage for a batch tensor: the worker's ring slot, else shared memory in a worker, else plain."""
    if _active_ring is not None:
        t = _active_ring.alloc(shape, dtype)
        if t is not None:
            return t
    t = torch.empty(shape, dtype=dtype)
    return t.share_memory_() if get_worker_info() is not None else t


class _Inline:
    """A small tensor travelling by value in the pickle."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array


class _InRing:
    """A tensor left in the shared ring: where it is, not its bytes."""

    __slots__ = ("offset", "shape", "dtype")

    def __init__(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.offset, self.shape, self.dtype = offset, shape, dtype


def _to_wire(value, ring: SharedRing | None):
    if isinstance(value, torch.Tensor):
        if ring is not None and ring.holds(value):
            return _InRing(value.data_ptr() - ring.base, tuple(value.shape), value.dtype)
        if value.nbytes <= SMALL_TENSOR_BYTES and not value.is_shared():
            return _Inline(value.numpy())
        return value
    if isinstance(value, dict):
        return {k: _to_wire(v, ring) for k, v in value.items()}
    return value


def _from_wire(value, ring: SharedRing | None, pin: bool):
    if isinstance(value, _Inline):
        return torch.from_numpy(value.array)
    if isinstance(value, _InRing):
        nbytes = math.prod(value.shape) * value.dtype.itemsize
        view = ring.buffer[value.offset : value.offset + nbytes].view(value.dtype).view(value.shape)
        return torch.empty(value.shape, dtype=value.dtype, pin_memory=pin).copy_(view)
    if isinstance(value, dict):
        return {k: _from_wire(v, ring, pin) for k, v in value.items()}
    return value


class RankBatches(IterableDataset):
    """Batches ``first .. last-1`` (``last=None``: endless) of one rank, split over DataLoader workers."""

    def __init__(self, make_batch: Callable[[int], dict], *, first: int, last: int | None, seed: int,
                 dp_rank: int, epoch: int):
        self.make_batch, self.first, self.last = make_batch, first, last
        self.seed, self.dp_rank, self.epoch = seed, dp_rank, epoch
        self.ring: SharedRing | None = None  # set by ``iterate`` before the workers fork

    def __iter__(self) -> Iterator[dict]:
        global _active_ring
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:  # augmentation randomness in decoders: one stream per (rank, worker, epoch)
            s = derive_seed(self.seed, "worker", self.dp_rank, worker, self.epoch)
            torch.manual_seed(s)
            np.random.seed(s % 2**32)
            random.seed(s)
        ring = self.ring if info is not None else None
        b = self.first + worker
        while self.last is None or b < self.last:
            if ring is None:
                yield self.make_batch(b)
            else:
                ring.begin_batch(worker)
                _active_ring = ring
                try:
                    batch = self.make_batch(b)
                finally:
                    _active_ring = None
                yield _to_wire(batch, ring)
            b += num_workers


def iterate(batches: RankBatches, *, num_workers: int, prefetch: int, pin_memory: bool, timeout: float,
            slot_bytes: int = 0) -> Iterator[dict]:
    """Batches in order, computed in this process (``num_workers=0``) or in worker processes that
    collate into shared slots of ``slot_bytes`` (0: torch's default transport only)."""
    if num_workers == 0:
        return iter(batches)
    pin = pin_memory and torch.cuda.is_available()
    ring = batches.ring = SharedRing(num_workers, prefetch + 2, slot_bytes) if slot_bytes > 0 else None
    loader = DataLoader(batches, batch_size=None, num_workers=num_workers, prefetch_factor=prefetch,
                        pin_memory=pin, timeout=timeout, persistent_workers=False)
    return (_from_wire(batch, ring, pin) for batch in loader)


__all__ = ["RankBatches", "SharedRing", "allocate", "iterate"]
