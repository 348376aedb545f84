"""Timing one loader run as the trainer sees it: throughput, latency, memory and CPU of all its processes.

``measure(open_batches, count, ...)`` calls ``open_batches()`` (which builds the loader and returns its
iterator; worker processes start here or on the first ``next``) and pulls batches until the loader
ends or a limit (samples, batches, seconds) is reached. Per batch it times the ``next()`` call:

- ``first_batch_s``: from ``open_batches()`` to the first batch (start-up: index load, worker spawn);
- ``samples_per_s`` / ``units_per_s``: after the first batch, so start-up is reported once, separately,
  instead of diluting short runs;
- ``latency_p50_ms`` / ``latency_p99_ms``: of the ``next()`` calls after the first;
- ``main_cpu_us_per_batch``: CPU time of this (the training) process per batch after the first, all its
  threads but the sampler's own (``time.process_time`` less the sampler thread's ``time.thread_time``):
  what worker processes exist to take off the trainer;
- ``stage_fractions``: headrace's batches carry the seconds each loader stage spent on them
  (``headrace.dataio.stagetimes``): read / decode / pack / collate / h2d, summed over the batches after the
  first, over the wall time after the first batch (None for a loader whose batches carry none);
- with ``step_s``: the trainer sleeps ``step_s`` after each batch (a simulated compute step) and
  ``data_wait_fraction`` is the time spent inside ``next()`` over the wall time after the first batch.

A ``ProcessSampler`` thread polls ``psutil`` every ``interval`` seconds for this process and all its
descendants (DataLoader workers, litdata/energon helpers): the peak of the summed RSS, and the CPU
seconds of every process seen (kept after it exits), so ``cpu_util`` is cores busy on average
(1.0 = one core). Summed RSS counts pages shared between processes (the page cache behind a memory
map, shared-memory batches) once per process that touches them: it is an upper bound, the figure
users compare across loaders. Cost: a few hundred microseconds per poll, off the timed thread. With
``descendants=False`` it watches this process alone (tens of microseconds per poll), which is how
``tools/bench_kernels.py`` takes a kernel's peak memory at a 0.5 ms interval.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from headrace.dataio.bench.extra import bench_import
from headrace.dataio.stagetimes import STAGES, TIMES, merge_times


class ProcessSampler:
    """Background poller of RSS and CPU time over this process and (``descendants``) its descendants.

    ``start_rss``: the summed RSS when the context was entered; ``peak_rss``: the peak since then."""

    def __init__(self, interval: float = 0.05, *, descendants: bool = True):
        self.interval = interval
        self.descendants = descendants
        self.peak_rss = self.start_rss = 0
        self._psutil = bench_import("psutil", "the RSS / CPU sampler of dataio bench")
        self._root = self._psutil.Process(os.getpid())
        self._cpu: dict[int, float] = {}  # pid -> CPU seconds at the last poll
        self._base: dict[int, float] = {}  # pid -> CPU seconds when first seen before start (excluded)
        self.thread_cpu = 0.0  # CPU seconds of the polling thread itself, as of its last poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def _processes(self) -> list:
        if not self.descendants:
            return [self._root]
        try:
            return [self._root, *self._root.children(recursive=True)]
        except self._psutil.Error:
            return [self._root]

    def poll(self) -> int:
        """One reading: updates the peak and the CPU seconds; returns the summed RSS."""
        rss = 0
        for p in self._processes():
            try:
                with p.oneshot():
                    rss += p.memory_info().rss
                    t = p.cpu_times()
                    self._cpu[p.pid] = t.user + t.system
            except self._psutil.Error:  # exited between listing and reading: its last poll stands
                continue
        self.peak_rss = max(self.peak_rss, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()
            self.thread_cpu = time.thread_time()

    def __enter__(self) -> "ProcessSampler":
        self.peak_rss = 0
        self.start_rss = self.poll()
        self._base = dict(self._cpu)  # CPU spent before the run (e.g. the main process's import time)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def cpu_seconds(self) -> float:
        return sum(t - self._base.get(pid, 0.0) for pid, t in self._cpu.items())


def percentile_ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1e3, q)) if values else None


def measure(
    open_batches: Callable[[], Iterator[Any]],
    count: Callable[[Any], tuple[int, float]],
    *,
    max_samples: int | None = None,
    max_batches: int | None = None,
    max_seconds: float | None = None,
    step_s: float = 0.0,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Run one loader; see the module docstring for the fields. ``count(batch)`` -> (samples, units)."""
    samples = batches = first_n = 0
    units = first_units = 0.0
    latencies: list[float] = []  # next() of every batch after the first: their sum is the data wait
    stages: dict[str, float] = {}  # loader stage seconds of the batches after the first (headrace's)
    with ProcessSampler() as sampler:
        start = time.perf_counter()
        iterator = open_batches()
        first_at = None
        while True:
            t = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                break
            now = time.perf_counter()
            n, u = count(batch)
            if first_at is not None and isinstance(batch, dict):
                merge_times(stages, batch.get(TIMES))
            del batch  # a held batch would pin its shared-memory block while the next one is made
            if first_at is None:
                first_at, first_n, first_units = now, n, u
                first_cpu = time.process_time() - sampler.thread_cpu
            else:
                latencies.append(now - t)
            samples, units, batches = samples + n, units + u, batches + 1
            if progress is not None:
                progress(n)
            if (
                (max_samples is not None and samples >= max_samples)
                or (max_batches is not None and batches >= max_batches)
                or (max_seconds is not None and now - start >= max_seconds)
            ):
                break
            if step_s:
                time.sleep(step_s)
        end = time.perf_counter()
        main_cpu = time.process_time() - sampler.thread_cpu - first_cpu if first_at is not None else None
        close = getattr(iterator, "close", None) or getattr(iterator, "_shutdown_workers", None)
        if close is not None:
            close()
        del iterator
    steady = end - first_at if first_at is not None else 0.0
    return {
        "samples": samples,
        "batches": batches,
        "units": units,
        "seconds": end - start,
        "first_batch_s": (first_at - start) if first_at is not None else None,
        # one batch only (a slow start-up filled the time limit): no rate after it, None rather than 0
        "samples_per_s": (samples - first_n) / steady if steady > 0 and batches > 1 else None,
        "units_per_s": (units - first_units) / steady if steady > 0 and batches > 1 else None,
        "latency_p50_ms": percentile_ms(latencies, 50),
        "latency_p99_ms": percentile_ms(latencies, 99),
        "peak_rss_mb": sampler.peak_rss / 2**20,
        "cpu_util": sampler.cpu_seconds() / (end - start) if end > start else None,
        "main_cpu_us_per_batch": main_cpu / (batches - 1) * 1e6 if main_cpu is not None and batches > 1 else None,
        "data_wait_fraction": (sum(latencies) / steady if steady > 0 else None) if step_s else None,
        "stage_fractions": {s: stages.get(s, 0.0) / steady for s in STAGES} if stages and steady > 0 else None,
    }
