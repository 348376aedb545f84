"""Context-parallel split of a packed THD batch: Transformer Engine's load-balanced head-tail scheme.

With ``cp_size`` c, every segment of ``cu_seqlens`` (document pieces and row padding alike) is padded
to a multiple of 2c and cut into 2c equal chunks; CP rank r keeps chunks r and 2c-1-r of every
segment. Under a causal mask chunk k of a segment costs ~ (k + 1/2) chunk^2 query-key pairs, so the
pair (r, 2c-1-r) costs the same on every rank, whereas a contiguous split gives the last rank ~2c-1
times the work of the first. The split is pure index arithmetic (one gather per tensor, no per-segment
Python loop); ``cp_merge`` undoes it.

Per CP rank the result carries ``input_ids``/``labels``/``position_ids`` of shape ``(1, local_tokens)``
with ``position_ids`` equal to the positions in the full (unsplit) sequence, the local ``cu_seqlens``
(segments of 2 chunks each), and the global ``cu_seqlens_padded`` (what Transformer Engine calls
``cu_seqlens_q_padded``: the padded full-sequence offsets). Padding tokens get label -100 and
continue the segment's positions. ``attention_work`` reports the per-rank causal work and its
imbalance, for this scheme and for a contiguous split.
"""

from __future__ import annotations

import torch

from headrace.dataio.batching.packing import IGNORE_INDEX

TOKEN_FIELDS = ("input_ids", "labels", "position_ids")


def _layout(cu_seqlens: torch.Tensor, cp_size: int):
    """Per segment: real length, padded length, chunk length, padded start."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    chunk = (lengths + 2 * cp_size - 1) // (2 * cp_size)
    padded = chunk * 2 * cp_size
    padded_starts = torch.cumsum(padded, 0) - padded
    return lengths, padded, chunk, padded_starts


def _rank_padded_index(chunk: torch.Tensor, padded_starts: torch.Tensor, cp_size: int, rank: int):
    """Indices into the padded full sequence of rank ``rank``'s tokens, segment by segment."""
    per_segment = 2 * chunk
    seg = torch.repeat_interleave(torch.arange(len(chunk)), per_segment)
    within = torch.arange(int(per_segment.sum())) - torch.repeat_interleave(
        torch.cumsum(per_segment, 0) - per_segment, per_segment
    )
    c = chunk[seg]
    head = within < c  # first half: chunk `rank`; second half: chunk 2c-1-rank
    chunk_id = torch.where(head, torch.full_like(c, rank), torch.full_like(c, 2 * cp_size - 1 - rank))
    return seg, padded_starts[seg] + chunk_id * c + torch.where(head, within, within - c)


def cp_shard(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """CP rank ``cp_rank``'s part of a packed batch (``headrace.dataio.batching.packing`` layout); see the module docstring."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    cu = batch["cu_seqlens"].long()
    flat = {k: batch[k].reshape(-1) for k in TOKEN_FIELDS}
    total = flat["input_ids"].numel()
    if int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must span the batch: 0..{total}, got {int(cu[0])}..{int(cu[-1])}")
    lengths, padded, chunk, padded_starts = _layout(cu, cp_size)
    seg, pidx = _rank_padded_index(chunk, padded_starts, cp_size, cp_rank)
    within = pidx - padded_starts[seg]  # position inside the padded segment
    real = within < lengths[seg]
    src = torch.where(real, cu[seg] + within, torch.zeros_like(within))
    input_ids = torch.where(real, flat["input_ids"][src], torch.zeros_like(src))
    labels = torch.where(real, flat["labels"][src], torch.full_like(src, IGNORE_INDEX))
    # positions of the full sequence; padding continues its segment's count
    base = flat["position_ids"][cu[seg].clamp(max=total - 1)]
    position_ids = torch.where(real, flat["position_ids"][src], base + within)
    local = 2 * chunk
    return {
        "input_ids": input_ids.view(1, -1),
        "labels": labels.view(1, -1),
        "position_ids": position_ids.view(1, -1),
        "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(local, 0)]).int(),
        "cu_seqlens_padded": torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(padded, 0)]).int(),
        "max_seqlen": int(local.max()),
        "padded_index": pidx,
        "cp_rank": cp_rank,
        "cp_size": cp_size,
        "source_shape": tuple(batch["input_ids"].shape),
        "source_cu_seqlens": batch["cu_seqlens"],
    }


def cp_split(batch: dict, cp_size: int) -> list[dict]:
    """Split a packed batch (``headrace.dataio.batching.packing`` layout) into ``cp_size`` per-rank batches."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    return [cp_shard(batch, cp_size, rank) for rank in range(cp_size)]


def cp_merge(shards: list[dict]) -> dict:
    """Undo ``cp_split``: the original ``input_ids``/``labels``/``position_ids``/``cu_seqlens``."""
    cu = shards[0]["source_cu_seqlens"].long()
    cp_size = shards[0]["cp_size"]
    lengths, padded, _, padded_starts = _layout(cu, cp_size)
    total_padded = int(padded.sum())
    # where each real token of the original batch sits in the padded full sequence
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(cu[:-1], lengths)
    real_index = padded_starts[seg] + within
    out = {}
    for k in TOKEN_FIELDS:
        full = torch.empty(total_padded, dtype=shards[0][k].dtype)
        for s in shards:
            full[s["padded_index"]] = s[k].reshape(-1)
        out[k] = full[real_index].view(shards[0]["source_shape"])
    out["cu_seqlens"] = shards[0]["source_cu_seqlens"]
    return out


def attention_work(cu_seqlens: torch.Tensor, cp_size: int) -> dict:
    """Per-rank attention work of the head-tail split, with imbalance = max / mean: ``causal`` counts
    the query-key pairs among real tokens under the causal mask (with a contiguous split beside it
    for comparison), ``sum_sq`` the sum over chunks of (real tokens in the chunk)^2."""
    cu = cu_seqlens.long()
    lengths, _, chunk, _ = _layout(cu, cp_size)

    def causal_pairs(start, stop):  # queries at positions start..stop-1 of a segment, real tokens only
        stop = torch.minimum(stop, lengths)
        start = torch.minimum(start, stop)
        return ((stop * (stop + 1) - start * (start + 1)) // 2).sum().item()

    def report(work):
        mean = sum(work) / len(work)
        return {"work": work, "imbalance": max(work) / mean if mean else 1.0}

    head_tail = [
        causal_pairs(r * chunk, (r + 1) * chunk)
        + causal_pairs((2 * cp_size - 1 - r) * chunk, (2 * cp_size - r) * chunk)
        for r in range(cp_size)
    ]
    contiguous = [causal_pairs(2 * r * chunk, 2 * (r + 1) * chunk) for r in range(cp_size)]

    def real_sq(k):
        return int(((lengths - k * chunk).clamp(min=0).minimum(chunk) ** 2).sum())

    sum_sq = [real_sq(r) + real_sq(2 * cp_size - 1 - r) for r in range(cp_size)]
    return {"causal": report(head_tail), "causal_contiguous": report(contiguous), "sum_sq": report(sum_sq)}


__all__ = ["attention_work", "cp_merge", "cp_shard", "cp_split"]
