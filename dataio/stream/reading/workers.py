"""Worker processes: a stateless batch function run in forked workers (``headrace.dataio.stream.reading.pool``), read
back in order.

A worker's unit is a task of ``per_task`` consecutive batches (task ``t`` = batches ``first +
t*per_task ...``; worker ``w`` of ``num_workers`` makes tasks ``w, w + num_workers, ...``, each when
the main process asks for it), ``per_task`` chosen from the nominal batch bytes so one message carries
~4 MB (``batches_per_task``): small batches then pay the per-message cost (a pipe write and read, a
pickle of a few hundred bytes) once per task. Where the batch function can make a whole task at once
(``make_task``: token batches, ``headrace.dataio.stream.reading.batches.BatchMaker.task``, one gather for the
task's samples) the worker does, so the per-batch fixed cost too is paid once per task, and the task's
batches share one piece of the ring (given back once all of them are dropped). The main process reads
task ``t`` from worker ``t % num_workers``, so it sees batches ``first, first + 1, ...`` whatever the
worker timing.

Transport: before the workers fork, the main process maps one anonymous shared-memory ring per worker
(``SharedRing``: ``mmap(-1)``, inherited by the forked workers, no file, pages touched lazily, so
creating it costs nothing). ``make_batch(b, alloc)`` receives the allocator of the process it runs in
(``SharedRing.allocate`` in a worker with a ring: a worker collates each batch straight into free
bytes of its ring; ``shared_memory`` in a worker without one; ``plain_memory`` in the main process)
and the worker sends, per ring tensor, only where it is. The main process hands out tensors that
*are* views of the ring -- no copy, one ``torch.frombuffer`` each -- each holding a reference to one
object per piece of the ring (a numpy view of its bytes); the piece goes back to its worker (a flag in
shared memory) once every tensor of it has been dropped, which the main process checks at each
``next()`` (that object's reference count: nothing per tensor). A consumer that keeps batches
(``list(loader)``) keeps their bytes; once a worker finds no room it sends that batch by torch's
handles (a shared-memory file per tensor, its descriptor passed over a socket), so holding batches is
always safe, only slower. With ``pin_memory`` tensors are copied once into pinned memory instead and
the bytes are released at once. Other tensors of at most 64 KB (lengths, references) travel by value,
as raw bytes in the pickle; nothing else touches the batch on the way (a worker's batch is what
``make_batch`` returned). The transport adds only built-in types to the pickle (``_to_wire``).

Start-up: the main process makes the first batch itself, then forks the workers, which start at the
second; so the first batch comes as fast as in one process and the workers inherit whatever it set up
lazily (see ``iterate``); ``gc.freeze()`` around the fork keeps the workers' garbage collections off
the inherited objects (copy-on-write of the whole heap otherwise). Workers live for one pass over
``batches``: an endless stream forks them once per run, a finite one once per epoch (fork, start and
shut-down: ~10-20 ms of CPU on 2 cores).

Why not torchdata's ``StatefulDataLoader``: it resumes by snapshotting each worker's iterator state
and needs the same worker count to restore it. Here a batch is a pure function of its number, so the
loader's state is the position the trainer has consumed; on resume the workers simply start at that
batch. Batches that were prefetched but not consumed are recomputed, never lost or repeated, and the
worker count may change freely. Why not torch's plain DataLoader (used here before): its per-message
machinery (index and result ``multiprocessing.Queue``s with their feeder threads and locks, the
profiler hook around each ``next()``) cost more CPU than making a small batch; the pool keeps its
failure handling -- a dead worker, a hung one (``worker_timeout``), an exception in one: each an
error in the main process (see ``headrace.dataio.stream.reading.pool``).
"""

from __future__ import annotations

import gc
import math
import mmap
import random
import sys
from typing import Callable, Iterator

import numpy as np
import torch

from headrace.dataio.stream.reading.collate import Allocator, plain_memory
from headrace.dataio.stream.reading.pool import WorkerPool, worker_info
from headrace.dataio.stream.ordering.seeding import derive_seed

SMALL_TENSOR_BYTES = 64 << 10
ALIGN = 64
SPARE_BATCHES = 3  # beyond prefetch: the task the consumer holds, the one before it, one of slack (x per_task)
TASK_BYTES = 4 << 20  # ring bytes (2x a batch's mean) per worker message, see batches_per_task
MAX_BATCHES_PER_TASK = 8
SLACK_BYTES = 64 << 10  # room a batch's first tensor leaves for the small ones after it
TICKETS_PER_BATCH = 4  # a worker's batches out at once, at most, per batch of its ring's nominal size
# dtypes of ring and inline tensors travel as an index into this tuple (a pickled torch.dtype is a Python call)
DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
    torch.complex64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)
DTYPE_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}


RECYCLE_BYTES = 1 << 20  # tensors from this size up are carved from recycled buffers in one process
RECYCLED_BUFFERS = 4  # buffers a one-process iterator keeps for reuse (each as large as a batch's tensor)


class RecycledMemory:
    """The allocator of batches made in this process (``RankBatches.here``): a tensor of at least
    ``RECYCLE_BYTES`` is a view of a buffer the consumer has dropped, when one is large enough, instead of
    fresh memory. Fresh memory of a batch's size comes from ``mmap`` (glibc's threshold follows the last
    freed size, and batch sizes vary), so each batch would otherwise fault in every page it writes:
    ~0.25 us a 4 KB page, ~1 us a 13 KB document. A buffer is free when nothing but this object refers to
    it (its tensors and their views hold a reference to it, as ``SharedRing``'s pieces do); a consumer
    that keeps batches keeps their buffers, and at most ``RECYCLED_BUFFERS`` are tracked (beyond them,
    plain memory). Memory: at most that many batch tensors beyond what the consumer holds."""

    def __init__(self):
        self._buffers: list[np.ndarray] = []

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < RECYCLE_BYTES:
            return plain_memory(shape, dtype)
        buffer = next(
            (b for b in self._buffers if sys.getrefcount(b) <= 3 and nbytes <= b.nbytes <= 2 * nbytes), None
        )  # references: the list, the generator's variable, getrefcount's argument
        if buffer is None:
            if len(self._buffers) >= RECYCLED_BUFFERS:
                free = [i for i in range(len(self._buffers)) if sys.getrefcount(self._buffers[i]) <= 2]
                if not free:
                    return plain_memory(shape, dtype)
                del self._buffers[free[0]]  # too small or too large for this size: make room
            buffer = np.empty(nbytes + nbytes // 4, dtype=np.uint8)  # slack: the next batch may be longer
            self._buffers.append(buffer)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class SharedRing:
    """One ring of ``region`` bytes per worker in one anonymous shared map, mapped before fork.

    A worker carves each batch's tensors out of free bytes of its ring: the lowest gap between the
    batches still out that holds its first tensor with some slack (else the largest that holds it), so a batch takes the bytes it needs -- a long-tailed batch several times the mean fits as
    long as the ring has the room (fixed slots of twice the mean sent ~10 % of 32-document batches the
    slow way) -- and a consumer that keeps up reuses the same few warm pages (the first touch of a page
    is a page fault in each worker: ~3.7 us here, ~10 ms per 10 MB of ring). Each batch (or task made
    at once: one piece of the ring) holds a *ticket* (a byte of shared flags): the main process sets it
    once every tensor of the piece has been dropped, in whatever order, and the worker then counts the
    piece's bytes as free again.

    Worker side: ``begin_batch`` takes a ticket, ``alloc`` carves tensors, ``finish_batch`` says which
    bytes the piece holds (``cancel_batch``: none). Main side: ``receive`` turns a piece's wire batches
    into tensors viewing its bytes, ``release_dropped`` gives back the tickets of pieces nobody
    references any more."""

    def __init__(self, num_workers: int, prefetch: int, batch_bytes: int):
        self.per_task = batches_per_task(batch_bytes)
        batches = (prefetch + SPARE_BATCHES) * self.per_task
        self.region = batches * (-(-batch_bytes // ALIGN) * ALIGN)
        self.tickets = TICKETS_PER_BATCH * batches
        self._map = mmap.mmap(-1, num_workers * self.region)  # MAP_SHARED | MAP_ANONYMOUS: pages touched lazily
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.buffer = torch.from_numpy(self.array)
        self.base = self.buffer.data_ptr()
        self.end = self.base + len(self.array)
        self._flags = mmap.mmap(-1, num_workers * self.tickets)
        self.released = np.frombuffer(self._flags, dtype=np.uint8)  # 1: the main process is done with the batch
        self.released[:] = 1
        # worker side
        self._out: dict[int, tuple[int, int]] = {}  # ticket -> (first byte, end) of a batch out, in the region
        self._spare = list(range(self.tickets))  # tickets not out
        self._worker = 0
        self._ticket: int | None = None
        self._start = self._used = self._limit = 0  # the current batch: its first byte, next free byte, bound
        self._held: list[tuple[int, np.ndarray]] = []  # main side: (ticket, the batch's storage owner)

    # -- worker side ---------------------------------------------------------------------------
    def begin_batch(self, worker: int) -> None:
        """Take a ticket for the next batch (none while the consumer holds ``tickets`` of this worker's
        batches: its tensors then go by torch's handles) after taking back what the consumer released."""
        self._worker, self._ticket = worker, None
        first = worker * self.tickets
        for ticket in [t for t in self._out if self.released[first + t]]:
            del self._out[ticket]
            self._spare.append(ticket)
        if self._spare:
            self._ticket = self._spare.pop()
            self.released[first + self._ticket] = 0
            self._limit = -1  # the first tensor picks the gap

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor in the current batch's bytes, or None when there is no ticket or no room."""
        if self._ticket is None:
            return None
        nbytes = math.prod(shape) * dtype.itemsize
        if self._limit < 0:
            gap = self._gap(nbytes)
            if gap is None:
                return None
            self._start = self._used = gap[0]
            self._limit = gap[1]
        start = -(-self._used // ALIGN) * ALIGN
        if start + nbytes > self._limit:
            return None
        self._used = start + nbytes
        offset = self._worker * self.region + start
        return self.buffer[offset : offset + nbytes].view(dtype).view(shape)

    def _gap(self, nbytes: int) -> tuple[int, int] | None:
        """The lowest free range between the batches out that holds ``nbytes`` and ``SLACK_BYTES`` more
        (a batch's small tensors after its first one), else the largest that holds ``nbytes``. Asking
        for more (say a nominal batch) would skip the gap a released batch of the mean size leaves and
        walk the whole ring: every page of it resident in every worker."""
        gaps, at = [], 0
        for start, end in sorted(self._out.values()):
            if start > at:
                gaps.append((at, start))
            at = max(at, end)
        gaps.append((at, self.region))
        for lo, hi in gaps:
            if hi - lo >= nbytes + SLACK_BYTES:
                return lo, hi
        lo, hi = max(gaps, key=lambda g: g[1] - g[0])
        return (lo, hi) if hi - lo >= nbytes else None

    def finish_batch(self) -> tuple[int, int, int] | None:
        """``(ticket, first byte, end)`` of the batch's bytes in the map, or None if it took none (its
        ticket goes straight back)."""
        ticket, self._ticket = self._ticket, None
        if ticket is None:
            return None
        first = self._worker * self.tickets
        if self._limit < 0:
            self.released[first + ticket] = 1
            self._spare.append(ticket)
            return None
        self._out[ticket] = (self._start, -(-self._used // ALIGN) * ALIGN)
        base = self._worker * self.region
        return first + ticket, base + self._start, base + self._used

    def cancel_batch(self) -> None:
        """End the current batch unsent: whatever it took is free again at the next ``begin_batch``."""
        held = self.finish_batch()
        if held is not None:
            self.released[held[0]] = 1

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The worker's allocator (``make_batch``'s ``alloc``): the batch's ring bytes, else shared memory
        (no room, or the consumer holds every ticket)."""
        t = self.alloc(shape, dtype)
        return t if t is not None else shared_memory(shape, dtype)

    def holds(self, t: torch.Tensor) -> bool:
        return self.base <= t.data_ptr() < self.end

    # -- main side -----------------------------------------------------------------------------
    def receive(self, held: tuple[int, int, int] | None, wires: list, pin: bool) -> list[dict]:
        """The batches of ``wires`` whose ring bytes are ``held``: tensors viewing them, or pinned copies."""
        if held is None:
            return [_from_wire(wire, None, pin) for wire in wires]
        ticket, start, end = held
        owner = self.array[start:end]  # one object per piece: each of its tensors holds a reference
        batches = [_from_wire(wire, owner, pin, start) for wire in wires]
        self._held.append((ticket, owner))
        return batches

    def release_dropped(self) -> None:
        """Give back the tickets of batches whose tensors are all gone (only ``_held`` refers to the owner)."""
        held = []
        for ticket, owner in self._held:
            if sys.getrefcount(owner) > 3:  # _held's tuple, the loop variable, getrefcount's argument
                held.append((ticket, owner))
            else:
                self.released[ticket] = 1
        self._held = held


def batches_per_task(batch_bytes: int) -> int:
    """Batches a worker makes per request and sends in one message: enough for ~``TASK_BYTES``, so
    the fixed cost per message (a pipe write and read, a pickle, a poll: ~0.1 ms of CPU between
    the two processes; torch's DataLoader took ~0.4-1 ms, measured) is paid per few MB, not per small batch."""
    return max(1, min(MAX_BATCHES_PER_TASK, TASK_BYTES // max(batch_bytes, 1)))


def shared_memory(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor in torch's shared memory: sent from a worker by handle, not copied into it on the way."""
    return torch.empty(shape, dtype=dtype).share_memory_()


def process_memory() -> Allocator:
    """The allocator for a batch made without a ring: shared memory in a worker process, plain memory
    in the main process."""
    return shared_memory if worker_info() is not None else plain_memory


def _to_wire(batch: dict, ring: SharedRing | None) -> tuple[dict, list, list]:
    """``(rest, in_ring, inline)``: the batch without its ring tensors (``(path, offset, shape, dtype
    code)`` each) and its other tensors of at most 64 KB (``(path, bytes, shape, dtype code)``: by value,
    cheaper than a handle); what is left is pickled as it is (a bigger tensor outside the ring, or one of
    a dtype not in ``DTYPES``: by torch's handle). Only built-in types go into the pickle: a pickled
    wrapper object, torch.dtype or numpy array costs a Python call each way (~30 us a batch for
    wrappers; ~8 us to unpickle a small array against ~2.5 us for ``torch.frombuffer`` of its bytes,
    measured)."""
    in_ring, inline = [], []

    def strip(d: dict, path: tuple) -> dict:
        rest = {}
        for k, v in d.items():
            if isinstance(v, torch.Tensor) and v.dtype in DTYPE_CODE:
                if ring is not None and ring.holds(v):
                    if v.is_contiguous():
                        in_ring.append(((*path, k), v.data_ptr() - ring.base, tuple(v.shape), DTYPE_CODE[v.dtype]))
                        continue
                    v = v.contiguous()  # a strided view of the ring: a copy of its own goes, by value or handle
                if v.nbytes <= SMALL_TENSOR_BYTES:
                    # (an empty tensor may carry a stride that no byte view takes)
                    raw = bytearray(v.contiguous().reshape(-1).view(torch.uint8).numpy()) if v.numel() else bytearray()
                    inline.append(((*path, k), raw, tuple(v.shape), DTYPE_CODE[v.dtype]))
                    continue
            elif isinstance(v, dict):
                v = strip(v, (*path, k))
            rest[k] = v
        return rest

    return strip(batch, ()), in_ring, inline


def _from_wire(wire: tuple[dict, list, list], owner: np.ndarray | None, pin: bool, owner_start: int = 0) -> dict:
    """The batch back from ``_to_wire``'s parts: one ``torch.frombuffer`` a tensor, of ``owner`` (the
    batch's ring bytes, which start at ``owner_start`` of the map; each such tensor holds a reference to
    ``owner``) or of its own bytes; copied into pinned memory with ``pin``."""
    batch, in_ring, inline = wire
    for path, offset, shape, code in in_ring:
        _put(batch, path, _tensor(owner, offset - owner_start, shape, DTYPES[code], pin))
    for path, raw, shape, code in inline:
        _put(batch, path, _tensor(raw, 0, shape, DTYPES[code], pin))
    return _pinned(batch) if pin else batch


def _tensor(buffer, offset: int, shape: tuple, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """The ``shape`` tensor at ``offset`` of ``buffer`` (sharing its memory), or its copy in pinned memory."""
    count = math.prod(shape)
    t = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset) if count else torch.empty(shape, dtype=dtype)
    if len(shape) != 1:
        t = t.view(shape)
    return torch.empty(shape, dtype=dtype, pin_memory=True).copy_(t) if pin else t


def _put(batch: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        batch = batch[k]
    batch[path[-1]] = value


def _pinned(value):
    """Tensors sent by handle, copied into pinned memory."""
    if isinstance(value, torch.Tensor) and not value.is_pinned():
        return value.pin_memory()
    if isinstance(value, dict):
        return {k: _pinned(v) for k, v in value.items()}
    return value


class RankBatches:
    """Batches ``first .. last-1`` (``last=None``: endless) of one rank: made here (``iter``) or split
    over worker processes in tasks (``worker_tasks``)."""

    def __init__(
        self,
        make_batch: Callable[[int, Allocator], dict],
        *,
        first: int,
        last: int | None,
        seed: int,
        dp_rank: int,
        epoch: int,
        make_task: Callable[[int, int, Allocator], list[dict] | None] | None = None,
    ):
        self.make_batch, self.first, self.last = make_batch, first, last
        self.make_task = make_task  # (first, count, alloc) -> those batches made at once, or None: one by one
        self.seed, self.dp_rank, self.epoch = seed, dp_rank, epoch
        self.ring: SharedRing | None = None  # set by ``iterate`` before the workers fork

    @property
    def per_task(self) -> int:
        return self.ring.per_task if self.ring is not None else 1

    def num_tasks(self) -> int | None:
        return None if self.last is None else max(0, -(-(self.last - self.first) // self.per_task))

    def __iter__(self) -> Iterator[dict]:
        return self.here(1)

    def here(self, per_task: int) -> Iterator[dict]:
        """The batches made in this process, ``per_task`` at a time by one ``make_task`` where it applies
        (token batches: the per-batch fixed cost -- lookups, shard checks, allocation -- paid once a task;
        each batch's tensors are views of the task's), else one by one."""
        b, alloc = self.first, RecycledMemory()
        while self.last is None or b < self.last:
            count = per_task if self.last is None else min(per_task, self.last - b)
            made = self.make_task(b, count, alloc) if count > 1 and self.make_task is not None else None
            if made is None:
                for i in range(b, b + count):
                    yield self.make_batch(i, alloc)
            else:
                made.reverse()
                while made:  # popped: a batch the consumer dropped is not held here
                    yield made.pop()
            b += count

    def worker_seed(self, worker: int) -> int:
        """The seed of worker ``worker``'s augmentation randomness (decoders): one stream per (rank, worker, epoch)."""
        return derive_seed(self.seed, "worker", self.dp_rank, worker, self.epoch)

    def worker_tasks(self, worker: int, num_workers: int) -> Iterator[list]:
        """Worker ``worker``'s tasks: batches ``first + t*per_task ...`` of tasks ``t = worker, worker +
        num_workers, ...``, each a list of ``(ring bytes held, [wire batch, ...])``: the whole task in one
        piece of the ring where ``make_task`` makes it at once, else one piece a batch. The global
        generators are seeded with ``worker_seed`` first."""
        seed = self.worker_seed(worker)
        torch.default_generator.manual_seed(seed)  # the CPU generator only: a forked worker cannot use CUDA
        np.random.seed(seed % 2**32)
        random.seed(seed)
        ring, per_task = self.ring, self.per_task
        b = self.first + worker * per_task
        while self.last is None or b < self.last:  # one task: batches b .. b + per_task - 1, sent together
            batches = range(b, b + per_task if self.last is None else min(b + per_task, self.last))
            task = None
            if ring is not None and self.make_task is not None and len(batches) > 1:
                ring.begin_batch(worker)
                made = self.make_task(batches.start, len(batches), ring.allocate)
                if made is None:
                    ring.cancel_batch()
                else:
                    wires = [_to_wire(batch, ring) for batch in made]
                    task = [(ring.finish_batch(), wires)]
            if task is None:
                task = [self._one(i, ring, worker) for i in batches]
            yield task
            b += num_workers * per_task

    def _one(self, b: int, ring: SharedRing | None, worker: int) -> tuple[tuple[int, int, int] | None, list]:
        """Batch ``b`` as one piece of a task: its ring bytes and its wire."""
        if ring is None:
            return None, [_to_wire(self.make_batch(b, shared_memory), None)]
        ring.begin_batch(worker)
        wire = _to_wire(self.make_batch(b, ring.allocate), ring)
        return ring.finish_batch(), [wire]


def iterate(
    batches: RankBatches,
    *,
    num_workers: int,
    prefetch: int,
    pin_memory: bool,
    timeout: float,
    batch_bytes: int = 0,
    first_here: bool = True,
    per_task_here: int = 1,
) -> Iterator[dict]:
    """Batches in order, computed in this process (``num_workers=0``) or in worker processes that
    collate into shared rings sized for batches of ``batch_bytes`` (0: torch's default transport only).

    With workers and ``first_here``, this process makes the first batch itself before forking them
    (``batches.first`` moves on by one): the first batch comes as fast as without workers, and what
    the first batch initialises lazily (imports such as ``numpy.ma``, which ``np.unique`` pulls in on
    first use: ~20 ms of CPU per worker per epoch otherwise) is inherited instead of paid in every
    worker. That batch draws augmentation randomness from this process's generators, as without
    workers. Pass ``first_here=False`` when making a batch starts threads that must not be forked
    (a DALI pipeline). Without workers, ``per_task_here`` batches are made at a time
    (``RankBatches.here``)."""
    if num_workers == 0:
        return batches.here(per_task_here)
    return _with_workers(
        batches,
        num_workers=num_workers,
        prefetch=prefetch,
        pin_memory=pin_memory,
        timeout=timeout,
        batch_bytes=batch_bytes,
        first_here=first_here,
    )


def _with_workers(
    batches: RankBatches,
    *,
    num_workers: int,
    prefetch: int,
    pin_memory: bool,
    timeout: float,
    batch_bytes: int,
    first_here: bool,
) -> Iterator[dict]:
    first = None
    if first_here and (batches.last is None or batches.first < batches.last):
        first = batches.make_batch(batches.first, plain_memory)
        batches.first += 1
        if batches.last is not None and batches.first >= batches.last:  # it was the only one: no workers
            yield first
            return
    pin = pin_memory and torch.cuda.is_available()
    ring = batches.ring = SharedRing(num_workers, prefetch, batch_bytes) if batch_bytes > 0 else None
    # Frozen objects are outside every collection: a worker's first full collection would otherwise write
    # to the header of each object it inherited, copying (on write) nearly every page of this process's
    # heap -- ~10k page faults, ~0.1-0.4 s of CPU per worker per epoch here (Python's gc docs advise it).
    gc.freeze()
    try:
        pool = WorkerPool(
            batches.worker_tasks,
            num_workers=num_workers,
            prefetch=prefetch,
            timeout=timeout,
            num_tasks=batches.num_tasks(),
        )  # forks them: they start while the consumer takes the first batch
    finally:
        gc.unfreeze()  # here; the workers keep theirs frozen
    clean = False
    try:
        if first is not None:
            yield first
            del first  # not held by this frame while the consumer waits for the next one
        for task in pool.tasks():
            for held, wires in task:
                if ring is not None:
                    ring.release_dropped()  # before the next piece: the consumer is done with what it dropped
                piece = (
                    ring.receive(held, wires, pin) if ring is not None else [_from_wire(w, None, pin) for w in wires]
                )
                if pin and ring is not None:
                    ring.release_dropped()  # copied out: its bytes are free at once
                piece.reverse()
                while piece:
                    batch = piece.pop()
                    yield batch
                    del batch  # not held by this frame while the consumer waits for the next one
            del task
        clean = True
    finally:  # also when the consumer stops early (GeneratorExit): busy workers are terminated
        pool.close(clean)


__all__ = ["RankBatches", "SharedRing", "batches_per_task", "iterate", "process_memory", "shared_memory"]
