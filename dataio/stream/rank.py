"""One DP rank's position in the global stream, and its plain batches from there on.

``RankStream`` owns what every batching stage shares: the sources, the blend schedule, the seed, the
rank's ``Layout`` (``headrace.dataio.stream.ordering.split``), ``consumed`` (rank-local positions handed on: to the
trainer, or into a packer) and the bad-sample count, plus running batch functions through the
worker processes (``headrace.dataio.stream.reading.workers``). Batching stages (``headrace.dataio.batching``) iterate through
it and advance ``consumed``; their own state stays in their own files.

State (``state_dict``, JSON-sized): ``seed``, ``reseeds`` (per-job seeds, ``headrace.dataio.stream.ordering.seeding``),
``layout``, ``consumed``, ``bad_samples``. Restoring it
onto another ``dp_size`` re-lays the stream out over what every old rank consumed
(``headrace.dataio.stream.ordering.split.relayout``): nothing lost or repeated.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from headrace.dataio.config import DataConfig
from headrace.dataio.stream.reading.audio_batch import mean_decoded_bytes
from headrace.dataio.stream.reading.batches import BatchMaker, SampleReader
from headrace.dataio.stream.ordering.blend import BlendSchedule
from headrace.dataio.stream.reading.collate import Allocator
from headrace.dataio.usererror import SampleDecodeError
from headrace.dataio.stream.ordering.epochized import EpochizedSchedule
from headrace.dataio.stream.ordering.seeding import SeedSchedule
from headrace.dataio.stream.sources.shard_source import ShardSource
from headrace.dataio.stream.ordering.split import Layout, relayout, same_layout
from headrace.dataio.stream.reading.pool import WorkerError
from headrace.dataio.stream.reading.workers import RankBatches, iterate

READ_BYTES = 1 << 20
MAX_READ = 1024
TASK_SAMPLES_HERE = 256  # samples per task made at once without workers (see plain)
TASK_BYTES_HERE = 4 << 20  # ... and at most this many stored bytes
MEAN_ROWS = 1 << 16  # rows a size estimate reads: start-up must not read a per-sample column whole


def spread_rows(column: np.ndarray) -> np.ndarray:
    """At most ``MEAN_ROWS`` rows spread evenly over a mapped per-sample column (all of a small one)."""
    return column[:: max(1, len(column) // MEAN_ROWS)]


class RankStream:
    """The sample stream of DP rank ``dp_rank`` of ``dp_size``: position state and plain batches."""

    def __init__(
        self,
        cfg: DataConfig,
        sources: list[ShardSource],
        blend: BlendSchedule | EpochizedSchedule,
        *,
        seed: int,
        dp_rank: int,
        dp_size: int,
        subflavors: list[dict] | None = None,
    ):
        self.cfg, self.sources, self.blend, self.subflavors = cfg, sources, blend, subflavors
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.layout = Layout(start=0, dp_size=dp_size)
        self.consumed = 0
        self.bad_samples = 0
        self.reseeds: list[tuple[int, list[int]]] = []  # per-job seeds, see reseed()
        self.resumed_end = 0  # one past the highest global position any old rank had consumed at the resume
        self.fork_safe = self.reader().fork_safe

    @property
    def seeds(self) -> SeedSchedule:
        return SeedSchedule(base=self.seed, reseeds=self.reseeds)

    def reseed(self, seed: int) -> list[int]:
        """Order the epochs that no rank had begun at the resume with ``seed`` (``Loader.reseed``)."""
        first = [-(-self.blend.draws_before(d, self.resumed_end) // len(s)) for d, s in enumerate(self.sources)]
        self.reseeds = [*self.reseeds, (int(seed), first)]
        return first

    def reader(self) -> SampleReader:
        return SampleReader(self.cfg, self.sources, bad_so_far=self.bad_samples)

    def num_batches(self, batch_size: int | None = None) -> int | None:
        """Plain batches of ``batch_size`` (default ``cfg.batch_size``) left from ``consumed`` (None: endless)."""
        return self.layout.num_batches(self.blend.end, self.consumed, batch_size or self.cfg.batch_size)

    def plain(self, batch_size: int | None = None) -> Iterator[dict]:
        """Plain batches of ``batch_size`` samples (default ``cfg.batch_size``) from ``consumed`` on:
        collated samples plus ``__pos__`` (their rank-local positions) and ``__end__`` (the position
        after the batch) for the stage to advance ``consumed``."""
        batch_size = batch_size or self.cfg.batch_size
        maker = BatchMaker(
            reader=self.reader(),
            blend=self.blend,
            seed=self.seeds,
            layout=self.layout,
            dp_rank=self.dp_rank,
            first_local=self.consumed,
            batch_size=batch_size,
            subflavors=self.subflavors,
        )
        start_pos = int(self.layout.positions(self.dp_rank, np.array([self.consumed]))[0])
        # Without workers small batches are made a task at a time (``RankBatches.here``): ~256 samples,
        # at most ~4 MB held by the task's batches, so the per-batch fixed cost is paid once per task.
        per_task = max(
            1,
            min(
                TASK_SAMPLES_HERE // batch_size,
                int(TASK_BYTES_HERE // max(batch_size * self._mean_sample_bytes(), 1.0)),
            ),
        )
        return self.run(
            maker,
            first=0,
            last=self.num_batches(batch_size),
            epoch=self.blend.epoch_at(start_pos),
            batch_bytes=self._batch_bytes(batch_size),
            per_task_here=per_task,
        )

    def read_batch_size(self) -> int:
        """Samples per read for a stage that re-batches them (packing): at least ``cfg.batch_size``,
        and enough for ~``READ_BYTES`` (the per-batch fixed cost, ~0.1-0.2 ms, is then small against
        the per-sample cost; measured in BENCHMARKS.md "Loader per-sample cost"), at most ``MAX_READ``."""
        return max(self.cfg.batch_size, min(MAX_READ, int(READ_BYTES / max(self._mean_sample_bytes(), 1.0))))

    def run(
        self,
        make: Callable[[int, Allocator], dict],
        *,
        first: int,
        last: int | None,
        epoch: int,
        batch_bytes: int = 0,
        per_task_here: int = 1,
    ) -> Iterator[dict]:
        """Batches ``first .. last-1`` of ``make`` (``make(b, alloc)``; its ``__bad__`` counted here and
        removed), computed by ``num_workers`` worker processes and read back in order."""
        cfg = self.cfg
        batches = RankBatches(
            make,
            first=first,
            last=last,
            seed=self.seeds.latest,
            dp_rank=self.dp_rank,
            epoch=epoch,
            make_task=make.task if isinstance(make, BatchMaker) else None,
        )
        try:
            for batch in iterate(
                batches,
                num_workers=cfg.num_workers,
                prefetch=cfg.prefetch,
                pin_memory=cfg.pin_memory,
                timeout=cfg.worker_timeout if cfg.num_workers else 0,
                batch_bytes=batch_bytes,
                first_here=self.fork_safe,
                per_task_here=per_task_here,
            ):
                self._count_bad(batch.pop("__bad__"))
                yield batch
                del batch  # a worker's ring bytes come back once the consumer drops the batch too
        except WorkerError as e:
            self.explain_worker_crash(e)
            raise

    def explain_worker_crash(self, error: WorkerError) -> None:
        """A worker killed by SIGBUS ("... killed by signal SIGBUS: Bus error"): the likely cause here is a
        page touched past the end of a shard that shrank under the map: raise that shard's error."""
        if "Bus error" in str(error):
            for source in self.sources:
                if isinstance(source, ShardSource):  # the mapped kinds (a lhotse manifest is read, not mapped)
                    source.check_sizes()

    def _mean_sample_bytes(self) -> float:
        return max(float(np.mean(spread_rows(s.index.samples["size"]))) if len(s) else 0.0 for s in self.sources)

    def _batch_bytes(self, batch_size: int) -> int:
        """Nominal bytes of a batch in a worker's shared ring: twice the mean stored bytes of a batch
        (decoded tokens take the bytes they are stored in), or 1.5x its decoded audio when that is more,
        1 MiB .. 256 MiB. A ring holds ``(prefetch + 3) * per_task`` of them; each batch takes the bytes it
        needs, and one that finds no room takes the slower default path."""
        audio = max(
            mean_decoded_bytes(np.asarray(spread_rows(s.index.samples["duration"])), self.cfg.decode)
            for s in self.sources
        )
        return int(min(256 << 20, max(1 << 20, max(2 * self._mean_sample_bytes(), 1.5 * audio) * batch_size)))

    def _count_bad(self, bad: int) -> None:
        self.bad_samples += bad
        if self.bad_samples > self.cfg.max_bad_samples:  # the workers' counts together
            raise SampleDecodeError(
                f"more than max_bad_samples={self.cfg.max_bad_samples} bad samples on DP rank "
                f"{self.dp_rank} (see the warnings above for which)"
            )

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "reseeds": self.reseeds,
            "layout": self.layout.to_dict(),
            "consumed": self.consumed,
            "bad_samples": self.bad_samples,
        }

    def load_state_dict(self, old: list[dict | None], dp_rank: int, dp_size: int) -> None:
        """Continue from the old ranks' states (see ``headrace.dataio.batching.stage``): the same position with the
        same layout, else a re-layout over what every old rank consumed."""
        known = next(s for s in old if s is not None)
        self.seed = known["seed"]
        self.reseeds = [(int(s), list(first)) for s, first in known.get("reseeds", [])]
        self.resumed_end = max(_consumed_end(s) for s in old if s is not None)
        if same_layout(old, dp_rank, dp_size):
            own = old[dp_rank]
            self.layout, self.consumed, self.bad_samples = (
                Layout.from_dict(own["layout"]),
                own["consumed"],
                own["bad_samples"],
            )
            return
        self.layout = relayout(Layout.from_dict(old[0]["layout"]), [s["consumed"] for s in old])
        self.layout.dp_size = dp_size
        self.consumed = 0
        self.bad_samples = max(s["bad_samples"] for s in old)


def _consumed_end(state: dict) -> int:
    """One past the highest global position the rank of ``state`` (or an older layout it skips) consumed."""
    layout = Layout.from_dict(state["layout"])
    own = (
        int(layout.positions(state["dp_rank"], np.array([state["consumed"] - 1]))[0]) + 1
        if state["consumed"]
        else layout.start
    )
    return max([own, *(s.end() for s in layout.skips)])


__all__ = ["RankStream"]
