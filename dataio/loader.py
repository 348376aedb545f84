"""``build_loader``: the resumable, rank-aware stream of batches the trainer iterates.

The whole stream is a pure function of position, composed of small stages (the map of a sample's
path, stage by stage, with each stage's state, is docs/data-path.md):

1. ``headrace.dataio.stream.ordering.blend``: global position ``p`` -> (dataset ``d``, its draw number ``k``), closed form
   (``headrace.dataio.stream.ordering.epochized`` for an energon ``blend_epochized`` metadataset, ``headrace.dataio.stream.datasets``).
2. ``headrace.dataio.stream.ordering.epoch_order``: draw ``k`` -> position ``k % N_d`` of epoch ``k // N_d`` of dataset ``d``,
   shuffled by shard order and in-window permutation from the seed -> a global sample index.
3. ``headrace.dataio.stream.ordering.split``: DP rank ``r`` takes positions ``start + r + n*j``; batch ``b`` is ``j`` in
   ``[j0 + b*B, j0 + (b+1)*B)``.
4. ``headrace.dataio.stream.reading.batches`` reads the samples by offset (``headrace.dataio.stream.sources.shard_source``), decodes them
   (``headrace.dataio.stream.reading.decode``; DALI per batch in ``headrace.dataio.stream.reading.dali``) and collates the plain batch
   (``headrace.dataio.stream.reading.collate``), in worker processes (``headrace.dataio.stream.reading.workers``) read back in order;
   ``headrace.dataio.stream.rank`` holds the rank's position.
5. One batching stage (``headrace.dataio.batching.stage``) turns that into the trainer's batches: ``plain``,
   ``packed`` (THD rows, ``headrace.dataio.batching.packing``) or ``bucketed`` (``headrace.dataio.batching.bucketing``).

So the state is tiny -- the layout (a start position and, rarely, a few skip ranges), the rank-local
position the trainer has consumed, the bad-sample count, the seed, and the stage's own state (the
packer's document references, the bucketing epoch and step) -- and restoring it in a new process with
any ``dp_size`` / ``num_workers`` continues the stream with nothing lost or repeated (see
``headrace.dataio.stream.ordering.split`` for the re-layout rule). Memory is bounded by the index (memory-mapped) plus
one shuffle window per worker, independent of the epoch length.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from typing import Iterator

import torch

from headrace.config import from_dict
from headrace.dataio.batching.bucketed import BucketedBatches
from headrace.dataio.batching.packed import PackedBatches
from headrace.dataio.batching.plain import PlainBatches
from headrace.dataio.batching.stage import Stage
from headrace.dataio.config import DataConfig
from headrace.dataio.loader_state import STATE_VERSION, StateError, check_states, data_identity
from headrace.dataio.stream.datasets import open_datasets, open_source
from headrace.dataio.stream.rank import RankStream
from headrace.dataio.stream.ordering.seeding import fresh_seed
from headrace.dataio.worker_count import AUTO, WorkerChoice, choose

log = logging.getLogger(__name__)


def batching_stage(stream: RankStream) -> Stage:
    """The batching stage the ``data:`` section asks for (a new stage: one more line here)."""
    if stream.cfg.bucketing is not None:
        return BucketedBatches(stream)
    if stream.cfg.thd:
        return PackedBatches(stream)
    return PlainBatches(stream)


class Loader:
    """Iterable of batches for one DP rank; ``state_dict()`` / ``load_state_dict()`` for exact resume.

    The rank's stream (``self.stream``: sources, seed, layout, position) and one batching stage
    (``self.stage``); the state is the stream's plus the stage's, under a version and a fingerprint.
    ``num_workers: auto`` is resolved here, before anything else (``headrace.dataio.worker_count``):
    ``self.cfg`` holds the count chosen, ``self.worker_choice`` how (None when the count was written)."""

    def __init__(self, cfg: DataConfig, *, dp_rank: int, dp_size: int):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_size - 1}")
        self.worker_choice: WorkerChoice | None = None
        if cfg.num_workers == AUTO:
            self.worker_choice = choose(
                cfg, functools.partial(Loader, dp_rank=dp_rank, dp_size=dp_size), dp_rank=dp_rank, dp_size=dp_size
            )
            log.info(self.worker_choice.line())
            cfg = dataclasses.replace(cfg, num_workers=self.worker_choice.num_workers)
        self.cfg, self.dp_rank, self.dp_size = cfg, dp_rank, dp_size
        self.datasets = open_datasets(cfg)  # sources (metadatasets flattened) and their schedule
        self.stream = RankStream(
            cfg,
            self.datasets.sources,
            self.datasets.schedule,
            seed=_resolve_seed(cfg.seed, dp_size),
            dp_rank=dp_rank,
            dp_size=dp_size,
            subflavors=self.datasets.subflavors,
        )
        self.stage = batching_stage(self.stream)
        self._fingerprint = self._make_fingerprint()

    @property
    def seed(self) -> int:
        return self.stream.seed

    def reseed(self, seed: int) -> list[int]:
        """A new data seed for this job (call after ``load_state_dict`` with every old rank's state, before
        iterating; the same on every rank). It orders each dataset's epochs that no rank had begun at the
        resume; epochs already begun keep their seed, so no sample of them repeats or is skipped
        (``headrace.dataio.stream.ordering.seeding``). Worker augmentation streams take it at once. Returns the first
        reseeded epoch of each dataset."""
        return self.stream.reseed(seed)

    @property
    def bad_samples(self) -> int:
        """Samples skipped on this rank so far (counted against ``max_bad_samples``)."""
        return self.stream.bad_samples

    @property
    def end(self) -> int | None:
        """The global position where a finite stream (``epochs: N``) ends; None when endless."""
        return self.stream.blend.end

    def __len__(self) -> int:
        """Batches left in a finite plain stream; the same on every DP rank (TypeError for an endless,
        packed or bucketed one)."""
        return len(self.stage)

    def __iter__(self) -> Iterator[dict]:
        yield from self.stage

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Positions and counters (JSON-serialisable, a few hundred bytes plus the stage's own state)."""
        return {
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            **self.stream.state_dict(),
            **self.stage.state_dict(),
        }

    def load_state_dict(self, states: dict | list[dict]) -> None:
        """Restore from every old rank's ``state_dict()`` (or just this rank's, same layout)."""
        states = [states] if isinstance(states, dict) else list(states)
        if not states:
            raise ValueError("load_state_dict: no state given")
        check_states(states, self._fingerprint, self.cfg.max_bad_samples, self.stream.blend.end)
        self._check_stage_fields(states)
        old_size = states[0]["dp_size"]
        by_rank = {s["dp_rank"]: s for s in states}
        same = old_size == self.dp_size and self.dp_rank in by_rank
        if not same and sorted(by_rank) != list(range(old_size)):
            raise ValueError(
                f"changing dp_size {old_size} -> {self.dp_size} needs the state of every old rank, "
                f"got ranks {sorted(by_rank)}"
            )
        old = [by_rank.get(r) for r in range(old_size)]
        self.stream.load_state_dict(old, self.dp_rank, self.dp_size)
        try:  # the stage's own sub-state (packing, bucketing): its complaints are about the state
            self.stage.load_state_dict(old, self.dp_rank, self.dp_size)
        except StateError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:  # a hand-edited sub-state's shape
            named = not isinstance(e, ValueError)  # their text alone ('str' object has no attribute ...) says little
            raise StateError(f"loader state: {type(e).__name__ + ' ' if named else ''}{e}") from None

    def _check_stage_fields(self, states: list[dict]) -> None:
        """StateError unless every state was saved by a loader with this one's batching stage: the stage's fields
        (beside the stream's) must be exactly this stage's, or a packer's half-filled rows would be dropped by a
        plain loader (and a plain state read as an empty packer)."""
        own = set(self.stage.state_dict())
        common = {"version", "fingerprint", "dp_rank", "dp_size", *self.stream.state_dict()}
        for s in states:
            theirs = set(s) - common
            if theirs != own:
                raise StateError(
                    f"loader state of rank {s['dp_rank']}: saved by a loader with "
                    f"{_stage_name(theirs)}, this one has {_stage_name(own)}; data.seq_len / packing / "
                    "bucketing must be those of the run that saved it"
                )

    def _make_fingerprint(self) -> str:
        sources = self.stream.sources
        entries = zip(self.datasets.entries, sources)
        what = {
            "data": [(split, weight, data_identity(s)) for (split, weight), s in entries],
            "shuffle": self.cfg.shuffle,
            "window": self.cfg.shuffle_window,
            "epochs": self.cfg.epochs,
            "stop_on_first_exhausted": self.cfg.stop_on_first_exhausted,
        }
        if self.datasets.epochized:
            what["epochized"] = True
        if self.cfg.shuffle and self.cfg.shuffle_window_shards:  # absent when 0: states of the sample window resume
            what["window_shards"] = self.cfg.shuffle_window_shards
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _stage_name(fields: set[str]) -> str:
    names = {
        frozenset(): "plain batches",
        frozenset({"packing", "packed_batches"}): "packed rows (data.seq_len)",
        frozenset({"bucketing"}): "bucketed batches",
    }
    return names.get(frozenset(fields), f"the state fields {sorted(fields)}")


def _resolve_seed(seed: int | str, dp_size: int) -> int:
    if seed != "randomized":
        return int(seed)
    value = fresh_seed()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)  # every rank must shuffle alike
        value = box[0]
    elif dp_size > 1:
        raise ValueError("seed: randomized with dp_size > 1 needs an initialised process group (to share the seed)")
    log.info("data seed: randomized -> %d (stored in the loader state)", value)
    return value


def build_loader(data_cfg: dict | DataConfig, dp_rank: int | None = None, dp_size: int | None = None) -> Loader:
    """The loader of one DP rank from the ``data:`` section (dict or ``DataConfig``).

    ``dp_rank``/``dp_size`` default to the default process group's rank and world size when
    torch.distributed is initialised (pass them explicitly when TP/PP/CP peers share a DP index)."""
    cfg = from_dict(DataConfig, data_cfg, "data")
    if dp_rank is None or dp_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            dp_rank, dp_size = dist.get_rank(), dist.get_world_size()
        else:
            dp_rank, dp_size = 0, 1
    return Loader(cfg, dp_rank=dp_rank, dp_size=dp_size)


__all__ = ["Loader", "batching_stage", "build_loader", "open_source"]
