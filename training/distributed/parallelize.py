"""Parallelize a model on the meta device: check the layout against the model, then run its family's recipe.

Recipes, by ``config.model_type``: the MoE families (``MOE_MODEL_TYPES``) ``headrace.training.distributed.moe``
(expert parallelism, grouped experts, then the dense recipe); every other causal LM
``headrace.training.distributed.dense`` (TP/SP -> AC -> compile -> FSDP2/HSDP); a SALM's is
``headrace.training.speech.parallelize``. The trainer and each pipeline stage call ``parallelize``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from headrace.config import ConfigError
from headrace.training.config.job_config import DistributedConfig
from headrace.training.distributed.dense import parallelize_decoder_lm
from headrace.training.distributed.moe import parallelize_moe_lm
from headrace.training.distributed.parallel_dims import ParallelDims
from headrace.training.distributed.tensor_parallel import check_hf_tp_plan
from headrace.training.models.families import LLAMA_LIKE, MOE_MODEL_TYPES, OWN_TP_PLAN


def check_supported(dims: ParallelDims, hf_config) -> None:
    """Fail before building anything when the layout asks for what is not implemented or cannot split."""
    if dims.ep > 1 and hf_config.model_type not in MOE_MODEL_TYPES:
        raise ConfigError(
            f"distributed.ep_size={dims.ep} needs a mixture-of-experts model "
            f"({', '.join(MOE_MODEL_TYPES)}); {hf_config.model_type!r} has no experts"
        )
    if dims.tp > 1:
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads or hf_config.num_attention_heads
        if heads % dims.tp or kv_heads % dims.tp:
            raise ConfigError(
                f"tp_size {dims.tp} must divide num_attention_heads {heads} and num_key_value_heads {kv_heads}"
            )
        if hf_config.model_type not in OWN_TP_PLAN:
            check_hf_tp_plan(hf_config, dims.sequence_parallel)


PARALLELIZE_FNS: dict[str, Callable[..., nn.Module]] = {
    **dict.fromkeys(LLAMA_LIKE, parallelize_decoder_lm),
    **dict.fromkeys(MOE_MODEL_TYPES, parallelize_moe_lm),
}


def parallelize(
    model: nn.Module, dims: ParallelDims, cfg: DistributedConfig, param_dtype: torch.dtype, after_tp=None
) -> nn.Module:
    """Dispatch on ``config.model_type`` to the family's parallelize function (generic by default);
    ``after_tp(model)``: the model converters' hook after TP (``headrace.training.models.converters``)."""
    check_supported(dims, model.config)
    fn = PARALLELIZE_FNS.get(model.config.model_type, parallelize_decoder_lm)
    return fn(model, dims, cfg, param_dtype, after_tp=after_tp)


__all__ = ["PARALLELIZE_FNS", "check_supported", "parallelize"]
