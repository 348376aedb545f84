"""Which transformers causal LMs the trainer takes, and what it reads from each to parallelize it.

Any ``AutoModelForCausalLM`` whose structure the trainer can read trains here; nothing is written per
family except the hand-tuned TP+SP plan of the Llama family (``headrace.training.distributed.tensor_parallel.apply_tp``):

- decoder blocks (the FSDP2 unit, the activation-checkpointing and compile unit): the ``nn.ModuleList``
  whose children are instances of the model's ``_no_split_modules`` classes (transformers' own "never
  split this across devices" list, e.g. ``MistralDecoderLayer``, ``GPTNeoXLayer``);
- tensor parallelism: the model config's ``base_model_tp_plan`` (module-path pattern -> style name),
  translated to torch's ``ColwiseParallel`` / ``RowwiseParallel`` by ``tensor_parallel.TP_STYLES``; embeddings and the
  output head get vocab-sharded styles here (tied embeddings included: both shard dim 0 of the one
  weight, which is re-tied after the plan is applied), whether or not the plan names the input embedding
  (transformers >= 5.24 names GPT-NeoX's ``embed_in`` as ``embedding_rowwise``, the same vocab-parallel
  style). A style outside ``TP_STYLES`` fails naming it;
- document-masked attention on packed rows needs the model to route attention through transformers'
  ``AttentionInterface`` (``_supports_attention_backend``). Models that do not (e.g. StableLM, Falcon in
  transformers 5.x) fall back to one document per row: ``data.packing: none`` and ``sdpa``, so the
  causal mask alone keeps documents apart (padding sits after each document, masked from the loss).

The trainer's loss reads ``lm_head.weight`` directly (``headrace.training.models.loss``), so models that transform the
logits after the head (Gemma 2's final soft-capping, Cohere's logit scale, Granite's logits scaling) are
refused by ``POST_HEAD_FIELDS`` rather than trained on a different objective.

``TESTED_FAMILIES`` is the one list of families CI trains against a single-process reference
(``tests/dist/train_families.py`` iterates it); other families go through the same generic path untested.
"""

from __future__ import annotations

from torch import nn

from headrace.config import ConfigError
from headrace.training.models.loss import unwrap_causal_lm

# Families with a hand-written TP+SP plan (headrace.training.distributed.tensor_parallel.apply_tp); every other family uses its own
# base_model_tp_plan without sequence parallelism.
LLAMA_LIKE = ("llama", "qwen2", "qwen3")
# Mixture-of-experts families: expert parallelism and grouped experts first (headrace.training.distributed.moe).
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "olmoe")
OWN_TP_PLAN = LLAMA_LIKE + MOE_MODEL_TYPES  # TP by apply_tp; every other family by its base_model_tp_plan
# The families CI trains against a single-process reference: llama in every layout (tests/dist/
# train_layouts.py), the others under HSDP + activation checkpointing and FSDP2 x TP (tests/dist/
# train_families.py; gemma with tied embeddings). qwen2 shares llama's modules and plan (recipe-tested only).
TESTED_FAMILIES = ("llama", "qwen3", "mistral", "gemma", "phi3", "olmo2", "gpt_neox")
# Config fields that change the logits after lm_head (the chunked loss would ignore them).
POST_HEAD_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def supports_packed_attention(model_cls: type) -> bool:
    """Whether the model calls the attention function registered by name (so headrace_varlen can run)."""
    return bool(getattr(model_cls, "_supports_attention_backend", False))


def check_family(hf_config, model_cls: type) -> None:
    """Refuse, in one line, a model whose training objective or structure this trainer cannot reproduce."""
    for name in POST_HEAD_FIELDS:
        if getattr(hf_config, name, None) not in (None, 1.0):
            raise ConfigError(
                f"model_type {hf_config.model_type!r}: config.{name}={getattr(hf_config, name)} "
                "transforms the logits after lm_head, which the trainer's chunked loss does not apply"
            )
    if not getattr(model_cls, "_no_split_modules", None):
        raise ConfigError(
            f"model_type {hf_config.model_type!r}: {model_cls.__name__} declares no _no_split_modules, "
            "so its decoder blocks (the FSDP2 unit) cannot be found"
        )


def decoder_blocks(model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
    """The container of decoder blocks: an ``nn.ModuleList`` (a pipeline stage: an ``nn.ModuleDict`` keyed by
    global block index) whose children are all of a ``_no_split_modules`` class (see module doc)."""
    hf = unwrap_causal_lm(model)
    names = set(hf._no_split_modules)
    for module in model.modules():
        if (
            isinstance(module, (nn.ModuleList, nn.ModuleDict))
            and len(module)
            and all(type(_unwrap_checkpoint(b)).__name__ in names for b in module.children())
        ):
            return module
    raise ValueError(f"{type(hf).__name__}: no ModuleList of {sorted(names)} blocks found")


def _unwrap_checkpoint(block: nn.Module) -> nn.Module:
    return getattr(block, "_checkpoint_wrapped_module", block)


__all__ = [
    "LLAMA_LIKE",
    "MOE_MODEL_TYPES",
    "OWN_TP_PLAN",
    "POST_HEAD_FIELDS",
    "TESTED_FAMILIES",
    "check_family",
    "decoder_blocks",
    "supports_packed_attention",
]
