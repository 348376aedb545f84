"""The bucketed batching stage (``bucketing:`` set): duration-bucketed (or 2D: duration x transcript
tokens, from the index's ``tokens`` column) audio batches from
``headrace.dataio.batching.bucketing``'s rank-synced epoch plan, epoch by epoch. It replaces the stream's
position plan (one dataset, no packing): batch ``b`` of the plan is a list of sample indices, read and
decoded by the stream's ``SampleReader`` in the worker processes and padded by ``collate_audio``.

State: ``bucketing`` = ``{epoch, history, step}``: the epoch, the earlier layouts of this epoch
(``[dp_size, steps done]`` each) and the steps of the current plan consumed. All ranks step together,
so onto another ``dp_size`` the new plan covers what the old layouts left of the epoch.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch

from headrace.dataio.stagetimes import TIMES, add_time
from headrace.dataio.batching.bucketing import collate_audio, consumed_indices, plan_epoch
from headrace.dataio.loader_state import MAX_COUNT, StateError
from headrace.dataio.shards.formats import is_audio_member
from headrace.dataio.stream.reading.batches import SampleReader, no_samples, token_ext
from headrace.dataio.usererror import SampleDecodeError
from headrace.dataio.stream.ordering.refs import make_ref
from headrace.dataio.stream.reading.collate import Allocator
from headrace.dataio.stream.rank import RankStream
from headrace.dataio.stream.ordering.split import same_layout


MAX_RANKS = 1 << 20  # a history's dp_size: more ranks than any job runs is a damaged state


class BucketBatch:
    """Batch ``b`` of one epoch's plan: ``batches[b]`` (sample indices) read, decoded and collated."""

    def __init__(self, reader: SampleReader, batches: list[np.ndarray], *, token_ext: str | None):
        self.reader, self.batches, self.token_ext = reader, batches, token_ext

    def __call__(self, b: int, alloc: Allocator) -> dict:
        start, read_before = time.perf_counter(), self.reader.read_seconds
        refs = make_ref(0, self.batches[b])
        samples, keys, kept, bad = self.reader.read(refs)
        if not samples:  # every sample bad (counted): a batch of none, which the stage skips
            return no_samples(0, bad)
        collating = time.perf_counter()
        read = self.reader.read_seconds - read_before
        rows = [
            {
                "audio": _audio_member(s, k),
                "__key__": k,
                **({"tokens": s[self.token_ext]} if self.token_ext else {}),
                **({"text": s["json"].get("text")} if isinstance(s.get("json"), dict) else {}),
            }
            for s, k in zip(samples, keys)
        ]
        batch = {
            **collate_audio(rows, tokens_key="tokens" if self.token_ext else None),
            "__ref__": torch.from_numpy(refs[kept]),
            "__bad__": bad,
            TIMES: {"read": read, "decode": collating - start - read},  # the bucket plan is made once an epoch
        }
        add_time(batch, "collate", collating)
        return batch


def _audio_member(sample: dict, key: str) -> torch.Tensor:
    """The waveform of a sample's one audio member, whatever its codec (a dataset may mix FLAC and WAV)."""
    audio = [v for e, v in sample.items() if is_audio_member(e)]
    if len(audio) != 1:
        names = ", ".join(e for e in sample if is_audio_member(e))
        raise SampleDecodeError(f"bucketing: {len(audio)} audio members ({names}), expected one", key=key)
    return audio[0].waveform


class BucketedBatches:
    def __init__(self, stream: RankStream):
        cfg = stream.cfg
        if len(stream.sources) != 1 or cfg.thd:
            raise ValueError(
                "bucketing: needs exactly one dataset, packing: none and no seq_len (bucketing makes the batches)"
            )
        exts = stream.sources[0].index.extensions
        if not any(is_audio_member(e) for e in exts):  # at build, where the trainer says it in one line
            raise ValueError(f"bucketing: {cfg.datasets[0].path} has no audio members ({', '.join(exts)})")
        self.stream = stream
        self.epoch, self.history, self.step = 0, [], 0

    def __iter__(self) -> Iterator[dict]:
        stream, cfg = self.stream, self.stream.cfg
        reader = stream.reader()
        while cfg.epochs is None or self.epoch < cfg.epochs:
            batches = self._plan(self.epoch, self.history)
            if self.step > len(batches):
                raise StateError(
                    f"loader state: bucketing 'step' {self.step} is past the {len(batches)} batches of "
                    f"epoch {self.epoch} (a state of other data or another bucketing)"
                )
            make = BucketBatch(reader, batches, token_ext=token_ext(stream.sources[0]))
            for batch in stream.run(make, first=self.step, last=len(batches), epoch=self.epoch):
                self.step += 1
                if not batch["__key__"]:  # its samples were all bad (counted): nothing stands in for them
                    continue
                yield batch
            self.epoch, self.history, self.step = self.epoch + 1, [], 0

    def _plan(self, epoch: int, history: list[list[int]]) -> list[np.ndarray]:
        """This rank's batches of ``epoch``: the plan over the samples the earlier layouts of this
        epoch (``history``: ``[dp_size, steps done]`` each) left, for the current dp_size."""
        stream = self.stream
        source = stream.sources[0]
        indices = np.concatenate([np.arange(a, a + n) for a, n in zip(source.shard_starts, source.shard_sizes)])
        durations = np.asarray(source.index.samples["duration"], dtype=np.float64)
        tokens = np.asarray(source.index.samples["tokens"]) if stream.cfg.bucketing.two_d else None  # 2D
        edges = None
        for dp_size, steps in [*history, [stream.dp_size, 0]]:
            plan = plan_epoch(
                indices,
                durations[indices],
                seed=stream.seeds.at(0, epoch),
                epoch=epoch,
                dp_size=dp_size,
                cfg=stream.cfg.bucketing,
                edges=edges,
                tokens=None if tokens is None else tokens[indices],
            )
            edges = plan.edges  # the same buckets for the whole epoch
            indices = np.setdiff1d(indices, consumed_indices(plan, steps))
        return plan.rank_batches(stream.dp_rank)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"bucketing": {"epoch": self.epoch, "history": self.history, "step": self.step}}

    def load_state_dict(self, old: list[dict | None], dp_rank: int, dp_size: int) -> None:
        epochs = self.stream.cfg.epochs
        for s in old:
            if s is not None and not _bucketing_state_ok(s.get("bucketing"), epochs):
                raise StateError(
                    f"loader state of rank {s['dp_rank']}: 'bucketing' must be a mapping of epoch "
                    f"(at most epochs={epochs}), step and history ([dp_size >= 1, steps] each) of "
                    f"non-negative integers below 2**62, got {s.get('bucketing')!r}"[:300]
                )
        if same_layout(old, dp_rank, dp_size):  # the same plan: continue at the step
            b = old[dp_rank]["bucketing"]
            self.epoch, self.history, self.step = b["epoch"], b["history"], b["step"]
            return
        b = old[0]["bucketing"]  # re-plan what the old layout left of the epoch
        if any(s["bucketing"] != b for s in old):
            raise ValueError("bucketing states of the old ranks differ (ranks must step together)")
        self.epoch, self.step = b["epoch"], 0
        self.history = [*b["history"], [len(old), b["step"]]]


def _bucketing_state_ok(b, epochs: int | None) -> bool:
    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_COUNT

    return (
        isinstance(b, dict)
        and set(b) == {"epoch", "history", "step"}
        and count(b["epoch"])
        and (epochs is None or b["epoch"] <= epochs)
        and count(b["step"])
        and isinstance(b["history"], list)
        and all(
            isinstance(h, list) and len(h) == 2 and count(h[0]) and 1 <= h[0] <= MAX_RANKS and count(h[1])
            for h in b["history"]
        )
    )


__all__ = ["BucketedBatches"]
