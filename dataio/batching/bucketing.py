"""Dynamic duration bucketing for audio, rank-synced, plus audio (+ transcript) collation.

``estimate_bucket_edges`` cuts the duration axis into ``num_buckets`` ranges of equal total duration
(lhotse's estimate), from the index's ``samples['duration']`` column, so no audio is decoded.

``plan_epoch`` is a pure function of (durations, seed, epoch, dp_size, config) that every DP rank
evaluates identically:

1. Samples go to buckets by duration; a bucket too small to give every rank a batch is merged into
   its neighbour (the longer one; the last bucket into the shorter one).
2. In each bucket, samples are shuffled and cut greedily into batches whose *padded* duration
   (``len(batch) * max duration in it``, what the padded audio tensor costs) stays within
   ``max_duration``. A sample longer than ``max_duration`` on its own becomes a batch of one and is
   counted in ``oversized``: never dropped.
3. The bucket's batch count is raised to a multiple of ``dp_size`` by halving its largest batches,
   so its batches group into steps of ``dp_size`` batches from the same bucket.
4. The steps of all buckets are shuffled together. At step s, rank r takes batch r of step s.

2D bucketing (audio duration x output tokens, lhotse's 2D buckets / NeMo's ``bucket_duration_bins``
pairs): with ``bucket_duration_bins: [[max_seconds, max_tokens], ...]`` (or ``num_token_buckets > 1``,
which estimates such a grid: equal-duration bins, each split into equal-token bins), a sample goes to the
first bin (in (duration, tokens) order) that holds both its duration and its token count (the index's
``tokens`` column: shard the manifest with ``--tokenizer``); one past every bin goes to the last bin and
is counted in ``oversized``. ``bucket_batch_size`` then fixes each bin's batch size (the table
``python -m headrace.training.estimate_batch`` writes); without it batches are cut by padded duration as above,
and also by padded tokens (``len * max tokens <= max_tokens``) when ``max_tokens`` is set. A bucket
merged into a neighbour keeps the smaller of the two batch sizes.

So every sample appears exactly once per epoch across ranks, every rank runs the same number of steps,
and all ranks work on the same bucket at each step (even step times, no straggler). Cost: O(N log N)
per epoch in numpy plus a Python loop over samples for the greedy cut (~1 s per 1M samples).
Resume: the plan is recomputed from its inputs, so the loader only stores the step position; for a
new ``dp_size`` mid-epoch, plan the samples not yet consumed (``consumed_indices``) again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from headrace.dataio.batching.packing import IGNORE_INDEX
from headrace.dataio.config import BucketingConfig

_BUCKET_SEED_PURPOSE = 0xB0C4  # spawn-key tag: bucketing's stream apart from stream.ordering.seeding's


@dataclass(kw_only=True)
class EpochPlan:
    """``steps[s][r]``: the global sample indices of rank r's batch at step s."""

    steps: list[list[np.ndarray]]
    step_bucket: np.ndarray  # bucket id of each step
    bucket_range: np.ndarray  # (buckets, 2): shortest and longest duration in each (merged) bucket
    edges: np.ndarray
    oversized: int = 0  # single samples longer than max_duration (batches of one)
    merges: int = 0  # buckets merged into a neighbour for having too few samples

    def rank_batches(self, dp_rank: int) -> list[np.ndarray]:
        return [step[dp_rank] for step in self.steps]


def estimate_bucket_edges(durations: np.ndarray, num_buckets: int) -> np.ndarray:
    """``num_buckets - 1`` inner edges splitting ``durations`` into bins of equal total duration."""
    d = np.sort(np.asarray(durations, dtype=np.float64))
    if len(d) == 0:
        return np.zeros(0)
    if np.isnan(d).any():
        raise ValueError(
            "durations contain NaN (unknown duration): index the audio with durations (`dataio index`) before bucketing"
        )
    cum = np.cumsum(d)
    targets = cum[-1] * np.arange(1, num_buckets) / num_buckets
    return np.unique(d[np.searchsorted(cum, targets)])


def estimate_2d_bins(durations: np.ndarray, tokens: np.ndarray, num_buckets: int, num_token_buckets: int) -> np.ndarray:
    """``[K, 2]`` upper limits (seconds, tokens): equal-duration bins, each cut into equal-token bins."""
    d_edges = estimate_bucket_edges(durations, num_buckets)
    d_bin = np.searchsorted(d_edges, durations, side="right")
    bins = []
    for b in range(len(d_edges) + 1):
        member = d_bin == b
        if not member.any():
            continue
        d_max = float(durations[member].max())
        t_edges = estimate_bucket_edges(tokens[member], num_token_buckets)
        for t_max in [*t_edges.tolist(), float(tokens[member].max())]:
            bins.append((d_max, float(t_max)))
    return np.unique(np.asarray(bins, dtype=np.float64), axis=0)


def _bins_of(durations: np.ndarray, tokens: np.ndarray, bins: np.ndarray) -> np.ndarray:
    """The first 2D bin holding each sample (the last one for a sample past every bin)."""
    fits = (durations[:, None] <= bins[None, :, 0]) & (tokens[:, None] <= bins[None, :, 1])
    return np.where(fits.any(1), fits.argmax(1), len(bins) - 1)


def plan_epoch(
    indices: np.ndarray,
    durations: np.ndarray,
    *,
    seed: int,
    epoch: int,
    dp_size: int,
    cfg: BucketingConfig,
    edges: np.ndarray | None = None,
    tokens: np.ndarray | None = None,
) -> EpochPlan:
    """The rank-synced batches of one epoch over samples ``indices`` (with their ``durations`` and, for
    2D bucketing, output ``tokens``). ``edges``: the buckets to keep (1D edges or 2D bins)."""
    indices = np.asarray(indices, dtype=np.int64)
    durations = np.asarray(durations, dtype=np.float64)
    if cfg.two_d:
        if tokens is None or len(tokens) != len(durations) or (np.asarray(tokens) < 0).any():
            raise ValueError(
                "2D bucketing needs every sample's token count (the index's tokens column: shard "
                "the manifest with `dataio shard --tokenizer`)"
            )
        tokens = np.asarray(tokens, dtype=np.float64)
    if len(indices) != len(durations):
        raise ValueError(f"{len(indices)} indices but {len(durations)} durations")
    if len(indices) < dp_size:
        raise ValueError(
            f"bucketing {len(indices)} samples over dp_size={dp_size}: every rank needs a "
            "batch per step; use fewer ranks or more data"
        )
    if edges is None and cfg.two_d:
        edges = (
            np.asarray(cfg.bucket_duration_bins, dtype=np.float64)
            if cfg.bucket_duration_bins
            else estimate_2d_bins(durations, tokens, cfg.num_buckets, cfg.num_token_buckets)
        )
    elif edges is None:
        edges = estimate_bucket_edges(durations, cfg.num_buckets)
    rng = np.random.Generator(
        np.random.PCG64(np.random.SeedSequence(entropy=int(seed), spawn_key=(_BUCKET_SEED_PURPOSE, int(epoch))))
    )
    bucket_of = _bins_of(durations, tokens, edges) if cfg.two_d else np.searchsorted(edges, durations, side="right")
    sizes = cfg.bucket_batch_size or [None] * (len(edges) + 1)
    limits = [(durations, cfg.max_duration), *([(tokens, cfg.max_tokens)] if cfg.max_tokens else [])]
    # (member positions, fixed batch size or None) per non-empty bucket, shortest first
    pending = [(m, sizes[b]) for b in range(len(sizes)) if len(m := np.flatnonzero(bucket_of == b))]
    groups = []  # (batches, member positions, batch size) per bucket
    merges = 0
    while pending:
        m, size = pending.pop(0)
        order = m[rng.permutation(len(m))]
        batches = np.array_split(order, range(size, len(order), size)) if size else _greedy_batches(order, limits)
        if _split_to_multiple(batches, dp_size):
            groups.append((batches, m, size))
            continue
        # too few samples to give every rank a batch: merge into the next longer bucket (the last
        # bucket into the previous one; the smaller fixed batch size wins) and cut again
        merges += 1
        if pending:
            pending[0] = (np.concatenate([m, pending[0][0]]), _smaller(size, pending[0][1]))
        elif groups:
            prev = groups.pop()
            pending.append((np.concatenate([prev[1], m]), _smaller(size, prev[2])))
        else:
            raise ValueError(
                f"bucketing cannot give each of dp_size={dp_size} ranks a batch: "
                f"{len(indices)} samples need {len(batches)} batches within the bucket limits; "
                "raise max_duration / bucket_batch_size or use fewer ranks"
            )

    steps, step_bucket = [], []
    for bucket, (batches, _, _) in enumerate(groups):
        for s in range(0, len(batches), dp_size):
            steps.append([indices[b] for b in batches[s : s + dp_size]])
            step_bucket.append(bucket)
    order = rng.permutation(len(steps))
    if cfg.two_d:
        oversized = int(np.sum((durations > edges[-1, 0]) | (tokens > edges[-1, 1])))
    else:
        oversized = int(np.sum(durations > cfg.max_duration)) if cfg.max_duration else 0
    bucket_range = np.array([[durations[m].min(), durations[m].max()] for _, m, _ in groups])
    return EpochPlan(
        steps=[steps[i] for i in order],
        step_bucket=np.asarray(step_bucket)[order],
        bucket_range=bucket_range,
        edges=edges,
        oversized=oversized,
        merges=merges,
    )


def _smaller(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _greedy_batches(order: np.ndarray, limits: list[tuple[np.ndarray, float]]) -> list[np.ndarray]:
    """Cut ``order`` (positions into the value arrays) into consecutive batches whose padded cost
    ``len * max(values)`` stays within each ``(values, limit)`` (a lone oversized sample forms its own
    batch)."""
    columns = [values[order].tolist() for values, _ in limits]
    caps = [limit for _, limit in limits]
    batches, start, longest = [], 0, [0.0] * len(limits)
    for i in range(len(order)):
        grown = [max(m, c[i]) for m, c in zip(longest, columns)]
        if i > start and any((i - start + 1) * g > cap for g, cap in zip(grown, caps)):
            batches.append(order[start:i])
            start, grown = i, [c[i] for c in columns]
        longest = grown
    if len(order):
        batches.append(order[start:])
    return batches


def _split_to_multiple(batches: list[np.ndarray], multiple: int) -> bool:
    """Halve the largest batches in place until their count is a multiple of ``multiple``; False if
    there are too few samples for that."""
    while len(batches) % multiple:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]))
        b = batches[largest]
        if len(b) < 2:
            return False
        batches[largest : largest + 1] = [b[: len(b) // 2], b[len(b) // 2 :]]
    return True


def consumed_indices(plan: EpochPlan, steps_done: int) -> np.ndarray:
    """Global indices served by the first ``steps_done`` steps across all ranks (for elastic resume:
    plan the rest of the epoch with the new dp_size over the samples not in here)."""
    served = [b for step in plan.steps[:steps_done] for b in step]
    return np.sort(np.concatenate(served)) if served else np.zeros(0, dtype=np.int64)


def _pad_stack(arrays: Sequence, pad_value, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = [torch.as_tensor(np.asarray(a)) for a in arrays]
    lengths = torch.tensor([len(t) for t in tensors], dtype=torch.long)
    out = torch.full((len(tensors), int(lengths.max()) if len(tensors) else 0), pad_value, dtype=dtype)
    for row, t in zip(out, tensors):
        row[: len(t)] = t
    return out, lengths


def collate_audio(
    samples: list[dict], *, audio_key: str = "audio", tokens_key: str | None = "tokens", pad_id: int = 0
) -> dict:
    """Padded ``audio`` (float32 ``(B, T)``) + ``audio_lens``; with ``tokens_key``, the transcript's
    token ids padded with ``pad_id`` + ``token_lens``, and ``labels`` (-100 on padding) for a
    speech-LLM loss; ``__key__`` and ``text`` (the transcript, when the samples carry one) pass through."""
    for s in samples:
        if np.asarray(s[audio_key]).ndim != 1:
            raise ValueError(
                f"sample {s.get('__key__', '?')}: {audio_key} must be mono 1-D, "
                f"got shape {np.asarray(s[audio_key]).shape}"
            )
    audio, audio_lens = _pad_stack([s[audio_key] for s in samples], 0.0, torch.float32)
    batch = {"audio": audio, "audio_lens": audio_lens}
    if tokens_key is not None:
        tokens, token_lens = _pad_stack([s[tokens_key] for s in samples], pad_id, torch.long)
        labels = tokens.masked_fill(torch.arange(tokens.shape[1]) >= token_lens[:, None], IGNORE_INDEX)
        batch.update(tokens=tokens, token_lens=token_lens, labels=labels)
    for passthrough in ("__key__", "text"):  # keys and the transcript text (from the sample's .json)
        if samples and passthrough in samples[0]:
            batch[passthrough] = [s.get(passthrough) for s in samples]
    return batch


__all__ = [
    "BucketingConfig",
    "EpochPlan",
    "collate_audio",
    "consumed_indices",
    "estimate_2d_bins",
    "estimate_bucket_edges",
    "plan_epoch",
]
