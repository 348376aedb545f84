"""One training step: forward, loss, backward, optimizer step; the trainer's loop and validation both use it.

``train_step`` runs ``grad_accum`` packed THD micro-batches, ``pipeline_train_step`` the same step through a
pipeline schedule (``headrace.training.distributed.pipeline``). The loss is a sum of token cross-entropies divided by
the number of real tokens (labels != -100) in the whole global batch: that count is all-reduced over the loss
mesh (dp x cp) *before* the first backward, so every micro-step's gradient is already correctly scaled and
the result does not depend on how tokens split across micro-steps or ranks. FSDP2 and DDP average
gradients over dp, so each rank's loss is multiplied by the dp x cp size to make that average a sum.
Gradients are reduced only on the last micro-step (``defer_fsdp_grad_sync``).

``forward_loss_sum`` is the causal LM's forward (its model kind picks a job's forward,
``headrace.training.protocols.model_kind``) and ``uses_autocast`` the bf16 rule; validation runs the same forward
without autograd.
The loss is all-reduced before the update: a step whose global loss or grad norm is not finite is skipped on every
rank (``headrace.training.components.nonfinite``), and ``skipped`` (a device 0/1) says so.
Cost per step: one all-reduce of the token count and one of the loss, besides the model's own collectives.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from headrace.kernels.hf_attention import packed_attention_kwargs
from headrace.kernels.loss import IGNORE_INDEX
from headrace.training.components.nonfinite import skip_if_nonfinite
from headrace.training.components.optim import clip_grad_norm
from headrace.training.config.job_config import JobConfig
from headrace.training.distributed.pipeline import Pipeline, run_schedule
from headrace.training.models.loss import bf16_autocast

STEP_INPUTS = (
    "input_ids",
    "labels",
    "position_ids",
    "cu_seqlens",
    "max_seqlen",
    "fill",  # what a step reads
    "attention_plan",
    "attention_pairs",  # + the host-made layout (headrace.training.step_inputs)
    "audio",
    "audio_lens",
    "audio_mask",  # + a SALM's (headrace.training.speech)
    "cp_imbalance",
    "skipped_conversations",  # + the packer's count of conversations left out (metrics only)
)  # + context parallelism's (headrace.training.distributed.context_parallel)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Reduce gradients in this backward only when ``enabled`` (FSDP2 and DDP; a no-op otherwise)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    elif isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    else:
        yield


def forward_loss_sum(
    model: nn.Module, batch: dict, autocast: bool, attention_kwargs: dict | None = None
) -> torch.Tensor:
    """Summed next-token cross-entropy of one packed micro-batch through a ``CausalLMLoss`` (labels are
    already shifted). ``attention_kwargs``: extra attention kwargs (the CP group,
    ``headrace.training.distributed.context_parallel``)."""
    with bf16_autocast(batch["input_ids"].device.type, autocast):
        return model(
            input_ids=batch["input_ids"],
            labels=batch["labels"],
            **packed_attention_kwargs(batch),
            **(attention_kwargs or {}),
        )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict],
    loss_mesh: DeviceMesh,
    *,
    max_grad_norm: float | None,
    defer_grad_sync: bool,
    autocast: bool,
    forward: Callable[[nn.Module, dict, bool], torch.Tensor] = forward_loss_sum,
) -> dict:
    """One optimizer step over ``micro_batches``; returns the global mean loss, grad norm and token count as
    device scalars (the host reads them once per log window, ``headrace.training.step_inputs``): nothing here waits
    for the device. ``forward(model, micro_batch, autocast)`` gives a micro-batch's summed loss."""
    group = loss_mesh.get_group()
    global_tokens = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches).to(torch.float64)
    dist.all_reduce(global_tokens, group=group)
    scale = (loss_mesh.size() / global_tokens.clamp(min=1)).float()
    loss_sum = torch.zeros((), dtype=torch.float64, device=global_tokens.device)
    for i, mb in enumerate(micro_batches):
        with gradient_sync(model, i == len(micro_batches) - 1 or not defer_grad_sync):
            loss = forward(model, mb, autocast)
            (loss * scale).backward()
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum, group=group)  # before the update: the non-finite guard reads the global loss
    grad_norm = clip_grad_norm(model.parameters(), max_grad_norm)
    skipped = skip_if_nonfinite(optimizer, loss_sum, grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return {
        "loss": loss_sum / global_tokens.clamp(min=1),
        "grad_norm": grad_norm,
        "tokens": global_tokens,
        "skipped": skipped,
    }


def pipeline_train_step(
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict],
    loss_mesh: DeviceMesh,
    *,
    max_grad_norm: float | None,
) -> dict:
    """``train_step`` for a pipeline: same token scaling, same returned figures (global loss, grad norm
    over all stages, real-token count); also fills ``pipe.stats`` with this rank's timing and memory."""

    start, busy_before = time.perf_counter(), pipe.timer.busy
    batch = {k: torch.cat([mb[k] for mb in micro_batches]) for k in ("input_ids", "labels", "position_ids")}
    global_tokens = (batch["labels"] != IGNORE_INDEX).sum().to(torch.float64)
    dist.all_reduce(global_tokens, group=loss_mesh.get_group())
    pipe.loss.scale = loss_mesh.size() / global_tokens.clamp(min=1).item()
    if pipe.scale_grads_in_schedule:  # the schedule divides every gradient by the microbatch count
        pipe.loss.scale *= pipe.n_microbatches
    losses = run_schedule(pipe, batch, train=True)
    loss_sum = (
        torch.stack(losses).detach().to(torch.float64).sum() / pipe.loss.scale
        if losses
        else torch.zeros((), dtype=torch.float64, device=global_tokens.device)
    )
    dist.all_reduce(loss_sum, group=loss_mesh.get_group())
    dist.all_reduce(loss_sum, group=pipe.pp_mesh.get_group())  # only the last stage's ranks hold losses
    grad_norm = clip_grad_norm(pipe.part.parameters(), max_grad_norm, pp_group=pipe.pp_mesh.get_group())
    skipped = skip_if_nonfinite(optimizer, loss_sum, grad_norm)
    optimizer.zero_grad(set_to_none=True)
    wall = time.perf_counter() - start
    pipe.stats = {"step_s": wall, "busy_s": pipe.timer.busy - busy_before}
    return {
        "loss": (loss_sum / global_tokens.clamp(min=1)).item(),
        "grad_norm": grad_norm,
        "tokens": int(global_tokens.item()),
        "skipped": skipped,
    }


def next_micro_batches(batches: Iterator[dict], count: int) -> list[dict]:
    """The next ``count`` batches (already on the device), keeping only what the step reads."""
    return [{k: v for k, v in next(batches).items() if k in STEP_INPUTS} for _ in range(count)]


def uses_autocast(cfg: JobConfig, model: nn.Module) -> bool:
    """bf16 through ``torch.autocast``: on every model but an FSDP2 one, which casts via its policy."""
    return cfg.trainer.precision == "bf16" and not isinstance(model, FSDPModule)


@contextlib.contextmanager
def eval_mode(module: nn.Module):
    """``module`` in eval mode inside the block (dropout, SpecAugment off), its mode restored after."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


__all__ = [
    "STEP_INPUTS",
    "eval_mode",
    "forward_loss_sum",
    "gradient_sync",
    "next_micro_batches",
    "pipeline_train_step",
    "train_step",
    "uses_autocast",
]
