"""Validation: loss and perplexity of the model over the whole ``data.val`` stream, on every DP rank at once.

The val stream is the ``data:`` section with ``data.val``'s keys laid over it (typically
``datasets: [{path: ..., split: val}]``) and ``epochs: 1``: any dataset the loader reads, batched and
packed like the training data. The loader's layout (``dataio.stream.split``) gives DP rank ``r`` the global
positions ``r, r + dp, ...``, so across DP ranks every val sample is read exactly once; at the tail the
loader pads the ranks that ran out with loss-free batches (labels all -100) so that every rank runs the
same number of forwards (FSDP2's collectives) and padding adds nothing. Per batch: one forward without
autograd (the chunked loss of ``CausalLMLoss``, so no ``[tokens, vocab]`` logits); then one all-reduce of
(loss sum, labelled tokens) over the loss mesh (dp x cp) and one of the document count over dp.
``loss = sum / tokens``, ``ppl = exp(loss)``: exactly a single process's figure over the same samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from configtree import from_dict, to_dict
from dataio.config import DataConfig
from kernels.loss import IGNORE_INDEX


def val_data_config(data: DataConfig) -> DataConfig | None:
    """The ``data:`` section of the val stream (``data.val`` over ``data``, one epoch), or None without one.
    Errors name ``data.val``'s keys."""
    if data.val is None:
        return None
    raw = {k: v for k, v in to_dict(data).items() if k != "val"}
    raw.update(data.val)
    raw["epochs"] = 1
    return from_dict(DataConfig, raw, "data.val")


def documents_started(batch: dict) -> int:
    """Documents whose first piece is in ``batch`` (a document split over rows or batches counts once)."""
    return sum(offset == 0 for row in batch["__docs__"] for _, offset, _ in row)


@torch.no_grad()
def evaluate(model: nn.Module, loss_sum: Callable[[nn.Module, dict], torch.Tensor], batches: Iterable[dict],
             device: torch.device, *, loss_group=None, dp_group=None) -> dict:
    """Mean token loss, perplexity, labelled tokens and documents of ``batches`` (this rank's share of the
    val stream), reduced over ``loss_group`` (dp x cp) and ``dp_group``. A collective."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, labelled tokens
    docs = torch.zeros(1, dtype=torch.float64, device=device)
    for batch in batches:
        on_device = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                     for k, v in batch.items() if not k.startswith("__")}
        sums[0] += loss_sum(model, on_device).double()
        sums[1] += int((batch["labels"] != IGNORE_INDEX).sum())
        docs += documents_started(batch)
    model.train(was_training)
    dist.all_reduce(sums, group=loss_group)
    dist.all_reduce(docs, group=dp_group)
    loss = (sums[0] / sums[1].clamp(min=1)).item()
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": int(sums[1]),
            "val_docs": int(docs)}


def run_validation(model: nn.Module, loss_sum: Callable[[nn.Module, dict], torch.Tensor], val_cfg: DataConfig,
                   meshes: dict, device: torch.device) -> dict:
    """One pass over the val stream with a fresh loader for this rank's DP index (see the module docstring)."""
    from dataio import build_loader

    dp = meshes["dp"]
    loader = build_loader(val_cfg, dp.get_local_rank(), dp.size())
    return evaluate(model, loss_sum, loader, device, loss_group=meshes["dp_cp"].get_group(),
                    dp_group=dp.get_group())


__all__ = ["documents_started", "evaluate", "run_validation", "val_data_config"]
