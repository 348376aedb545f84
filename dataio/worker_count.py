"""``num_workers: auto``: a loader's worker count, chosen once from a short measurement on this machine.

The choice is between one process (0 workers) and ``WORKERS`` worker processes. A rank with fewer than 2
usable cores (its CPU affinity shared among the node's ranks, ``LOCAL_WORLD_SIZE``) gets 0 without
measuring: workers would only take turns with the main process. Otherwise two throwaway loaders of the same
``data:`` config and DP coordinates (endless, a fixed seed in place of ``randomized``) are timed in
``ROUNDS`` rounds in alternating order (one process, then workers; then workers, then one process), so a
page cache warmed by the first run or load from elsewhere does not favour one setting. Each run pulls its
first batch (start-up: reported by the bench, not throughput here), then batches for ``WARMUP_S`` (workers
filling their queues), then times ``WINDOW_S`` of batches: the samples the rank consumed over the wall
time. A setting's rate is the best of its rounds; workers win only when ``MARGIN`` faster (a tie goes to
fewer processes: less memory, no forks).

The real loader is then built with the chosen count, exactly as if it had been written: workers are
stateless (``headrace.dataio.stream.reading.workers``), so order, state, exactly-once and resume with any worker
count are the count's own. The choice is kept per process for the same config and DP coordinates (the
trainer's validation loader, rebuilt for each pass, measures once).

Why 0 against 2, whatever the core count: 2 is the default this replaces, and with the workers collating
into a shared ring the main process only receives views (no copy), so 2 workers can use two cores; the
measurement is of 2 vs 0 only, since each candidate costs ~0.6 s. A job that wants more writes the number.
What it cannot see: the training step. It picks the faster loader alone; a step that keeps the main
process's core busy favours workers more than this measurement does.

Cost: 4 runs of (a loader's start, its first batch, ``WARMUP_S + WINDOW_S``): 1.5-1.7 s of wall time on the
rank's cores on the 2-core box at load 2-5 (2-4 s at load ~30), once per process and config, before the
loader's first batch; nothing with one usable core. Memory: each throwaway loader (its maps, ring and workers)
is freed, by reference counting, before the next one starts, so the peak is that of the larger setting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from time import perf_counter
from typing import Callable, Iterable

from headrace.config import to_dict
from headrace.dataio.config import DataConfig
from headrace.dataio.usererror import SampleDecodeError

AUTO = "auto"
WORKERS = 2  # the count measured against one process
WARMUP_S = 0.05  # per run, after its first batch: workers filling their queues, pages first touched
WINDOW_S = 0.25  # per run, timed
ROUNDS = 2  # per setting, in alternating order
MARGIN = 1.05  # workers must be this much faster than one process to be chosen

_chosen: dict[tuple, "WorkerChoice"] = {}  # (config, dp_rank, dp_size) -> the choice made in this process


@dataclass(frozen=True, kw_only=True)
class WorkerChoice:
    """What ``auto`` resolved to: the count, the measured samples/s per count (empty: not measured),
    the measurement's wall time and the usable cores it saw."""

    num_workers: int
    rates: dict[int, float]
    seconds: float
    cores: int

    def line(self) -> str:
        """One line for the log: the choice and the two rates behind it."""
        if not self.rates and self.cores < 2:
            return (
                f"data.num_workers: auto -> {self.num_workers} ({self.cores} usable core for this rank: "
                "no room for workers, not measured)"
            )
        if not self.rates:
            return (
                f"data.num_workers: auto -> {self.num_workers} (not measured: the trial loaders, which re-read "
                "the data, met more bad samples than data.max_bad_samples)"
            )
        return (
            f"data.num_workers: auto -> {self.num_workers} (one process {self.rates[0]:,.0f} samples/s, "
            f"{WORKERS} workers {self.rates[WORKERS]:,.0f} samples/s; measured in {self.seconds:.1f} s)"
        )

    def to_dict(self) -> dict:
        return {
            "num_workers": self.num_workers,
            "rates": {str(n): r for n, r in self.rates.items()},
            "seconds": self.seconds,
            "cores": self.cores,
            "line": self.line(),
        }


def usable_cores() -> int:
    """The cores this process may run on, shared evenly among the node's ranks (torchrun's ``LOCAL_WORLD_SIZE``)."""
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def pick(rates: dict[int, float]) -> int:
    """The count to use from the measured samples/s of 0 and ``WORKERS``: workers only when ``MARGIN`` faster."""
    return WORKERS if rates[WORKERS] >= MARGIN * rates[0] else 0


def choose(
    cfg: DataConfig, open_loader: Callable[[DataConfig], Iterable], *, dp_rank: int, dp_size: int
) -> WorkerChoice:
    """The worker count for ``cfg`` (``num_workers: auto``) on this rank; ``open_loader(cfg)`` builds a loader
    of this rank (a ``headrace.dataio.loader.Loader``: its ``stream.consumed`` counts the samples)."""
    key = (json.dumps(to_dict(cfg), sort_keys=True), dp_rank, dp_size)
    if key not in _chosen:
        _chosen[key] = _measure(cfg, open_loader)
    return _chosen[key]


def _measure(cfg: DataConfig, open_loader: Callable[[DataConfig], Iterable]) -> WorkerChoice:
    cores = usable_cores()
    if cores < 2:
        return WorkerChoice(num_workers=0, rates={}, seconds=0.0, cores=cores)
    start = perf_counter()
    trial = dataclasses.replace(
        cfg, epochs=None, stop_on_first_exhausted=False, val=None, seed=0 if cfg.seed == "randomized" else cfg.seed
    )
    rates = {0: 0.0, WORKERS: 0.0}
    with _quiet_skips():  # the throwaway loaders' skips are not the job's: neither said nor counted
        try:
            for r in range(ROUNDS):
                for n in (0, WORKERS) if r % 2 == 0 else (WORKERS, 0):
                    rates[n] = max(rates[n], _rate(open_loader(dataclasses.replace(trial, num_workers=n))))
        except SampleDecodeError:  # an endless trial passed the job's budget re-reading the same bad samples: no
            # measurement (one process); the job's own loader keeps its own count
            return WorkerChoice(num_workers=0, rates={}, seconds=perf_counter() - start, cores=cores)
    return WorkerChoice(num_workers=pick(rates), rates=rates, seconds=perf_counter() - start, cores=cores)


@contextlib.contextmanager
def _quiet_skips():
    """The loader's bad-sample warnings off while the trial loaders run (their workers, forked inside, inherit it)."""
    logger = logging.getLogger("headrace.dataio.stream.reading.batches")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _rate(loader) -> float:
    """Samples/s of ``loader`` over ``WINDOW_S``, after its first batch and ``WARMUP_S``."""
    batches = iter(loader)
    try:
        next(batches)
        start = perf_counter()
        while perf_counter() - start < WARMUP_S:
            next(batches)
        first, start = loader.stream.consumed, perf_counter()
        while (now := perf_counter()) - start < WINDOW_S:
            next(batches)
        return (loader.stream.consumed - first) / (now - start)
    finally:
        batches.close()  # ends its workers


__all__ = ["AUTO", "WORKERS", "WorkerChoice", "choose", "pick", "usable_cores"]
