"""Parallelize a SALM on the meta device, in the fixed order of ``headrace.training.distributed.dense``:

1. TP (+SP) on the LLM only, with the text-decoder plan (``apply_tp``) except that the embedding's output
   stays replicated: the audio frames are written into the full sequence before SP splits it
   (``SpeechLMLoss``). The encoder and adapter are small next to the LLM and stay data-parallel only
   (the seed's rule: FSDP2 for the encoder).
2. activation checkpointing of encoder and LLM blocks (every N-th),
3. FSDP2 per block of the encoder and of the LLM, then each of them as a unit (the LLM's unit holds
   embedding / norm / lm_head, unsharded for its whole forward), then the SALM root (the adapter).
Frozen parts are sharded like the others (FSDP2 keeps per-parameter ``requires_grad``); the optimizer
only sees trainable parameters.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

from headrace.training.config.job_config import DistributedConfig
from headrace.training.distributed.parallel_dims import ParallelDims
from headrace.training.distributed.dense import apply_ac, apply_fsdp, uses_fsdp
from headrace.training.distributed.parallelize import check_supported
from headrace.training.distributed.tensor_parallel import apply_tp
from headrace.training.speech.model import SALM


def parallelize_salm(
    model: SALM, dims: ParallelDims, cfg: DistributedConfig, param_dtype: torch.dtype, after_tp=None
) -> SALM:
    """``after_tp(model)``: the model converters' hook after TP (LoRA on the LLM and/or encoder;
    ``headrace.training.models.converters``)."""
    check_supported(dims, model.config)
    if dims.tp_enabled:
        apply_tp(model.llm, dims.get_mesh("tp"), dims.sequence_parallel, embed_output=Replicate())
        if dims.sequence_parallel:
            model.llm.sequence_mesh = dims.get_mesh("tp")
    if after_tp is not None:
        after_tp(model)
    parts = [(model.encoder, model.encoder.layers), (model.llm, model.llm.model.layers)]
    for _, blocks in parts:
        apply_ac(blocks, cfg)
    if uses_fsdp(dims, cfg, param_dtype):
        for module, blocks in parts:
            apply_fsdp(module, blocks, dims.get_mesh("fsdp"), param_dtype, cfg.reshard_after_forward)
        apply_fsdp(model, [], dims.get_mesh("fsdp"), param_dtype, cfg.reshard_after_forward)
    return model


__all__ = ["parallelize_salm"]
