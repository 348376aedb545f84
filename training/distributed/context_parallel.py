"""Context parallelism in the trainer: the per-rank batch split and the attention kwargs (its config rules:
``headrace.training.config.validate.check_cp_config``).

With ``distributed.cp_size`` P > 1 the P ranks of a CP group read the same packed batch from the loader
(they share a dp rank). ``cp_batch_transform`` runs on the host, in the prefetcher's read-ahead thread,
*before* the device copy: it keeps only this rank's head-tail chunks
(``headrace.dataio.feed.cp_split.cp_shard``, one gather per field), so no rank ever holds the whole row on the
device. The shard carries the global
``position_ids`` (RoPE sees the unsplit positions) and the local ``cu_seqlens``; ``cp_imbalance`` is the
max/mean causal attention work over the group's ranks for this batch (``attention_work``).

The loss needs no CP logic: each rank sums its tokens' cross-entropy, the real-token count is all-reduced
over dp x cp, and FSDP2 (sharding over dp_shard x cp) sums the gradients of all CP ranks.
"""

from __future__ import annotations

from collections.abc import Callable

from headrace.dataio.feed.cp_split import attention_work, cp_shard
from headrace.kernels.cp_attention import exchanged_bytes, reset_exchanged_bytes
from headrace.kernels.hf_attention import context_parallel_kwargs


def cp_batch_transform(cp_size: int, cp_rank: int) -> Callable[[dict], dict]:
    """Host-side batch -> this CP rank's shard (see the module docstring)."""

    def transform(batch: dict) -> dict:
        if "cu_seqlens" not in batch:
            raise ValueError(
                f"distributed.cp_size={cp_size} needs packed batches with cu_seqlens (data.seq_len "
                f"with packing greedy/best_fit); got a batch with keys {sorted(batch)}"
            )
        shard = cp_shard(batch, cp_size, cp_rank)
        imbalance = attention_work(batch["cu_seqlens"], cp_size)["causal"]["imbalance"]
        keep = {k: shard[k] for k in ("input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen")}
        keep["cp_imbalance"] = imbalance
        if "fill" in batch:
            keep["fill"] = batch["fill"]
        return keep

    return transform


def rank_batch_transform(dims) -> Callable[[dict], dict] | None:
    """The host-side transform of this rank's batches (training and validation): its CP shard when cp > 1."""
    return cp_batch_transform(dims.cp, dims.get_mesh("cp").get_local_rank()) if dims.cp_enabled else None


def cp_attention_kwargs(mesh, mode: str) -> dict:
    """Extra model kwargs: the CP group when there is one, else nothing."""
    return context_parallel_kwargs(mesh.get_group(), mode) if mesh.size() > 1 else {}


def cp_step_metrics(micro_batches: list[dict]) -> dict:
    """``cp_imbalance``: the step's mean per-batch work imbalance; ``cp_bytes_sent``: bytes this rank sent for
    attention since the trainer's last ``reset_exchanged_bytes()`` (once per step)."""
    return {
        "cp_imbalance": sum(mb["cp_imbalance"] for mb in micro_batches) / len(micro_batches),
        "cp_bytes_sent": exchanged_bytes(),
    }


__all__ = [
    "cp_attention_kwargs",
    "cp_batch_transform",
    "cp_step_metrics",
    "rank_batch_transform",
    "reset_exchanged_bytes",
]
