"""``CausalLMLoss``: the module the trainer trains, a transformers causal LM whose forward returns its loss.

Why a wrapper: the memory-lean loss (``headrace.kernels.loss.linear_cross_entropy``) reads ``lm_head.weight``
directly instead of calling ``lm_head``, so it must run inside the forward of the FSDP2 *root* module,
where the root's pre-forward hook has unsharded embeddings, final norm and lm_head. Calling
``hf_model.model(...)`` from outside would skip that hook. The wrapper's forward runs the decoder
(``hf_model.model``), then the chunked cross-entropy: the ``[tokens, vocab]`` fp32 logits are never held,
only one ``headrace.kernels.loss`` chunk at a time (7.9x less peak memory at a 128k vocabulary, BENCHMARKS.md).

Parameter names stay transformers' own: the wrapper registers the HF model's children (``model``,
``lm_head``) under their names and keeps the HF model itself as a plain attribute (``causal_lm``), so
``state_dict`` / DCP / ``get_model_state_dict`` keys are exactly ``model.layers.0...`` and ``lm_head.weight``
and the ``hf/`` export loads with ``from_pretrained``. The HF modules are untouched and shared, not copied.

Under tensor parallelism ``lm_head.weight`` is a vocab-sharded DTensor (ColwiseParallel) and the chunked
kernel needs the full weight, so the wrapper keeps the full-logits path there: ``lm_head`` gathers the
vocab shards (``output_layouts=Replicate``) and ``F.cross_entropy`` runs on the whole logits, exactly as
before. A vocab-parallel chunked loss would remove that gather; it is not written yet.

On CUDA with the optional ``liger`` extra the loss runs through Liger's fused linear cross-entropy instead of
the chunked PyTorch kernel (``headrace.kernels.fused_loss``: the choice is said once); the chunked kernel stays the
CPU path and the fallback.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from headrace.kernels.fused_loss import linear_cross_entropy_kernel
from headrace.kernels.loss import IGNORE_INDEX, linear_cross_entropy


class CausalLMLoss(nn.Module):
    """``forward(input_ids, labels, **kwargs)`` -> summed next-token cross-entropy (fp32 scalar); with
    ``labels=None`` -> the logits. ``kwargs`` go to the decoder (position ids, packed-attention metadata).
    Labels are already next-token aligned (dataio packing shifts them; -100 where no loss is taken)."""

    def __init__(self, causal_lm: nn.Module, chunk_size: int | None = None):
        super().__init__()
        head = causal_lm.get_output_embeddings()
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise ValueError(
                f"CausalLMLoss: the lm_head must be an nn.Linear without bias (the chunked loss reads "
                f"only its weight), got {head!r}"
            )
        for name, child in causal_lm.named_children():  # same FQNs as the HF model: "model.*", "lm_head.*"
            self.add_module(name, child)
        # The decoder and the head under the family's own names (GPT-NeoX: gpt_neox / embed_out).
        object.__setattr__(self, "decoder", causal_lm.base_model)
        object.__setattr__(self, "head", head)
        object.__setattr__(self, "causal_lm", causal_lm)  # kept for HF methods (init, config), not a submodule
        self.config = causal_lm.config
        self.chunk_size = chunk_size  # tokens per logits chunk; None: headrace.kernels.loss's default (128 MiB of fp32)
        self.router_aux_loss = (
            None  # MoE: (router_logits, labels) -> summed aux term (headrace.training.distributed.moe sets it)
        )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        aux = self.router_aux_loss is not None and labels is not None
        if aux:
            kwargs["output_router_logits"] = True
        out = self.decoder(input_ids=input_ids, use_cache=False, **kwargs)
        hidden = out.last_hidden_state
        if labels is None:
            return self.head(hidden)
        loss_sum = lm_head_loss_sum(self.head, hidden, labels, self.chunk_size)
        return loss_sum + self.router_aux_loss(out.router_logits, labels) if aux else loss_sum


def lm_head_loss_sum(
    lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """Summed cross-entropy of ``lm_head(hidden)`` against ``labels``: Liger's fused kernel (CUDA, ``liger`` extra)
    or the chunked kernel, or full logits when the lm_head is vocab-sharded (TP). Call it inside the forward of
    the module whose FSDP2 unshard covers ``lm_head`` (``CausalLMLoss``, or the pipeline's last stage)."""
    weight = lm_head.weight
    if isinstance(weight, DTensor):  # TP: vocab-sharded lm_head, see the module docstring
        logits = lm_head(hidden)
        return F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
    fused = linear_cross_entropy_kernel(hidden.device.type)
    if fused is not None:
        return fused(hidden, weight, labels)
    loss_sum, _ = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
    return loss_sum


def unwrap_ddp(model: nn.Module) -> nn.Module:
    """The module DDP wraps (``model`` itself when not DDP: FSDP2 and TP change modules in place)."""
    return getattr(model, "module", model)


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside ``model`` (a ``CausalLMLoss``, possibly wrapped by DDP, or a bare HF model)."""
    model = unwrap_ddp(model)
    return getattr(model, "causal_lm", model)


def bf16_autocast(device_type: str, enabled: bool):
    """The bf16 ``torch.autocast`` context of a loss forward when ``enabled`` (``headrace.training.step.uses_autocast``),
    else a no-op context."""
    return torch.autocast(device_type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


__all__ = ["CausalLMLoss", "bf16_autocast", "lm_head_loss_sum", "unwrap_causal_lm", "unwrap_ddp"]
