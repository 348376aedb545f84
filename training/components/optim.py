"""AdamW, the warmup + cosine learning-rate schedule, and DTensor-aware gradient clipping.

The schedule is a pure function of the step (``lr_at``), so the scheduler's checkpoint state is the step
itself: nothing to save that could disagree with it. Clipping groups gradients by (mesh, placements),
takes one norm per group (a DTensor norm is one collective), and scales in place by
``min(1, max_norm / (norm + eps))`` computed on the device: the host never reads the norm, so the step
does not wait for the GPU here (the norm is read with the other metrics once per log window). Plain
tensors (DDP, single process) are one group; a DTensor group is scaled through its local shards, which
scales the DTensor (the coefficient is the same on every rank).

AdamW's kernel (``optimizer_impl``): ``fused`` (one kernel per parameter group and dtype) when every
parameter is on one device type (CUDA or CPU) and of one tensor type, else ``foreach``; a mix of DTensors and
plain tensors (TP-only runs keep norms as plain tensors) allows neither and falls back to the per-parameter loop.
Fused is also what skips a non-finite step without a host read (its ``found_inf``,
``headrace.training.components.nonfinite``). The
choice and its reason are printed once by rank 0 (``build_optimizer``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from headrace.training.config.job_config import OptimConfig


def optimizer_impl(params: list[torch.Tensor]) -> tuple[str, str]:
    """``(impl, reason)``: ``fused``, ``foreach`` or ``for-loop`` for AdamW over ``params`` (module docstring)."""
    if len({type(p) for p in params}) > 1:
        return "for-loop", "parameters mix DTensors and plain tensors (foreach/fused kernels cannot take both)"
    devices = {p.device.type for p in params}
    if len(devices) != 1 or not devices <= {"cuda", "cpu"}:
        return "foreach", f"fused AdamW needs one device type, CPU or CUDA (parameters on {', '.join(sorted(devices))})"
    return "fused", f"every parameter on {devices.pop().upper()}, one tensor type"


def build_optimizer(model: nn.Module, cfg: OptimConfig, announce: bool = True) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norm gains and biases are not decayed); its kernel from
    ``optimizer_impl``, said once by rank 0 when ``announce``."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # LoRA trains matrices only; DCP cannot flatten an empty group
    impl, reason = optimizer_impl(decay + no_decay)
    if announce and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        print(f"AdamW: {impl} ({reason})", flush=True)
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=impl == "foreach", fused=impl == "fused" or None
    )


def lr_at(step: int, cfg: OptimConfig, max_steps: int, budget_spent: float = 0.0) -> float:
    """Linear warmup over ``warmup_steps`` (step 1 gets lr/warmup), then cosine down to ``lr * min_lr_ratio``:
    over the steps after warmup (``schedule: steps``), or over the wall-clock budget (``schedule: minutes``:
    ``budget_spent`` is the fraction of ``trainer.max_minutes`` gone, so a run the clock stops ends at the floor
    whatever its step rate)."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "minutes":
        progress = min(1.0, max(0.0, budget_spent))
    else:
        decay_steps = cfg.decay_steps or max(1, max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float | None, pp_group=None) -> torch.Tensor:
    """Global L2 norm of all gradients (sharded or not), an fp32 scalar on their device; when ``max_norm`` is
    given they are scaled by ``min(1, max_norm / (norm + 1e-6))`` without the host reading the norm.
    ``pp_group``: the pipeline group, whose ranks hold different stages; their squared norms are summed."""
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else (None, None)
        groups.setdefault(key, []).append(g)
    total_sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq += norm.float() ** 2
    if pp_group is not None:
        torch.distributed.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm is not None and grads:
        clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for group in groups.values():
            local = [g.to_local() if isinstance(g, DTensor) else g for g in group]  # no_grad: the shards themselves
            torch._foreach_mul_(local, clip_coef)
    return total


__all__ = ["build_optimizer", "clip_grad_norm", "lr_at", "optimizer_impl", "set_lr"]
