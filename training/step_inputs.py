"""What the step needs about a batch's layout, computed on the host before the device copy, and the one read
of the step's figures per log window.

``step_batch_transform``: the prefetcher's host-side transform of this rank's training batches (it runs in
the read-ahead thread, ``headrace.dataio.feed.prefetch``): this rank's CP shard when cp > 1, and on every packed
batch ``attention_pairs`` (``headrace.kernels.packed_layout.causal_pairs`` of the whole batch: the attention work its
document masks require, for the document-masked MFU) and, without CP, ``attention_plan`` (the kernels'
checks and plans; with CP, ``headrace.kernels.cp_attention`` plans the shard itself). Cost: O(documents) numpy work
plus, on CPU, the bucket index tensors (O(tokens)) per batch, off the training thread.

``read_step_stats``: ``train_step`` returns device scalars (loss, grad norm, token count) so the step never
waits for the device; the log step reads them together, in one copy. ``DeferredRecords`` keeps even that
read from blocking on CUDA: the log step starts a non-blocking copy of the record's device scalars into
pinned memory and the record is written one window later, when the next log step (or the end) comes and
the copy has long finished; on CPU the record is written at once (nothing to wait for).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from headrace.kernels.packed_layout import causal_pairs, with_attention_plan
from headrace.training.distributed.context_parallel import rank_batch_transform


def step_batch_transform(dims, device_type: str) -> Callable[[dict], dict]:
    """The host-side transform of this rank's training batches (see the module docstring)."""
    cp_shard = rank_batch_transform(dims)

    def transform(batch: dict) -> dict:
        if "cu_seqlens" not in batch:  # not a packed batch (a SALM's): nothing to plan
            return cp_shard(batch) if cp_shard is not None else batch
        if cp_shard is not None:
            return cp_shard(batch) | {"attention_pairs": causal_pairs(batch["cu_seqlens"])}
        return with_attention_plan(batch, device_type)

    return transform


class DeferredRecords:
    """Write metric records whose device-scalar values are read one log window later on CUDA (module docstring).
    ``write(record)`` is called with the finished record (host values only)."""

    def __init__(self, device: torch.device, write: Callable[[dict], None]):
        self.device, self.cuda, self.write = device, device.type == "cuda", write
        self.pending: tuple | None = None  # (record, tensor keys, pinned host copy, copy-done event)

    def push(self, record: dict) -> None:
        """Start reading ``record``'s tensors; write the previous record (CUDA) or this one (CPU)."""
        if not self.cuda:
            self.write(read_step_stats(record))
            return
        keys = [key for key, value in record.items() if isinstance(value, torch.Tensor)]
        values = torch.stack([record[key].detach().to(self.device, torch.float64) for key in keys])
        pinned = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        pinned.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.flush()
        self.pending = (record, keys, pinned, event)

    def flush(self) -> None:
        """Write the record still pending (waits for its copy, long done by the next window)."""
        if self.pending is None:
            return
        record, keys, pinned, event = self.pending
        self.pending = None
        event.synchronize()
        record = record | dict(zip(keys, pinned.tolist()))
        record["tokens"] = int(record["tokens"])
        self.write(record)


def read_step_stats(stats: dict) -> dict:
    """``stats`` with every tensor value read to the host in one copy (floats; ``tokens`` an int)."""
    keys = [key for key, value in stats.items() if isinstance(value, torch.Tensor)]
    values = torch.stack([stats[key].detach().to(torch.float64) for key in keys]).tolist() if keys else []
    out = stats | dict(zip(keys, values))
    out["tokens"] = int(out["tokens"])
    return out


__all__ = ["DeferredRecords", "read_step_stats", "step_batch_transform"]
