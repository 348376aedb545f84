"""Device prefetch: the loader runs ahead in a thread; pinned, non-blocking copies on a side stream.

``DevicePrefetcher(batches, device)`` wraps any iterable of batches (nested dicts/lists/tuples of
tensors; other values pass through; keys starting with ``__`` -- ``__key__``, ``__docs__``, ... -- are
host-side bookkeeping and are never walked or moved). A background thread of the main process pulls
batches from the loader ``depth`` batches ahead, so the loader's main-process work (merging workers,
packing) overlaps the step instead of counting as data wait. On CUDA, additionally:

- that thread pins each batch, once, into page-locked memory (tensors the loader already pinned are
  kept); loader workers never pin, so there are no per-worker pinned copies;
- the main thread issues each copy with ``non_blocking=True`` on a dedicated CUDA stream, ``depth``
  batches ahead of the one the consumer is using, so the copy overlaps the previous step's compute;
- before handing a batch over, the consumer's stream ``wait_stream``s the copy stream (a GPU-side
  dependency, the host does not block), and every device tensor is ``record_stream``ed on the
  consumer's stream so the caching allocator does not reuse its memory while the step still reads it.

On CPU the batches are handed over as they are (no copy).

``transform`` (optional) maps each batch on the host, in the read-ahead thread, before pinning and the
copy: e.g. the trainer's context-parallel split keeps only this rank's tokens, so the rest never reach
the device.

Resumable sources: when ``batches`` has a ``state_dict()`` (the loader), the thread snapshots it right
after each pull and carries it beside its batch, so ``prefetcher.state_dict()`` is the state *as of the
last batch handed to the consumer* -- not of the batches still queued or in flight -- and a checkpoint
taken mid-run resumes exactly (the loader's state is a few hundred bytes plus the packer's references).

The *data wait* is the host time the consumer spent inside ``next()`` waiting for a batch, per batch and
in total, and as a fraction of the wall time since the first batch was asked for (``stats()``).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from headrace.dataio.stagetimes import add_time

_DONE = object()


def tree_map(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Apply ``fn`` to every tensor of a nested dict/list/tuple; other leaves, and dict entries whose key
    starts with ``__`` (host-side bookkeeping), are returned as they are."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: v if k.startswith("__") else tree_map(fn, v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(tree_map(fn, v) for v in batch)
    return batch


def pin(batch: Any) -> Any:
    """Page-locked copies of the batch's tensors (already pinned tensors are kept)."""
    return tree_map(lambda t: t if t.is_pinned() else t.pin_memory(), batch)


class DevicePrefetcher:
    """Iterate ``batches`` with their tensors on ``device``; see the module docstring."""

    def __init__(
        self,
        batches: Iterable,
        device: str | torch.device,
        *,
        depth: int = 1,
        transform: Callable[[Any], Any] | None = None,
    ):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"DevicePrefetcher supports cpu and cuda devices, got {self.device}")
        self.depth = depth
        self._transform = transform
        self.waits: list[float] = []
        self._source = iter(batches)
        self._source_state = getattr(batches, "state_dict", None)
        # Taken before the pinning thread starts, so it is exact until the first batch is delivered.
        self._delivered_state: Any = self._snapshot()
        self._started: float | None = None
        self._finished: float | None = None
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.Stream(device=self.device)
            self._in_flight: list[Any] = []
        self._ready: queue.Queue = queue.Queue(maxsize=depth + 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read_ahead, name="headrace-prefetch", daemon=True)
        # The first pull runs here, in the caller's thread: a loader forks its worker processes on its
        # first batch, and a fork is only safe from the thread that owns the process (torch's thread
        # pools, locks held elsewhere), not from the read-ahead thread while the step computes.
        if self._read_one():
            self._thread.start()

    # -- host side: loader (-> pinned memory on CUDA), in a thread of the main process -------------
    def _snapshot(self) -> Any:
        """The source's ``state_dict()`` now (None when it has none)."""
        return self._source_state() if self._source_state is not None else None

    def _pull(self) -> tuple[Any, Any]:
        """The next batch with the source's state just after it (same thread: consistent)."""
        batch = next(self._source)
        state = self._snapshot()
        return (self._transform(batch) if self._transform is not None else batch), state

    def _read_one(self) -> bool:
        """Queue the next batch; False once the stream ended or failed (both queued) or we are stopped."""
        try:
            batch, state = self._pull()
            if self._cuda:
                start = time.perf_counter()
                batch = pin(batch)
                if isinstance(batch, dict):
                    add_time(batch, "h2d", start)
            item = (batch, state)
        except StopIteration:
            self._put(_DONE)
            return False
        except BaseException as e:  # surfaces in the consumer's next()
            self._put(e)
            return False
        return self._put(item)

    def _read_ahead(self) -> None:
        while self._read_one():
            pass

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    # -- device side ------------------------------------------------------------------------------
    def _take(self) -> tuple[Any, Any] | None:
        """The next ``(batch, state)`` from the read-ahead thread; None at the end of the stream."""
        item = self._ready.get()
        if item is _DONE:
            self._ready.put(_DONE)  # keep the end visible to later calls
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def _issue_copy(self) -> bool:
        """Start the copy of the next pinned batch on the side stream; False at the end of the stream."""
        item = self._take()
        if item is None:
            return False
        batch, state = item
        start = time.perf_counter()
        with torch.cuda.stream(self._stream):
            batch = tree_map(lambda t: t.to(self.device, non_blocking=True), batch)
        if isinstance(batch, dict):
            add_time(batch, "h2d", start)  # issuing the copies (they run on the side stream)
        self._in_flight.append((batch, state))
        return True

    def _next_cuda(self) -> Any:
        while len(self._in_flight) < self.depth + 1 and self._issue_copy():
            pass
        if not self._in_flight:
            raise StopIteration
        batch, self._delivered_state = self._in_flight.pop(0)
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_stream(self._stream)

        def hand_over(t: torch.Tensor) -> torch.Tensor:
            t.record_stream(consumer)
            return t

        return tree_map(hand_over, batch)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        if self._started is None:
            self._started = start
        try:
            if self._cuda:
                batch = self._next_cuda()
            else:
                item = self._take()
                if item is None:
                    raise StopIteration
                batch, self._delivered_state = item
        except StopIteration:
            self._finished = time.perf_counter()
            self.close()
            raise
        now = time.perf_counter()
        self.waits.append(now - start)
        self._finished = now
        return batch

    def state_dict(self) -> Any:
        """The source's ``state_dict()`` as of the last batch handed to the consumer (None when the
        source has no state)."""
        return self._delivered_state

    def stats(self) -> dict:
        """``batches``, ``wait_s`` (total data wait), ``elapsed_s`` (since the first request) and
        ``wait_fraction`` = wait_s / elapsed_s."""
        elapsed = (self._finished - self._started) if self._started is not None else 0.0
        wait = sum(self.waits)
        return {
            "batches": len(self.waits),
            "wait_s": wait,
            "elapsed_s": elapsed,
            "wait_fraction": wait / elapsed if elapsed > 0 else 0.0,
        }

    def close(self) -> None:
        """Stop the read-ahead thread (also called at the end of the stream)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


__all__ = ["DevicePrefetcher", "pin", "tree_map"]
