"""The trainer's job config: one ``@dataclass(kw_only=True)`` tree loaded from YAML plus ``a.b=c`` overrides.

Sections: ``model`` (which transformers model and how to build it), ``data`` (the loader's own ``data:``
section, passed to ``headrace.dataio.build_loader`` untouched), ``distributed`` (shaped like NeMo Automodel's, so
its users can paste theirs), ``optim``, ``trainer``, ``checkpoint``, ``logging``. ``headrace.training.config.load``
reads it (``headrace.config``: unknown keys and wrong types fail with the full dotted path) and
``headrace.training.config.validate`` holds every rule between its values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from headrace.config import from_dict, to_dict
from headrace.dataio.config import DataConfig
from headrace.training.config.speech import CTCConfig, SpeechConfig


@dataclass(kw_only=True)
class ModelConfig:
    """Which transformers causal LM to train. Exactly one of ``config`` / ``config_path`` / ``pretrained_path``
    describes the architecture; ``pretrained_path`` also gives the initial weights (safetensors)."""

    config: dict[str, Any] | None = None  # inline HF config fields, must include model_type
    config_path: str | None = None  # a local config.json or a directory holding one
    # a local directory with config.json + *.safetensors; for kind: salm also a transformers Qwen2-Audio / Voxtral
    # checkpoint, the whole SALM (headrace.training.speech.checkpoints)
    pretrained_path: str | None = None
    tokenizer: str | None = None  # tokenizer.json (or a directory) copied into the hf/ export
    attn_implementation: str = "sdpa"  # any name registered with transformers.AttentionInterface
    init_std: float | None = None  # overrides config.initializer_range for fresh models
    # salm: speech encoder + adapter + this LLM (headrace.training.speech); ctc: model.speech's encoder alone with a
    # CTC head (headrace.training.speech.ctc; no LLM: config / config_path / pretrained_path stay unset)
    kind: Literal["causal_lm", "salm", "ctc"] = "causal_lm"
    speech: SpeechConfig | None = None  # the encoder / adapter / prompt of kind: salm, the encoder of kind: ctc
    ctc: CTCConfig | None = None  # kind: ctc's units (default: characters)


@dataclass(kw_only=True)
class PipelineConfig:
    """Pipeline-parallel settings (``distributed.pp_size > 1``), NeMo Automodel's ``pipeline:`` block plus
    torchtitan's stage controls; ``headrace.training.distributed.pipeline`` documents each field's effect."""

    pp_schedule: str = "1f1b"  # Automodel or torchtitan spelling (1f1b, gpipe, interleaved_1f1b, ZBVZeroBubble..)
    pp_microbatch_size: int = 1  # packed rows per pipeline microbatch
    scale_grads_in_schedule: bool = False
    layers_per_stage: int | None = None  # decoder blocks per stage; null: balance stages by parameter count
    round_virtual_stages_to_pp_multiple: Literal["up", "down"] | None = None
    reshard_after_forward: bool = False  # FSDP2 under PP: keep weights gathered across microbatches


@dataclass(kw_only=True)
class MoEConfig:
    """NeMo Automodel's ``distributed.moe:`` keys plus the experts kernel and the aux-loss weight
    (see headrace.training.distributed.moe; keys it cannot honour fail there with the reason)."""

    reshard_after_forward: bool = False  # FSDP2 reshard of the expert groups (blocks: distributed.reshard_...)
    wrap_outer_model: bool = True  # fully_shard the root (embeddings, norm, lm_head); false is refused
    ignore_router_for_ac: bool = False  # under activation checkpointing, save the router's outputs
    lm_head_precision: str | None = None  # only the root's own precision is supported
    experts_implementation: str = "grouped_mm"  # grouped_mm | loop | hf (transformers' own, ep_size 1 only)
    aux_loss_coef: float | None = None  # router load-balancing loss weight; null: config.router_aux_loss_coef
    # Megatron-Core's token dropping (headrace.training.distributed.moe_routing): null = dropless; else each expert computes at most
    # ceil(tokens * top_k / num_experts * capacity_factor) of the tokens a rank routes in a micro-batch.
    capacity_factor: float | None = None
    token_drop_policy: Literal["probs", "position"] = "probs"  # keep the highest router weights / earliest tokens
    pad_to_capacity: bool = False  # every expert gets exactly its capacity in rows (static shapes)


@dataclass(kw_only=True)
class DistributedConfig:
    """NeMo-Automodel-shaped ``distributed:`` section. ``dp_size: null`` means world / (tp * pp * cp)."""

    strategy: Literal["fsdp2", "ddp"] = "fsdp2"
    dp_size: int | None = None
    dp_replicate_size: int | None = None  # HSDP: replicate groups; must divide dp_size
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    cp_comm: Literal["allgather", "ring"] = "allgather"  # how CP attention exchanges K/V (headrace.kernels.cp_attention)
    ep_size: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    activation_checkpointing_every: int = 1  # checkpoint every N-th block (1 = all blocks)
    compile: bool = False  # torch.compile each block
    compile_backend: str = "inductor"  # torch.compile backend; aot_eager traces without code generation
    reshard_after_forward: bool = True
    defer_fsdp_grad_sync: bool = True  # reduce gradients only on the last micro-step
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``lr * min_lr_ratio``."""

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0
    decay_steps: int | None = None  # default: trainer.max_steps - warmup_steps
    min_lr_ratio: float = 0.1
    max_grad_norm: float | None = 1.0


@dataclass(kw_only=True)
class ProfileConfig:
    """``trainer.profile``: trace steps ``start .. start + steps - 1`` (1-based) with torch.profiler; each rank
    writes ``output_dir/profile/rank{R}.pt.trace.json`` (Chrome trace / TensorBoard profiler plugin)."""

    start: int
    steps: int = 3


@dataclass(kw_only=True)
class TrainerConfig:
    """The loop. Global batch = data batch per rank x grad_accum x dp_size."""

    max_steps: int = 100
    # a wall-clock budget (validation and decodes included): the first step that ends past it is the last one (it
    # logs, validates, saves and exports as max_steps' would); rank 0's clock decides for every rank. The LR
    # schedule still runs over max_steps: set max_steps near what the budget buys
    max_minutes: float | None = None
    grad_accum: int = 1
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: FSDP2 MixedPrecisionPolicy / autocast, fp32 reduce
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    output_dir: str = "runs/debug"
    log_every: int = 1
    profile: ProfileConfig | None = None  # torch.profiler trace of a few steps, one file per rank
    eval_every: int = 0  # validate over the whole data.val stream every N steps and at the end (0: never)
    data_seed: int | None = None  # this job's data seed: orders the epochs not yet begun (headrace.training.launch --jobs)


@dataclass(kw_only=True)
class CheckpointConfig:
    """DCP checkpoints under ``output_dir/checkpoints`` and the consolidated HF export."""

    interval: int = 0  # save every N steps (0: only at the end)
    save_final: bool = True
    resume: bool = True  # continue from the newest complete checkpoint in output_dir when there is one
    keep_last: int | None = None  # delete older checkpoints beyond this many
    export_hf: bool = True  # write output_dir/hf (config.json + sharded safetensors + index [+ tokenizer]) at the end
    export_shard_size_mb: float = 5000.0  # most bytes per hf/ safetensors file
    # MoE experts in hf/: per_expert = the keys save_pretrained and the hub use (vLLM, SGLang, transformers 4
    # read them); fused = transformers 5's in-memory 3D gate_up_proj / down_proj
    export_hf_experts: Literal["per_expert", "fused"] = "per_expert"


@dataclass(kw_only=True)
class WandbConfig:
    """``logging.wandb``: rank 0's metrics to a Weights & Biases run (the ``wandb`` extra). ``mode: offline``
    (or ``WANDB_MODE=offline``) needs no network: the run lands in ``output_dir/wandb``, ``wandb sync`` uploads it."""

    project: str = "headrace"
    entity: str | None = None
    name: str | None = None  # default: wandb's generated run name
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    mode: Literal["online", "offline", "disabled"] | None = None  # None: WANDB_MODE or wandb's default


@dataclass(kw_only=True)
class LoggingConfig:
    """Where rank 0's metrics go besides ``metrics.jsonl``."""

    console: bool = True
    tensorboard: bool = True
    wandb: WandbConfig | None = None  # Weights & Biases run (rank 0); null: off


@dataclass(kw_only=True)
class JobConfig:
    """The whole job: what ``python -m headrace.training --config X.yaml`` reads."""

    model: ModelConfig
    data: DataConfig
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def val_data_config(data: DataConfig) -> DataConfig | None:
    """The ``data:`` section of the val stream (``data.val`` over ``data``, one epoch), or None without one.
    Errors name ``data.val``'s keys."""
    if data.val is None:
        return None
    raw = {k: v for k, v in to_dict(data).items() if k != "val"}
    raw.update(data.val)
    raw["epochs"] = 1
    return from_dict(DataConfig, raw, "data.val")


__all__ = [
    "CheckpointConfig", "DistributedConfig", "JobConfig", "LoggingConfig", "MoEConfig", "ModelConfig", "OptimConfig",
    "PipelineConfig", "ProfileConfig", "TrainerConfig", "WandbConfig", "val_data_config",
]
