"""The trainer's job config: one ``@dataclass(kw_only=True)`` tree loaded from YAML plus ``a.b=c`` overrides.

Sections: ``model`` (which transformers model and how to build it), ``data`` (the loader's own ``data:``
section, passed to ``headrace.dataio.build_loader`` untouched), ``distributed`` (shaped like NeMo Automodel's, so
its users can paste theirs), ``optim``, ``trainer``, ``checkpoint``, ``logging``, ``peft`` (LoRA). ``headrace.training.config.load``
reads it (``headrace.config``: unknown keys and wrong types fail with the full dotted path) and
``headrace.training.config.validate`` holds every rule between its values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from headrace.config import from_dict, to_dict
from headrace.dataio.config import DataConfig
from headrace.training.config.peft import PeftConfig
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


@dataclass(frozen=True, kw_only=True)
class KindConfig:
    """What the config alone knows of a model kind (its runtime spec: ``headrace.training.model_kinds``)."""

    section: str | None  # the ``ModelConfig`` field of its own settings, set with this kind and only then
    bucketed: bool  # trains on bucketed whole samples (data.bucketing), not packed rows of data.seq_len tokens
    # its build applies quantize.linear.float8 and distributed.offload_policy (else both are refused)
    float8_and_offload: bool = False
    peft_parts: tuple[str, ...] = ("llm",)  # the parts ``peft.parts`` may name (LoRA adapters on them)
    has_llm: bool = True  # a transformers LLM from exactly one of config / config_path / pretrained_path
    extra_section: str | None = None  # a ``ModelConfig`` field only this kind may set (optional)


# model.kind -> its config facts; a new kind adds its name to ModelConfig.kind, its section, and a row here
KIND_CONFIGS = {
    "causal_lm": KindConfig(section=None, bucketed=False, float8_and_offload=True),
    "salm": KindConfig(section="speech", bucketed=True, peft_parts=("llm", "encoder")),
    "ctc": KindConfig(section="speech", bucketed=True, peft_parts=(), has_llm=False, extra_section="ctc"),
}


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
    cp_comm: Literal["allgather", "ring"] = (
        "allgather"  # how CP attention exchanges K/V (headrace.kernels.cp_attention)
    )
    ep_size: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    activation_checkpointing_every: int = 1  # checkpoint every N-th block (1 = all blocks)
    compile: bool = False  # torch.compile each block
    compile_backend: str = "inductor"  # torch.compile backend; aot_eager traces without code generation
    reshard_after_forward: bool = True
    defer_fsdp_grad_sync: bool = True  # reduce gradients only on the last micro-step
    # FSDP2 CPU offload (torch's CPUOffloadPolicy): sharded parameters, gradients and the optimizer step live in
    # host memory; each block's shard is copied to the device for its all-gather. Saves device memory, costs
    # host<->device traffic and a CPU optimizer step.
    offload_policy: Literal["none", "cpu"] = "none"
    offload_pin_memory: bool = True  # pinned host shards (asynchronous copies); on a CPU-only run it is ignored
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass(kw_only=True)
class Float8Config:
    """``quantize.linear.float8``, torchtitan's names: the block's ``nn.Linear`` layers become torchao
    ``Float8Linear`` (float8 matmuls with dynamic scales, weights and master copy kept in high precision).
    ``headrace.training.models.float8`` applies it and says which layers it skips."""

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    enable_fsdp_float8_all_gather: bool = False  # FSDP2 all-gathers the float8 weights (tensorwise only)
    precompute_float8_dynamic_scale_for_fsdp: bool = False  # one all-reduce of every weight's amax per step
    force_recompute_fp8_weight_in_bwd: bool = False  # recompute the float8 weight in backward (saves memory)
    filter_fqns: list[str] = field(default_factory=list)  # layers whose name contains one of these stay as they are
    emulate: bool = False  # torchao's emulated float8 matmul: numerics without float8 hardware (tests, old GPUs)


@dataclass(kw_only=True)
class LinearQuantizeConfig:
    float8: Float8Config | None = None  # null: linears stay in trainer.precision


@dataclass(kw_only=True)
class QuantizeConfig:
    """``quantize:`` (torchtitan's section; NeMo Automodel's top-level ``fp8:`` block is translated into it)."""

    linear: LinearQuantizeConfig = field(default_factory=LinearQuantizeConfig)


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``lr * min_lr_ratio``."""

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0
    decay_steps: int | None = None  # default: trainer.max_steps - warmup_steps
    # what the cosine runs over: steps (max_steps or decay_steps) or minutes (trainer.max_minutes' wall clock, rank
    # 0's: a run the budget stops ends at the floor whatever steps it got)
    schedule: Literal["steps", "minutes"] = "steps"
    min_lr_ratio: float = 0.1
    max_grad_norm: float | None = 1.0


@dataclass(kw_only=True)
class ProfileConfig:
    """``trainer.profile``: trace steps ``start .. start + steps - 1`` (1-based) with torch.profiler; each rank
    writes ``output_dir/profile/rank{R}.pt.trace.json`` (Chrome trace / TensorBoard profiler plugin)."""

    start: int
    steps: int = 3


@dataclass(kw_only=True)
class PreemptionConfig:
    """``trainer.preemption``: the signals a scheduler sends ahead of a kill (SLURM ``--signal=USR1@120``,
    SIGTERM from a cloud scheduler or ``scancel``). On one, every rank stops at the next step boundary, saves a
    checkpoint and exits with ``exit_code`` (``headrace.training.components.preemption``)."""

    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    exit_code: int = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, run again to continue


@dataclass(kw_only=True)
class TrainerConfig:
    """The loop. Global batch = data batch per rank x grad_accum x dp_size."""

    max_steps: int = 100
    grad_accum: int = 1
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: FSDP2 MixedPrecisionPolicy / autocast, fp32 reduce
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    output_dir: str = "runs/debug"
    log_every: int = 1
    profile: ProfileConfig | None = None  # torch.profiler trace of a few steps, one file per rank
    eval_every: int = 0  # validate over the whole data.val stream every N steps and at the end (0: never)
    data_seed: int | None = (
        None  # this job's data seed: orders the epochs not yet begun (headrace.training.launch --jobs)
    )
    # a wall-clock budget (validation and decodes included): the first step that ends past it is the last one (it
    # logs, validates, saves and exports as max_steps' would); rank 0's clock decides for every rank. The LR
    # schedule runs over max_steps unless optim.schedule: minutes
    max_minutes: float | None = None
    # non-finite steps (loss or global grad norm NaN/Inf) in a row that stop the run; each one is skipped on every
    # rank (headrace.training.components.nonfinite). 10: a bad document packed over several rows spans a few batches,
    # a diverged model fails every step; 10 steps is little compute to lose before saying so
    max_bad_steps: int = 10
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)


@dataclass(kw_only=True)
class CheckpointConfig:
    """DCP checkpoints under ``output_dir/checkpoints`` and the consolidated HF export."""

    # where checkpoints go: output_dir/checkpoints when unset; an fsspec URL (s3://bucket/run/checkpoints) for
    # nodes without a shared file system (written under output_dir/checkpoints first, docs/checkpoints.md)
    folder: str | None = None
    interval: int = 0  # save every N steps (0: only at the end)
    save_final: bool = True
    resume: bool = True  # continue from the newest complete checkpoint in output_dir when there is one
    keep_last: int | None = None  # delete older checkpoints beyond this many
    export_hf: bool = True  # write output_dir/hf (config.json + sharded safetensors + index [+ tokenizer]) at the end
    export_shard_size_mb: float = 5000.0  # most bytes per hf/ safetensors file
    # MoE experts in hf/: per_expert = the keys save_pretrained and the hub use (vLLM, SGLang, transformers 4
    # read them); fused = transformers 5's in-memory 3D gate_up_proj / down_proj
    export_hf_experts: Literal["per_expert", "fused"] = "per_expert"
    # disabled: the step waits for the write; async: the state is copied to host memory and written in the
    # background; async_with_pinned_mem: copied into host buffers kept across saves (pinned with CUDA). docs/checkpoints.md
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    is_async: bool | None = None  # NeMo Automodel's switch: true means async_mode: async (unless pinned is asked)

    def __post_init__(self):
        if self.is_async is False and self.async_mode != "disabled":
            raise ValueError(f"is_async: false contradicts async_mode: {self.async_mode} (set one of them)")
        if self.is_async and self.async_mode == "disabled":
            self.async_mode = "async"


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
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    peft: PeftConfig | None = None  # LoRA adapters on a frozen base (headrace.training.models.lora, docs/lora.md)


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
    "CheckpointConfig",
    "DistributedConfig",
    "Float8Config",
    "JobConfig",
    "LinearQuantizeConfig",
    "LoggingConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "ProfileConfig",
    "QuantizeConfig",
    "TrainerConfig",
    "WandbConfig",
    "val_data_config",
]
