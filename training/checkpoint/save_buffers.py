"""Host buffers of ``async_with_pinned_mem`` saves, allocated when the run starts rather than at its first save.

Such a save copies the state into host buffers kept from save to save (``saver.stage``); allocated (and
page-locked, with CUDA) inside the first save, they made that save stall 0.15-0.20 of a blocking one (issue 33,
BENCHMARKS.md "Checkpoint saves"). ``allocate_save_buffers`` stages the state a save will take once, before the
first step, so every buffer exists (its pages touched, pinned) before any save. The optimizer's state is part of
it, and AdamW creates its moments at its first step: a fresh optimizer gets them here through DCP's own
initialisation (``get_state_dict``: one step with zero gradients at lr 0, parameters unchanged), after which the
step counts are put back to 0, so the optimizer is exactly a fresh one (zero moments, step 0). Cost: one copy of
the state into buffers it allocates, at start; nothing on the step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from headrace.training.checkpoint.layout import FLAT_OPTIONS, TRAINABLE_OPTIONS, split_state
from headrace.training.checkpoint.saver import Saver, stage, unshared
from headrace.training.models.float8 import high_precision_weights


def allocate_save_buffers(
    saver: Saver, model: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool
) -> int:
    """Fill ``saver``'s kept buffers (``async_with_pinned_mem`` only) with the state ``Saver.save`` will stage;
    returns their bytes (0 for the other modes). ``trainable_only``: as ``Saver.save``'s."""
    if saver.buffers is None:
        return 0
    fresh = not optimizer.state
    model_state, optim_state = get_state_dict(
        model, optimizer, options=TRAINABLE_OPTIONS if trainable_only else FLAT_OPTIONS
    )
    if fresh:  # DCP's initialising step counted one: back to a fresh optimizer's 0
        for state in optimizer.state.values():
            state["step"].zero_()
    tensors, _ = split_state(high_precision_weights(model_state), optim_state)
    stage(unshared(tensors), saver.buffers, pin=True)
    return sum(b.numel() * b.element_size() for b in saver.buffers.values())


__all__ = ["allocate_save_buffers"]
