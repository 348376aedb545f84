"""Timing helpers shared by the benchmark drivers: interleaved repeats, best and median, CPU seconds.

On a shared machine other processes' load comes and goes, so every driver repeats its measurements in
rounds that call each contender once (``interleaved``): a burst of outside load then hits all of them
alike instead of whichever happened to run during it. A limit or a kernel's speed is the best round
(``best_interleaved``: slower rounds are noise); a loader's rate is the median round (``median_run``).
CPU seconds (``cpu_seconds``, from ``getrusage``) do not depend on the CPU share the other jobs
leave: they show what a path costs.
"""

from __future__ import annotations

import resource
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def interleaved(calls: dict[str, Callable[[], T]], repeats: int) -> dict[str, list[T]]:
    """``{name: [result of each round]}``: ``repeats`` rounds, each calling every function once, in order."""
    results: dict[str, list[T]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            results[name].append(call())
    return results


def timed(fn: Callable[[], object], sync: Callable[[], None] | None = None) -> float:
    """Seconds of one call of ``fn``; ``sync()`` (e.g. ``torch.cuda.synchronize``) before and after."""
    if sync is not None:
        sync()
    start = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def best_interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None] | None = None
) -> dict[str, float]:
    """The best (lowest) seconds of each function over ``repeats`` interleaved rounds."""
    rounds = interleaved({name: (lambda fn=fn: timed(fn, sync)) for name, fn in fns.items()}, repeats)
    return {name: min(seconds) for name, seconds in rounds.items()}


def median_run(runs: list[dict], key: str) -> dict:
    """The run with the median ``key`` (the upper one of an even count; None sorts as 0)."""
    return sorted(runs, key=lambda r: r[key] or 0.0)[len(runs) // 2]


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system, all threads) of this process, and of its reaped children (workers
    count once they are joined)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


__all__ = ["best_interleaved", "cpu_seconds", "interleaved", "median_run", "timed"]
