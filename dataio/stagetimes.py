"""Where a batch's loader time went: read, decode, pack (or bucket), collate, host-to-device.

Each stage adds the seconds it spent on a batch to the batch's ``__times__`` (``add_time``: two
``perf_counter`` calls and a dict update per stage and batch, never per sample). A worker's plain batch carries
its read, decode and collate seconds to the main process with the batch; the packing stage adds the seconds it
spent packing the chunks that went into a packed batch (``merge_times`` folds a chunk's into the packed batch
it ends in); the device prefetcher adds the host-to-device copy (pinning and issuing the copies; zero on CPU).
The token fast path (``headrace.dataio.stream.reading.gather``) reads, decodes (a ``.npy`` header) and collates in one
read straight into the batch: its time is ``read``.

``StageTotals.watch`` sums them over the batches a consumer takes; the trainer logs each log window's
``data_<stage>_frac`` (seconds / the window's wall time) and ``dataio bench`` its run's. Worker stages run beside
the step, in ``num_workers`` processes: their fractions say how busy the workers are (with W workers each can
approach W), the data wait says whether the step waited.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

STAGES = ("read", "decode", "pack", "collate", "h2d")
TIMES = "__times__"


def add_time(batch: dict, stage: str, since: float) -> float:
    """Add the seconds from ``since`` (a ``perf_counter``) to ``batch``'s ``stage``; returns now."""
    now = time.perf_counter()
    times = batch.setdefault(TIMES, {})
    times[stage] = times.get(stage, 0.0) + now - since
    return now


def merge_times(into: dict, times: dict | None) -> dict:
    """``into`` (a stage -> seconds dict) plus ``times``."""
    for stage, seconds in (times or {}).items():
        into[stage] = into.get(stage, 0.0) + seconds
    return into


class StageTotals:
    """Seconds per stage over the batches taken so far (``watch``)."""

    def __init__(self):
        self.seconds = dict.fromkeys(STAGES, 0.0)

    def watch(self, batches: Iterator[dict]) -> Iterator[dict]:
        """``batches`` as they are, their stage times summed."""
        for batch in batches:
            merge_times(self.seconds, batch.get(TIMES))
            yield batch

    def fractions(self, since: dict, elapsed: float) -> dict:
        """``data_<stage>_frac``: the seconds since the snapshot ``since`` over ``elapsed`` wall seconds."""
        return {f"data_{s}_frac": (self.seconds[s] - since[s]) / elapsed if elapsed > 0 else None for s in STAGES}


__all__ = ["STAGES", "TIMES", "StageTotals", "add_time", "merge_times"]
