"""The lm_head loss through a maintained fused kernel on CUDA: Liger Kernel's fused linear cross-entropy.

``linear_cross_entropy_kernel(device_type)`` picks how ``headrace.training.models.loss.lm_head_loss_sum`` computes the summed
cross-entropy of ``hidden @ weight.T``: on CUDA with the optional ``liger`` extra installed
(``pip install 'headrace[liger]'``: ``liger-kernel``, Triton), ``LigerFusedLinearCrossEntropyLoss`` (Triton
kernels that compute each chunk's logits, loss and gradients in place, no fp32 ``[tokens, vocab]`` logits
and no per-chunk fp32 weight-gradient adds); otherwise (CPU, no Liger, no Triton)
``headrace.kernels.loss.linear_cross_entropy``, the chunked PyTorch path. The choice and its reason are printed
once per device type. Liger runs in the dtype it is given: both operands are cast to the autocast dtype
when autocast is on (as ``lm_head`` would run), else to their common dtype.

Cost beside the kernel: Liger reads its label count to the host (``target_mask.sum().item()`` in
``liger_kernel/ops/fused_linear_cross_entropy.py``, 0.8.5), one GPU sync per micro-batch that the
chunked path does not have; whether the fused kernel's saving outweighs it is for the GPU measurement.

Not yet measured on a GPU (no GPU was lent while this was written): the issue's target is Liger vs the
chunked path vs full logits at 8k tokens x 128k vocabulary (``tools.bench_kernels``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

from headrace.kernels.loss import IGNORE_INDEX


def liger_loss_class():
    """Liger's ``LigerFusedLinearCrossEntropyLoss``, or None when it (or Triton) does not import."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss


def choose_kernel(device_type: str) -> tuple[str, str]:
    """``(kernel, reason)``: ``liger`` or ``chunked`` for hidden states on ``device_type``."""
    if device_type != "cuda":
        return "chunked", f"Liger's Triton kernels run on CUDA only (device {device_type})"
    if liger_loss_class() is None:
        return "chunked", "liger-kernel is not installed (pip install 'headrace[liger]')"
    return "liger", "CUDA and liger-kernel installed"


@lru_cache(maxsize=None)
def linear_cross_entropy_kernel(device_type: str) -> Callable | None:
    """Liger's summed fused linear cross-entropy ``fn(hidden, weight, labels) -> loss_sum`` when ``choose_kernel``
    picks it, else None (use the chunked path); says the choice once per device type."""
    kernel, reason = choose_kernel(device_type)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"lm_head loss: {kernel} ({reason})", flush=True)
    if kernel != "liger":
        return None
    loss = liger_loss_class()(ignore_index=IGNORE_INDEX, reduction="sum")

    def liger_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(hidden.device.type):
            dtype = torch.get_autocast_dtype(hidden.device.type)
        else:
            dtype = torch.promote_types(hidden.dtype, weight.dtype)
        flat = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
        return loss(weight.to(dtype), flat, labels.reshape(-1)).float()

    return liger_loss_sum


__all__ = ["choose_kernel", "linear_cross_entropy_kernel", "liger_loss_class"]
