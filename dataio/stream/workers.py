"""Worker processes: a stateless batch function run in forked workers (``dataio.stream.pool``), read
back in order.

A worker's unit is a task of ``per_task`` consecutive batches (task ``t`` = batches ``first +
t*per_task ...``; worker ``w`` of ``num_workers`` makes tasks ``w, w + num_workers, ...``, each when
the main process asks for it), ``per_task`` chosen from the slot size so one message carries ~4 MB
(``batches_per_task``): small batches then pay the per-message cost (a pipe write and read, a pickle
of a few hundred bytes) once per task. The main process reads task ``t`` from worker ``t %
num_workers``, so it sees batches ``first, first + 1, ...`` whatever the worker timing.

Transport: before the workers fork, the main process maps one anonymous shared-memory ring per
worker of ``(prefetch + 3) * per_task`` slots (``mmap(-1)``: inherited by the forked workers, no
file, pages touched lazily, so creating it costs nothing). ``make_batch(b, alloc)`` receives the
allocator of the process it runs in (``SharedRing.allocate`` in a worker with a ring: a worker
collates each batch straight into a free slot; ``shared_memory`` in a worker without one;
``plain_memory`` in the main process) and the worker sends only ``(slot, offset, shape, dtype)`` of
each ring tensor. The main process hands out tensors that *are* views of the slot -- no copy -- all
sharing one per-batch storage; the slot goes back to its worker (a flag in shared memory) once
every tensor of that batch has been dropped, which the main process checks at each ``next()`` (the
storage's reference count: nothing per tensor). A consumer that keeps batches (``list(loader)``)
keeps their slots; once a worker finds none free it sends that batch by torch's handles (a
shared-memory file per tensor, its descriptor passed over a socket), so holding batches is always
safe, only slower. With ``pin_memory`` tensors are copied once into pinned memory instead and the
slot is released at once. Tensors of at most 64 KB (lengths, references) travel by value in the
pickle; nothing else touches the batch on the way (a worker's batch is what ``make_batch`` returned).

Start-up: the main process makes the first batch itself, then forks the workers, which start at the
second; so the first batch comes as fast as in one process and the workers inherit whatever it set up
lazily (see ``iterate``). Workers live for one pass over ``batches``: an endless stream forks them
once per run, a finite one once per epoch (fork, start and shut-down: ~10-20 ms of CPU on 2 cores).

Why not torchdata's ``StatefulDataLoader``: it resumes by snapshotting each worker's iterator state
and needs the same worker count to restore it. Here a batch is a pure function of its number, so the
loader's state is the position the trainer has consumed; on resume the workers simply start at that
batch. Batches that were prefetched but not consumed are recomputed, never lost or repeated, and the
worker count may change freely. Why not torch's plain DataLoader (used here before): its per-message
machinery (index and result ``multiprocessing.Queue``s with their feeder threads and locks, the
profiler hook around each ``next()``) cost more CPU than making a small batch; the pool keeps its
failure handling -- a dead worker, a hung one (``worker_timeout``), an exception in one: each an
error in the main process (see ``dataio.stream.pool``).
"""

from __future__ import annotations

import math
import mmap
import random
import sys
from typing import Callable, Iterator

import numpy as np
import torch

from dataio.stream.collate import Allocator, plain_memory
from dataio.stream.pool import WorkerPool, worker_info
from dataio.stream.seeding import derive_seed

SMALL_TENSOR_BYTES = 64 << 10
ALIGN = 64
SPARE_SLOTS = 3  # beyond prefetch: the task the consumer holds, the one before it, one of slack (x per_task)
TASK_BYTES = 4 << 20  # slot bytes (2x a batch's mean) per worker message, see batches_per_task
MAX_BATCHES_PER_TASK = 8


class SharedRing:
    """``num_workers`` x ``slots`` reusable shared-memory slots of ``slot_bytes``, mapped before fork.

    Worker side: ``begin_batch`` claims a free slot, ``alloc`` carves tensors out of it. Main side:
    ``receive`` turns a wire batch into tensors viewing its slot, ``release_dropped`` frees the slots
    of batches nobody references any more."""

    def __init__(self, num_workers: int, prefetch: int, slot_bytes: int):
        slot_bytes = -(-slot_bytes // ALIGN) * ALIGN  # every slot starts aligned for any dtype
        self.per_task = batches_per_task(slot_bytes)
        slots = (prefetch + SPARE_SLOTS) * self.per_task
        self.slots, self.slot_bytes = slots, slot_bytes
        self._map = mmap.mmap(-1, num_workers * slots * slot_bytes)  # MAP_SHARED | MAP_ANONYMOUS
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.buffer = torch.from_numpy(self.array)
        self.base = self.buffer.data_ptr()
        self._flags = mmap.mmap(-1, num_workers * slots)
        self.free = np.frombuffer(self._flags, dtype=np.uint8)  # 1: its worker may fill the slot
        self.free[:] = 1
        self._next = 0  # worker side: where to look for the next free slot
        self._slot: int | None = None
        self._slot_start = self._used = 0
        self._held: list[tuple[int, np.ndarray]] = []  # main side: (slot, the batch's storage owner)

    # -- worker side ---------------------------------------------------------------------------
    def begin_batch(self, worker: int) -> int | None:
        """Claim this worker's next free slot for a batch; None when the consumer holds them all."""
        self._slot = None
        for _ in range(self.slots):
            slot = worker * self.slots + self._next % self.slots
            self._next += 1
            if self.free[slot]:
                self.free[slot] = 0
                self._slot, self._slot_start, self._used = slot, slot * self.slot_bytes, 0
                break
        return self._slot

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor in the current slot, or None when there is none or it is full."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self._used // ALIGN) * ALIGN
        if self._slot is None or start + nbytes > self.slot_bytes:
            return None
        self._used = start + nbytes
        offset = self._slot_start + start
        return self.buffer[offset : offset + nbytes].view(dtype).view(shape)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The worker's allocator (``make_batch``'s ``alloc``): the current slot, else shared memory
        (the slot is full, or the consumer holds every slot)."""
        t = self.alloc(shape, dtype)
        return t if t is not None else shared_memory(shape, dtype)

    def holds(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self.base

    # -- main side -----------------------------------------------------------------------------
    def receive(self, slot: int | None, wire, pin: bool):
        """The batch of ``wire`` (filled into ``slot``): tensors viewing the slot, or pinned copies."""
        if slot is None:
            return _from_wire(wire, None, pin)
        start = slot * self.slot_bytes
        owner = self.array[start : start + self.slot_bytes]  # one object per batch: its refcount is the batch's
        batch = _from_wire(wire, torch.from_numpy(owner), pin, start)
        self._held.append((slot, owner))
        return batch

    def release_dropped(self) -> None:
        """Give back the slots of batches whose tensors are all gone (only ``_held`` refers to the owner)."""
        held = []
        for slot, owner in self._held:
            if sys.getrefcount(owner) > 3:  # _held's tuple, the loop variable, getrefcount's argument
                held.append((slot, owner))
            else:
                self.free[slot] = 1
        self._held = held


def batches_per_task(slot_bytes: int) -> int:
    """Batches a worker makes per request and sends in one message: enough for ~``TASK_BYTES``, so
    the fixed cost per message (a pipe write and read, a pickle, a poll: ~0.1 ms of CPU between
    the two processes; torch's DataLoader took ~0.4-1 ms, measured) is paid per few MB, not per small batch."""
    return max(1, min(MAX_BATCHES_PER_TASK, TASK_BYTES // max(slot_bytes, 1)))


def shared_memory(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor in torch's shared memory: sent from a worker by handle, not copied into it on the way."""
    return torch.empty(shape, dtype=dtype).share_memory_()


def process_memory() -> Allocator:
    """The allocator for a batch made without a ring: shared memory in a worker process, plain memory
    in the main process."""
    return shared_memory if worker_info() is not None else plain_memory


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
        if value.nbytes <= SMALL_TENSOR_BYTES:  # by value, even one in shared memory: cheaper than its handle
            return _Inline(value.numpy())
        return value
    if isinstance(value, dict):
        return {k: _to_wire(v, ring) for k, v in value.items()}
    return value


def _from_wire(value, slot: torch.Tensor | None, pin: bool, slot_start: int = 0):
    """Tensors back from the wire; ring tensors view ``slot`` (copied into pinned memory with ``pin``)."""
    if isinstance(value, _Inline):
        return torch.from_numpy(value.array)
    if isinstance(value, _InRing):
        start = value.offset - slot_start
        view = slot[start : start + math.prod(value.shape) * value.dtype.itemsize].view(value.dtype).view(value.shape)
        return torch.empty(value.shape, dtype=value.dtype, pin_memory=True).copy_(view) if pin else view
    if isinstance(value, torch.Tensor) and pin:
        return value.pin_memory()
    if isinstance(value, dict):
        return {k: _from_wire(v, slot, pin, slot_start) for k, v in value.items()}
    return value


class RankBatches:
    """Batches ``first .. last-1`` (``last=None``: endless) of one rank: made here (``iter``) or split
    over worker processes in tasks (``worker_tasks``)."""

    def __init__(self, make_batch: Callable[[int, Allocator], dict], *, first: int, last: int | None, seed: int,
                 dp_rank: int, epoch: int):
        self.make_batch, self.first, self.last = make_batch, first, last
        self.seed, self.dp_rank, self.epoch = seed, dp_rank, epoch
        self.ring: SharedRing | None = None  # set by ``iterate`` before the workers fork

    @property
    def per_task(self) -> int:
        return self.ring.per_task if self.ring is not None else 1

    def num_tasks(self) -> int | None:
        return None if self.last is None else max(0, -(-(self.last - self.first) // self.per_task))

    def __iter__(self) -> Iterator[dict]:
        for b in range(self.first, sys.maxsize if self.last is None else self.last):
            yield self.make_batch(b, plain_memory)

    def worker_seed(self, worker: int) -> int:
        """The seed of worker ``worker``'s augmentation randomness (decoders): one stream per (rank, worker, epoch)."""
        return derive_seed(self.seed, "worker", self.dp_rank, worker, self.epoch)

    def worker_tasks(self, worker: int, num_workers: int, seed: int) -> Iterator[list]:
        """Worker ``worker``'s tasks: batches ``first + t*per_task ...`` of tasks ``t = worker, worker +
        num_workers, ...``, each a list of ``(slot, wire batch)``; ``seed`` seeds the global generators."""
        torch.default_generator.manual_seed(seed)  # the CPU generator only: a forked worker cannot use CUDA
        np.random.seed(seed % 2**32)
        random.seed(seed)
        ring, per_task = self.ring, self.per_task
        b = self.first + worker * per_task
        while self.last is None or b < self.last:  # one task: batches b .. b + per_task - 1, sent together
            task = []
            for i in range(b, b + per_task if self.last is None else min(b + per_task, self.last)):
                if ring is None:
                    task.append((None, _to_wire(self.make_batch(i, shared_memory), None)))
                    continue
                slot = ring.begin_batch(worker)
                task.append((slot, _to_wire(self.make_batch(i, ring.allocate), ring)))
            yield task
            b += num_workers * per_task


def iterate(batches: RankBatches, *, num_workers: int, prefetch: int, pin_memory: bool, timeout: float,
            slot_bytes: int = 0, first_here: bool = True) -> Iterator[dict]:
    """Batches in order, computed in this process (``num_workers=0``) or in worker processes that
    collate into shared slots of ``slot_bytes`` (0: torch's default transport only).

    With workers and ``first_here``, this process makes the first batch itself before forking them
    (``batches.first`` moves on by one): the first batch comes as fast as without workers, and what
    the first batch initialises lazily (imports such as ``numpy.ma``, which ``np.unique`` pulls in on
    first use: ~20 ms of CPU per worker per epoch otherwise) is inherited instead of paid in every
    worker. That batch draws augmentation randomness from this process's generators, as without
    workers. Pass ``first_here=False`` when making a batch starts threads that must not be forked
    (a DALI pipeline)."""
    if num_workers == 0:
        return iter(batches)
    return _with_workers(batches, num_workers=num_workers, prefetch=prefetch, pin_memory=pin_memory,
                         timeout=timeout, slot_bytes=slot_bytes, first_here=first_here)


def _with_workers(batches: RankBatches, *, num_workers: int, prefetch: int, pin_memory: bool, timeout: float,
                  slot_bytes: int, first_here: bool) -> Iterator[dict]:
    first = None
    if first_here and (batches.last is None or batches.first < batches.last):
        first = batches.make_batch(batches.first, plain_memory)
        batches.first += 1
        if batches.last is not None and batches.first >= batches.last:  # it was the only one: no workers
            yield first
            return
    pin = pin_memory and torch.cuda.is_available()
    ring = batches.ring = SharedRing(num_workers, prefetch, slot_bytes) if slot_bytes > 0 else None
    seeds = [batches.worker_seed(w) for w in range(num_workers)]  # here: derive_seed may import numpy.random
    pool = WorkerPool(lambda w, n: batches.worker_tasks(w, n, seeds[w]), num_workers=num_workers, prefetch=prefetch, timeout=timeout,
                      num_tasks=batches.num_tasks())  # forks them now: they start while the consumer takes the first batch
    clean = False
    try:
        if first is not None:
            yield first
            del first  # not held by this frame while the consumer waits for the next one
        for task in pool.tasks():
            for slot, wire in task:
                if ring is not None:
                    ring.release_dropped()  # before the next batch: the consumer is done with what it dropped
                batch = ring.receive(slot, wire, pin) if ring is not None else _from_wire(wire, None, pin)
                if pin and ring is not None:
                    ring.release_dropped()  # copied out: the slot is free at once
                yield batch
                del batch  # not held by this frame while the consumer waits for the next one
            del task
        clean = True
    finally:  # also when the consumer stops early (GeneratorExit): busy workers are terminated
        pool.close(clean)


__all__ = ["RankBatches", "SharedRing", "batches_per_task", "iterate", "process_memory", "shared_memory"]
