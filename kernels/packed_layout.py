"""The attention plan of a packed batch, made on the host before the device copy, so no kernel reads the device.

What the document-masked attention kernels need to know about a batch's layout depends only on its
``cu_seqlens``: that they are well formed, the longest document (flash-attn's ``max_seqlen``), the
bucketed backend's gather indices (``varlen_attention.plan_buckets``), flex_attention's block tables.
Computed from device values inside the step, each of these is a host read (a GPU sync) per micro-batch;
``attention_plan`` computes them once per batch from the host copy of ``cu_seqlens``, in the data path
(the trainer runs it in the prefetcher's read-ahead thread, ``headrace.training.train``), and the plan travels
with the batch as a dict of tensors and ints (the prefetcher copies its tensors to the device beside
the batch). ``headrace.kernels.hf_attention`` hands it to ``varlen_attention``, which uses it instead of
planning from device values; a batch without a plan still works through the old path.

Flex block tables (``document_block_tables``): with 128-token blocks, q block i may attend kv block j
(j <= i) when some document has tokens in both: document ids grow along the row, so that is
``last_doc[j] >= first_doc[i]``; the block is *full* (no mask evaluation) when j < i, both blocks are
complete and all their tokens are one document. O(blocks^2) numpy work per batch (256^2 at 32k tokens),
against ``create_block_mask``'s evaluation of the mask over every token pair on the device.

``causal_pairs``: the (query, key) pairs the document masks require, sum over documents of n(n+1)/2;
``headrace.training.components.metrics`` turns it into the attention FLOPs of the document-masked MFU.
"""

from __future__ import annotations

import numpy as np
import torch

from headrace.kernels.varlen_attention import plan_buckets, validate_cu_seqlens

FLEX_BLOCK = 128  # flex_attention's default sparse block size


def segment_lengths(cu_seqlens: torch.Tensor) -> np.ndarray:
    """int64 lengths of the segments of a host ``cu_seqlens``."""
    cu = cu_seqlens.numpy().astype(np.int64)
    return cu[1:] - cu[:-1]


def causal_pairs(cu_seqlens: torch.Tensor) -> int:
    """Query-key pairs of causal attention confined to each segment: sum of n(n+1)/2 (host ``cu_seqlens``)."""
    n = segment_lengths(cu_seqlens)
    return int((n * (n + 1) // 2).sum())


def document_block_tables(cu_seqlens: torch.Tensor, total_tokens: int, block: int = FLEX_BLOCK) -> dict:
    """flex_attention's ``BlockMask.from_kv_blocks`` inputs for the document-causal mask (module docstring):
    ``kv_num_blocks`` / ``kv_indices`` (partial blocks) and ``full_kv_num_blocks`` / ``full_kv_indices``,
    int32 of shape ``(1, 1, n)`` / ``(1, 1, n, n)``, plus ``doc`` (each token's document, int32)."""
    lengths = segment_lengths(cu_seqlens)
    doc = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    n = -(-total_tokens // block)
    starts = np.arange(n) * block
    ends = np.minimum(starts + block, total_tokens)
    first, last = doc[starts], doc[ends - 1]
    complete = (ends - starts) == block
    qi, kj = np.arange(n)[:, None], np.arange(n)[None, :]
    touches = (kj <= qi) & (last[None, :] >= first[:, None])
    one_doc = complete & (first == last)
    full = touches & (kj < qi) & one_doc[:, None] & one_doc[None, :] & (first[:, None] == first[None, :])
    partial = touches & ~full

    def tables(mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        count = mask.sum(1).astype(np.int32)
        # active block indices first, ascending; the rest of each row is never read
        order = np.argsort(~mask, axis=1, kind="stable").astype(np.int32)
        return torch.from_numpy(count)[None, None], torch.from_numpy(order)[None, None]

    kv_num, kv_idx = tables(partial)
    full_num, full_idx = tables(full)
    return {
        "kv_num_blocks": kv_num,
        "kv_indices": kv_idx,
        "full_kv_num_blocks": full_num,
        "full_kv_indices": full_idx,
        "doc": torch.from_numpy(doc),
    }


def bucket_plan_tree(cu_seqlens: torch.Tensor, total_tokens: int) -> dict:
    """``plan_buckets`` of a host ``cu_seqlens`` as a dict of tensors and ints (what the prefetcher copies)."""
    plan = plan_buckets(cu_seqlens, total_tokens)
    return {
        "gather": tuple(b.gather for b in plan.buckets),
        "docs": tuple(b.docs for b in plan.buckets),
        "length": tuple(b.length for b in plan.buckets),
        "lengths": tuple(b.lengths for b in plan.buckets),
        "token_slot": plan.token_slot,
    }


def attention_plan(cu_seqlens: torch.Tensor, total_tokens: int, device_type: str) -> dict:
    """The plan of one micro-batch for kernels on ``device_type`` (see the module docstring): validated,
    ``max_seqlen``, and the bucketed plan (CPU) or the flex block tables (CUDA; flash-attn needs only
    ``max_seqlen``). Raises ValueError on malformed ``cu_seqlens``."""
    if cu_seqlens.device.type != "cpu":
        raise ValueError(f"attention_plan runs on the host copy of cu_seqlens, got a {cu_seqlens.device} tensor")
    validate_cu_seqlens(cu_seqlens, total_tokens)
    plan = {"max_seqlen": int(segment_lengths(cu_seqlens).max())}
    if device_type == "cuda":
        plan["flex"] = document_block_tables(cu_seqlens, total_tokens)
    else:
        plan["bucketed"] = bucket_plan_tree(cu_seqlens, total_tokens)
    return plan


def with_attention_plan(batch: dict, device_type: str) -> dict:
    """``batch`` (host tensors, before the device copy) plus ``attention_plan`` and ``attention_pairs``
    (``causal_pairs``) when it carries ``cu_seqlens``; other batches (a SALM's) pass unchanged."""
    cu = batch.get("cu_seqlens")
    if cu is None:
        return batch
    total = batch["input_ids"].numel()
    return batch | {"attention_plan": attention_plan(cu, total, device_type), "attention_pairs": causal_pairs(cu)}


__all__ = [
    "FLEX_BLOCK",
    "attention_plan",
    "bucket_plan_tree",
    "causal_pairs",
    "document_block_tables",
    "segment_lengths",
    "with_attention_plan",
]
