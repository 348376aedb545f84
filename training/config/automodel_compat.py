"""NeMo Automodel's ``distributed:`` block, as its users write it, mapped onto ``headrace.training.config.job_config.DistributedConfig``.

Automodel's YAML (see ``/work/shared/seeds/nemo-automodel-distributed-training.txt`` and its
``FSDP2Config`` / ``MegatronFSDPConfig``) spells a few things differently: ``dp_size: none`` (the string)
for "infer", ``activation_checkpointing: full``, ``enable_compile``, ``reshard_after_forward: null`` (its
heuristic: reshard every block but the last, which is what this trainer does with ``true``). Those are
translated here, before the config tree is type-checked. Every other Automodel key is accepted only at a
value that means what this trainer already does (e.g. ``offload_policy: null``); any other value fails
with one line naming the key and the reason, so nothing is silently ignored. ``pipeline:`` and ``moe:``
are left to their own sections (their owners' issues).
"""

from __future__ import annotations

from headrace.config import ConfigError

# Automodel key -> (values that match this trainer's behaviour, why other values are refused).
# Keys listed here are consumed (they have no field of their own in DistributedConfig).
ACCEPTED_AT_DEFAULT = {
    "patch_is_packed_sequence": (
        (False,),
        "headrace trains packed rows (document masking from cu_seqlens); "
        "there is no transformers packed-sequence check to patch",
    ),
    "autocast_dtype": ((None,), "use trainer.precision: bf16 (FSDP2 MixedPrecisionPolicy, fp32 reduction)"),
    "mp_policy": ((None,), "use trainer.precision: bf16 (param_dtype bf16, reduce_dtype fp32) or fp32"),
    "tp_plan": (
        (None,),
        "custom TP plans are not loaded: the Llama family uses headrace.training.distributed.tensor_parallel.apply_tp, "
        "other families their transformers base_model_tp_plan",
    ),
    "activation_checkpointing_scope": (
        ("all",),
        "only language-model blocks are checkpointed (no vision/audio towers here)",
    ),
    "enable_async_tensor_parallel": ((False,), "async TP (inductor micro-pipeline) is not wired in"),
    "enable_fsdp2_prefetch": (
        (False,),
        "explicit FSDP2 prefetch chains are not implemented (FSDP2's implicit next-block prefetch is used)",
    ),
    "fsdp2_backward_prefetch_depth": ((2,), "explicit FSDP2 prefetch chains are not implemented"),
    "fsdp2_forward_prefetch_depth": ((1,), "explicit FSDP2 prefetch chains are not implemented"),
}
# MegatronFSDPConfig's own options: meaningful only with strategy megatron_fsdp, which is not implemented.
MEGATRON_FSDP_KEYS = (
    "megatron_fsdp_unit_modules",
    "zero_dp_strategy",
    "init_fsdp_with_meta_device",
    "grad_reduce_in_fp32",
    "preserve_fp32_weights",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "check_for_nan_in_grad",
    "report_nan_in_param_grad",
    "average_in_collective",
    "disable_bucketing",
    "calculate_per_token_loss",
    "keep_fp8_transpose_cache",
    "nccl_ub",
    "fsdp_double_buffer",
)
SIZE_KEYS = ("dp_size", "dp_replicate_size")  # the sizes Automodel lets be `none`
CPU_OFFLOAD_TARGET = "torch.distributed.fsdp.CPUOffloadPolicy"
# Automodel's top-level ``fp8:`` keys that torchtitan's ``quantize.linear.float8`` spells the same way.
FP8_KEYS = (
    "recipe_name",
    "enable_fsdp_float8_all_gather",
    "precompute_float8_dynamic_scale_for_fsdp",
    "force_recompute_fp8_weight_in_bwd",
    "filter_fqns",
    "emulate",
)


def translate_distributed(raw: dict) -> None:
    """Rewrite ``raw["distributed"]`` (a YAML dict) in place into this trainer's ``DistributedConfig`` keys."""
    section = raw.get("distributed")
    if not isinstance(section, dict):
        return
    for key in SIZE_KEYS:
        if isinstance(section.get(key), str) and section[key].lower() in ("none", "null", "auto"):
            section[key] = None  # Automodel writes `dp_size: none` for "inferred from the world size"
    if section.get("strategy") == "megatron_fsdp":
        raise ConfigError(
            "distributed.strategy: megatron_fsdp is not implemented here (it needs megatron-core's "
            "FSDP); use fsdp2, which covers the same layouts"
        )
    for key in MEGATRON_FSDP_KEYS:
        if key in section:
            raise ConfigError(
                f"distributed.{key}: a MegatronFSDP option, and strategy megatron_fsdp is not "
                "implemented here (use fsdp2 and remove it)"
            )
    for key, (accepted, reason) in ACCEPTED_AT_DEFAULT.items():
        if key in section:
            value = section.pop(key)
            if value not in accepted:
                raise ConfigError(f"distributed.{key}={value!r} is not supported: {reason}")
    ac = section.get("activation_checkpointing")
    if ac == "full":
        section["activation_checkpointing"] = True
    elif ac == "selective":
        raise ConfigError(
            "distributed.activation_checkpointing=selective is not supported: only full "
            "per-block checkpointing (true / full, activation_checkpointing_every for every N-th)"
        )
    if "reshard_after_forward" in section and section["reshard_after_forward"] is None:
        del section["reshard_after_forward"]  # Automodel's heuristic == this trainer's default (true)
    if "offload_policy" in section:
        section.update(translate_offload_policy(section.pop("offload_policy")))
    if "enable_compile" in section:
        compile_ = section.pop("enable_compile")
        if section.setdefault("compile", compile_) != compile_:
            raise ConfigError("distributed.enable_compile and distributed.compile disagree; set one of them")


def translate_offload_policy(value) -> dict:
    """Automodel's ``offload_policy`` (null, or ``{_target_: torch.distributed.fsdp.CPUOffloadPolicy, pin_memory:
    ...}``) or this trainer's ``none`` / ``cpu`` as ``DistributedConfig`` fields."""
    if value is None or value in ("none", "cpu"):
        return {"offload_policy": value or "none"}
    if (
        isinstance(value, dict)
        and value.get("_target_") == CPU_OFFLOAD_TARGET
        and set(value) <= {"_target_", "pin_memory"}
    ):
        return {"offload_policy": "cpu", "offload_pin_memory": value.get("pin_memory", True)}
    raise ConfigError(
        f"distributed.offload_policy={value!r} is not supported: use cpu, none, or "
        f"{{_target_: {CPU_OFFLOAD_TARGET}, pin_memory: true|false}}"
    )


def translate_fp8(raw: dict) -> None:
    """Automodel's top-level ``fp8:`` block (``enabled`` + torchao's switches) into ``quantize.linear.float8``."""
    block = raw.pop("fp8", None)
    if block is None:
        return
    if not isinstance(block, dict):
        raise ConfigError(f"fp8: expected a mapping of {', '.join(('enabled',) + FP8_KEYS)}, got {block!r}")
    unknown = sorted(set(block) - {"enabled", *FP8_KEYS})
    if unknown:
        raise ConfigError(f"fp8.{unknown[0]}: unknown key (accepted: {', '.join(('enabled',) + FP8_KEYS)})")
    if not block.get("enabled", False):
        return
    linear = raw.setdefault("quantize", {}).setdefault("linear", {})
    if linear.get("float8") is not None:
        raise ConfigError("fp8 and quantize.linear.float8 are both set; keep one of them")
    linear["float8"] = {key: value for key, value in block.items() if key != "enabled"}


__all__ = [
    "ACCEPTED_AT_DEFAULT",
    "CPU_OFFLOAD_TARGET",
    "FP8_KEYS",
    "MEGATRON_FSDP_KEYS",
    "translate_distributed",
    "translate_fp8",
    "translate_offload_policy",
]
