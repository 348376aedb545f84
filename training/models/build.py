"""Build a transformers causal LM without ever holding the whole model on one rank.

The model is created on the meta device (no memory), parallelized there (TP / FSDP2 turn parameters into
DTensor shards), then ``to_empty`` allocates each rank's shard only, and the weights are filled in place:
either transformers' own ``_init_weights`` (random ops on DTensors draw per-shard values; RoPE buffers are
recomputed) or a local safetensors checkpoint read through DCP's ``HuggingFaceStorageReader``, which
copies only the slices each rank owns, file by file (MoE experts stored fused or per expert, as the hub has
them: ``headrace.training.models.hf_experts``). Peak memory per rank is its shard plus one tensor.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from headrace.config import ConfigError
from headrace.training.errors import refused_as

from headrace.kernels.hf_attention import ATTENTION_NAME, register_varlen_attention
from headrace.training.config.job_config import JobConfig, ModelConfig
from headrace.training.dir_files import file_inside, files_inside, read_json_object
from headrace.training.errors import JobInputError
from headrace.training.models.families import check_family, supports_packed_attention
from headrace.training.models.hf_experts import per_expert_views, renamed
from headrace.training.models.loss import unwrap_causal_lm


def build_hf_config(cfg: ModelConfig, *, text_model: bool = False) -> PretrainedConfig:
    """The transformers config from inline YAML fields, a local config.json, or a pretrained directory;
    ``text_model``: its text decoder's (a SALM's LLM may be the text model of a speech LLM: Qwen2-Audio's
    ``text_config``)."""
    if cfg.config is not None:
        fields = dict(cfg.config)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ConfigError("model.config needs a model_type (e.g. llama, qwen2, qwen3)")
        config = config_or_error(lambda: AutoConfig.for_model(model_type, **fields), "model.config")
    else:
        path = cfg.config_path or cfg.pretrained_path
        key = "model.config_path" if cfg.config_path else "model.pretrained_path"
        file = path if os.path.isfile(path) else file_inside(path, "config.json") if os.path.isdir(path) else None
        if file is None:
            raise ConfigError(f"{key}: {path} is neither a config.json file nor a directory holding one")
        fields = read_json_object(file)
        if not isinstance(fields.get("model_type"), str):
            raise ConfigError(f"{key}: {file} has no model_type (a string such as llama, qwen2, qwen3_moe)")
        if os.path.isfile(path):
            config = config_or_error(lambda: AutoConfig.for_model(fields.pop("model_type"), **fields), path)
        else:
            config = config_or_error(lambda: AutoConfig.from_pretrained(path), path)
    if text_model:
        config = config.get_text_config(decoder=True)
    model_cls = causal_lm_class(config)
    check_family(config, model_cls)
    if cfg.attn_implementation == ATTENTION_NAME and not supports_packed_attention(model_cls):
        raise ConfigError(
            f"model_type {config.model_type!r} does not take transformers' attention interface, so "
            f"model.attn_implementation={ATTENTION_NAME} cannot mask documents; use sdpa with "
            "data.packing: none (the trainer switches to that by itself, see headrace.training.models.families)"
        )
    if cfg.init_std is not None:
        config.initializer_range = cfg.init_std
    if cfg.attn_implementation == ATTENTION_NAME:
        register_varlen_attention()
    config._attn_implementation = cfg.attn_implementation
    return config


def config_or_error(make, where: str) -> PretrainedConfig:
    """``make()``; transformers' validation of a config value (wrong type, heads not dividing the hidden size)
    as one ConfigError line naming ``where``."""
    with refused_as(where):
        return make()


def causal_lm_class(config: PretrainedConfig) -> type:
    """The ``AutoModelForCausalLM`` class of ``config`` (one clear line when there is none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ConfigError(
            f"model_type {config.model_type!r} has no AutoModelForCausalLM class in transformers (not a causal LM)"
        ) from None


def one_document_per_row(
    cfg: JobConfig, llm_config: Callable[[ModelConfig], PretrainedConfig] = build_hf_config
) -> JobConfig:
    """``cfg`` itself, or, for a model without the attention interface asked to run headrace_varlen, a copy
    with ``model.attn_implementation: sdpa`` and ``data.packing: none``: one document per row keeps the
    documents apart under sdpa's plain causal mask (the fallback ``headrace.training.models.families`` describes).
    ``llm_config``: the model kind's (``ModelKind.llm_config``)."""
    if cfg.model.attn_implementation != ATTENTION_NAME:
        return cfg
    model_cfg = dataclasses.replace(cfg.model, attn_implementation="sdpa")
    if supports_packed_attention(causal_lm_class(llm_config(model_cfg))):
        return cfg
    return dataclasses.replace(cfg, model=model_cfg, data=dataclasses.replace(cfg.data, packing="none"))


def param_dtype(precision: str) -> torch.dtype:
    """The dtype the model computes in for ``trainer.precision`` (FSDP2's ``MixedPrecisionPolicy`` casts the fp32
    master weights to it)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def build_meta_model(config: PretrainedConfig) -> nn.Module:
    """The model's module tree with every parameter on the meta device (fp32 master weights)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=config._attn_implementation
        )


@torch.no_grad()
def materialize(
    model: nn.Module, device: torch.device, pretrained_path: str | None = None, prefix: str = "", offload: bool = False
) -> None:
    """Allocate each rank's (already sharded) parameters on ``device``, then initialize or load them
    (``prefix``: as ``load_safetensors``'s). ``offload`` (FSDP2's CPUOffloadPolicy): the parameters live in host
    memory, the buffers (RoPE tables) on ``device``, where forward reads them."""
    if pretrained_path is not None:
        check_fills(model, pretrained_path, prefix)  # before anything is allocated
    model.to_empty(device="cpu" if offload else device)
    for module in model.modules():  # to_empty left garbage, so nothing is initialized yet
        module._is_hf_initialized = False
    hf = unwrap_causal_lm(model)
    with warnings.catch_warnings():
        # On a CPU mesh DTensor has no RNG tracker: each rank fills its shards from its own generator, seeded alike
        # (torch warns once per random op). Harmless here: the weights are valid random ones either way, and a
        # GPU mesh (the tracker) or pretrained_path give the exact ones.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support on cpu")
        hf.initialize_weights()  # also recomputes the non-persistent RoPE buffers
    hf.tie_weights()
    if pretrained_path is not None:
        load_safetensors(model, pretrained_path, prefix)
    if offload:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(device)


def check_fills(model: nn.Module, path: str, prefix: str = "") -> None:
    """JobInputError when ``model`` has more than twice the parameters the checkpoint in ``path`` (its ``prefix``
    part) holds values for (LoRA adapters aside): a config that describes a far larger model than its weights
    would otherwise be allocated whole before the load names the missing tensors. Smaller mismatches are left to
    ``check_stored``, which names the tensor. Headers only; the model may still be on the meta device."""
    from headrace.training.models.lora import is_adapter_key

    stored = sum(math.prod(shape) for key, (_, shape) in stored_tensors(path).items() if key.startswith(prefix))
    needed = sum(p.numel() for name, p in model.named_parameters() if not is_adapter_key(name))
    if needed > 2 * stored:
        raise JobInputError(
            f"model.pretrained_path: {path} holds {stored:,} values, but the model its config describes has "
            f"{needed:,} parameters: is it a checkpoint of this model? (nothing was allocated)"
        )


def load_safetensors(model: nn.Module, path: str, prefix: str = "", rename: Callable[[str], str] | None = None) -> None:
    """Fill ``model`` (plain, FSDP2 or TP-sharded) from a HF safetensors directory, each rank its own slices;
    ``prefix``: the checkpoint names the model's weights ``prefix + name`` (a part of a bigger model), and
    ``rename(name)`` is the model's name of such a ``name`` (a part whose modules are named otherwise)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from headrace.training.models.lora import is_adapter_key

    state = {k: v for k, v in get_model_state_dict(model).items() if not is_adapter_key(k)}  # LoRA: not the base's
    hf = unwrap_causal_lm(model)
    if getattr(getattr(hf, "config", None), "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the checkpoint stores only the embedding
    rename = rename or (lambda name: name)
    tensors = stored_tensors(path)
    stored_as = {
        rename(name[len(prefix) :]): key
        for name, key in checkpoint_names(hf, tensors).items()
        if name.startswith(prefix)
    }
    stored = set(stored_as.values())  # a key stored under the model's own name is read as it is
    # fused MoE experts stored per expert (the hub's layout) are read into per-expert views of the local experts
    reads = per_expert_views(hf, state, keep_fused=stored_as.keys() | stored)
    reads = {k if k in stored else stored_as.get(k, k): v for k, v in reads.items()}
    check_stored(reads, tensors, path)
    dcp.load(reads, storage_reader=dcp.HuggingFaceStorageReader(path))
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))  # dcp.load filled these in place


def stored_tensors(path: str) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor name in the ``*.safetensors`` files of ``path`` -> (its file, its shape), from the headers only.
    JobInputError naming the file: none there (pickles are never read), an unreadable file, or a name stored in two
    files (which one DCP would read is arbitrary: an all-zero copy could silently win)."""
    from safetensors import SafetensorError, safe_open

    files = files_inside(path, "*.safetensors")
    if not files:
        others = sorted(p.name for p in Path(path).glob("*.bin")) + sorted(p.name for p in Path(path).glob("*.pt*"))
        raise JobInputError(
            f"model.pretrained_path: {path} holds no *.safetensors file"
            + (
                f" (only {', '.join(others[:3])}: re-save it with save_pretrained(..., "
                "safe_serialization=True); .bin files are pickles and are not read)"
                if others
                else ""
            )
        )
    tensors: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        except SafetensorError as e:
            raise JobInputError(f"model.pretrained_path: {file} is not a readable safetensors file ({e})") from None
        for key, shape in shapes.items():
            if key in tensors:
                raise JobInputError(
                    f"model.pretrained_path: {key} is stored in both {tensors[key][0].name} and "
                    f"{file.name} (in {path}); remove one"
                )
            tensors[key] = (file, shape)
    return tensors


def checkpoint_names(hf: nn.Module, tensors: dict) -> dict[str, str]:
    """Model FQN -> the key a checkpoint (its ``stored_tensors``) stores it under, through transformers' own key
    renamings for the family (GPT-NeoX checkpoints keep ``embed_out`` for the model's ``lm_head``)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    renames = [t for t in get_model_conversion_mapping(hf) if isinstance(t, WeightRenaming)]
    return {renamed(key, renames): key for key in tensors}


def check_stored(reads: dict[str, torch.Tensor], tensors: dict, path: str) -> None:
    """Every tensor the model reads (checkpoint key -> the model's tensor, global shape) is in the checkpoint with
    that shape; else a JobInputError naming the tensor, not DCP's traceback from inside the load."""
    missing = sorted(key for key in reads if key not in tensors)
    if missing:
        raise JobInputError(
            f"model.pretrained_path: {path} has no tensor {missing[0]}"
            + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; is it a checkpoint of this model?"
        )
    for key, tensor in reads.items():
        file, shape = tensors[key]
        if shape != tuple(tensor.shape):
            raise JobInputError(
                f"model.pretrained_path: {file}: {key} has shape {list(shape)}, the model's is "
                f"{list(tensor.shape)} (its config disagrees with the checkpoint's: vocab_size, "
                "hidden_size, layers?)"
            )


def count_params(config: PretrainedConfig) -> tuple[int, int]:
    """(all parameters, parameters outside the embeddings) computed on the meta device."""
    meta = build_meta_model(config)
    total = sum(p.numel() for p in meta.parameters())
    embed = meta.get_input_embeddings().weight.numel()
    return total, total - embed


__all__ = [
    "build_hf_config",
    "build_meta_model",
    "causal_lm_class",
    "count_params",
    "load_safetensors",
    "materialize",
    "one_document_per_row",
    "param_dtype",
]
