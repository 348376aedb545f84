"""Memory-lean causal-LM loss: cross-entropy straight from final hidden states and the lm_head weight.

``loss_sum, num_tokens = linear_cross_entropy(hidden, lm_head.weight, labels)`` equals
``F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100, reduction="sum")`` and the count of
labels != -100, without ever holding the fp32 ``[tokens, vocab]`` logits: tokens are processed in
chunks of ``chunk_size`` rows (default: as many as fit ``_CHUNK_BYTES`` of fp32 logits).

Algorithm (the fused linear-cross-entropy trick): the forward pass, for each chunk, computes the
logits, their logsumexp and the target logit, and — when gradients are needed — immediately the
chunk's gradients ``softmax - onehot`` times ``weight`` (for hidden) and accumulated into an fp32
weight gradient. Backward only scales these by the incoming scalar gradient. Cost: 3 matmuls per
chunk (the reference's forward + backward also does 3) and no recompute; memory: one fp32 chunk of
logits plus a hidden-sized and a weight-sized gradient buffer, against ~3 full fp32 logit tensors
for the reference (logits, log-softmax, its gradient). Trade-off: the gradients are computed even
if ``backward`` is never called, so run evaluation under ``torch.no_grad()`` (which skips them).

Labels are already next-token aligned (dataio packing shifts them; -100 on document ends and
padding). Return the *sum* and the count so the trainer can normalise by real tokens across
micro-steps and data-parallel ranks: ``loss = loss_sum / global_num_tokens``.

The weight must be the full (unsharded) lm_head weight: under FSDP2 call this inside the wrapped
module's forward (where the parameter is unsharded); a vocab-sharded (TP) lm_head needs a
vocab-parallel loss, which this is not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
_CHUNK_BYTES = 128 << 20  # fp32 logits per chunk: 256 tokens at a 128k vocabulary, 1024 at 32k


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle: full fp32 logits, ``F.cross_entropy(reduction="sum")``; returns (loss_sum, num_tokens)."""
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.T).float()
    labels = labels.reshape(-1)
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return loss, (labels != ignore_index).sum()


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token cross-entropy of ``hidden @ weight.T`` against ``labels``, chunked over tokens.

    ``hidden``: ``(..., H)`` final hidden states (after the last norm); ``weight``: ``(V, H)``;
    ``labels``: ``(...)`` next-token ids with ``ignore_index`` where no loss is taken. Returns
    ``(loss_sum, num_tokens)``: an fp32 scalar differentiable w.r.t. ``hidden`` and ``weight``, and
    the int64 count of labelled tokens.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (vocab, {hidden.shape[-1]}), got {tuple(weight.shape)}")
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_BYTES // (4 * weight.shape[0]))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    # Matmuls run in the dtype lm_head would use: the autocast dtype when autocast is on, else the inputs'.
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    flat_labels = labels.reshape(-1)
    loss = _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, flat_labels, chunk_size, ignore_index, compute_dtype
    )
    return loss, (flat_labels != ignore_index).sum()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, compute_dtype):
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen explicitly below
            loss, grad_hidden, grad_weight = _chunked_loss_and_grads(
                hidden, weight, labels, chunk_size, ignore_index, compute_dtype, *ctx.needs_input_grad[:2]
            )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _chunked_loss_and_grads(
    hidden, weight, labels, chunk_size, ignore_index, compute_dtype, need_hidden_grad, need_weight_grad
):
    """Summed loss and, where needed, the gradients w.r.t. hidden and (fp32) weight; one chunk of logits at a time."""
    w = weight.to(compute_dtype)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden_grad else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight_grad else None
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start : start + chunk_size].to(compute_dtype)
        y = labels[start : start + chunk_size]
        valid = y != ignore_index
        target = torch.where(valid, y, 0)
        logits = (h @ w.T).float()
        target_logit = logits.gather(1, target[:, None]).squeeze(1)
        # logsumexp by hand, in place: torch.logsumexp would allocate a second chunk-sized buffer.
        row_max = logits.amax(dim=-1, keepdim=True)
        exp_logits = logits.sub_(row_max).exp_()
        sum_exp = exp_logits.sum(dim=-1)
        lse = sum_exp.log() + row_max.squeeze(1)
        loss += torch.where(valid, lse - target_logit, 0.0).sum()
        if grad_hidden is None and grad_weight is None:
            continue
        # d(loss)/d(logits) = softmax - onehot(target) on labelled rows, 0 elsewhere; built in place.
        grad_logits = exp_logits.div_(sum_exp[:, None])
        grad_logits.scatter_add_(1, target[:, None], torch.full_like(lse[:, None], -1.0))
        grad_logits = grad_logits.mul_(valid[:, None]).to(compute_dtype)
        if grad_hidden is not None:
            grad_hidden[start : start + chunk_size] = grad_logits @ w
        if grad_weight is None:
            continue
        if compute_dtype == torch.float32:  # accumulate in place, no weight-sized temporary per chunk
            grad_weight.addmm_(grad_logits.T, h)
        else:
            grad_weight += (grad_logits.T @ h).float()
    return loss, grad_hidden, grad_weight
