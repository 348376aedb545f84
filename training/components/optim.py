"""AdamW, the warmup + cosine learning-rate schedule, and DTensor-aware gradient clipping.

The schedule is a pure function of the step (``lr_at``), so the scheduler's checkpoint state is the step
itself: nothing to save that could disagree with it. Clipping groups gradients by (mesh, placements),
takes one norm per group (a DTensor norm is one collective), and scales in place; plain tensors (DDP,
single process) are one group.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from training.config.job_config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norm gains and biases are not decayed)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach kernels cannot mix DTensors from different meshes (TP-only runs keep norms as plain tensors)
    mixed = len({type(p) for p in decay + no_decay}) > 1
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=not mixed)


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup over ``warmup_steps`` (step 1 gets lr/warmup), then cosine down to ``lr * min_lr_ratio``."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = cfg.decay_steps or max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float | None, pp_group=None) -> float:
    """Global L2 norm of all gradients (sharded or not); scale them down to ``max_norm`` when given.
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
    total = total_sq.sqrt().item()
    if max_norm is not None and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(scale)
    return total


__all__ = ["build_optimizer", "clip_grad_norm", "lr_at", "set_lr"]
