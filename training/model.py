"""Build a transformers causal LM without ever holding the whole model on one rank.

The model is created on the meta device (no memory), parallelized there (TP / FSDP2 turn parameters into
DTensor shards), then ``to_empty`` allocates each rank's shard only, and the weights are filled in place:
either transformers' own ``_init_weights`` (random ops on DTensors draw per-shard values; RoPE buffers are
recomputed) or a local safetensors checkpoint read through DCP's ``HuggingFaceStorageReader``, which
copies only the slices each rank owns, file by file. Peak memory per rank is its shard plus one tensor.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from kernels.hf_attention import ATTENTION_NAME, register_varlen_attention
from training.config import ModelConfig
from training.loss import unwrap_causal_lm
from training.parallelize import PARALLELIZE_FNS

SUPPORTED_MODEL_TYPES = tuple(PARALLELIZE_FNS)  # a family is supported when it has a parallelize function


def build_hf_config(cfg: ModelConfig) -> PretrainedConfig:
    """The transformers config from inline YAML fields, a local config.json, or a pretrained directory."""
    if cfg.config is not None:
        fields = dict(cfg.config)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError("model.config needs a model_type (e.g. llama, qwen2, qwen3)")
        config = AutoConfig.for_model(model_type, **fields)
    else:
        path = cfg.config_path or cfg.pretrained_path
        if os.path.isfile(path):
            with open(path) as f:
                fields = json.load(f)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        else:
            config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {config.model_type!r} has no parallelize function yet "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if cfg.init_std is not None:
        config.initializer_range = cfg.init_std
    if cfg.attn_implementation == ATTENTION_NAME:
        register_varlen_attention()
    config._attn_implementation = cfg.attn_implementation
    return config


def build_meta_model(config: PretrainedConfig) -> nn.Module:
    """The model's module tree with every parameter on the meta device (fp32 master weights)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                attn_implementation=config._attn_implementation)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, pretrained_path: str | None = None) -> None:
    """Allocate each rank's (already sharded) parameters on ``device``, then initialize or load them."""
    model.to_empty(device=device)
    for module in model.modules():  # to_empty left garbage, so nothing is initialized yet
        module._is_hf_initialized = False
    hf = unwrap_causal_lm(model)
    hf.initialize_weights()  # also recomputes the non-persistent RoPE buffers
    hf.tie_weights()
    if pretrained_path is not None:
        load_safetensors(model, pretrained_path)


def load_safetensors(model: nn.Module, path: str) -> None:
    """Fill ``model`` (plain, FSDP2 or TP-sharded) from a HF safetensors directory, each rank its own slices."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    if getattr(getattr(unwrap_causal_lm(model), "config", None), "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the checkpoint stores only the embedding
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def count_params(config: PretrainedConfig) -> tuple[int, int]:
    """(all parameters, parameters outside the embeddings) computed on the meta device."""
    meta = build_meta_model(config)
    total = sum(p.numel() for p in meta.parameters())
    embed = meta.get_input_embeddings().weight.numel()
    return total, total - embed


__all__ = ["SUPPORTED_MODEL_TYPES", "build_hf_config", "build_meta_model", "count_params", "load_safetensors",
           "materialize"]
