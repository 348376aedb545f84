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
    "patch_is_packed_sequence": ((False,), "headrace trains packed rows (document masking from cu_seqlens); "
                                 "there is no transformers packed-sequence check to patch"),
    "offload_policy": ((None,), "FSDP2 CPU offload is not implemented"),
    "autocast_dtype": ((None,), "use trainer.precision: bf16 (FSDP2 MixedPrecisionPolicy, fp32 reduction)"),
    "mp_policy": ((None,), "use trainer.precision: bf16 (param_dtype bf16, reduce_dtype fp32) or fp32"),
    "tp_plan": ((None,), "custom TP plans are not loaded: the Llama family uses headrace.training.distributed.tensor_parallel.apply_tp, "
                "other families their transformers base_model_tp_plan"),
    "activation_checkpointing_scope": (("all",), "only language-model blocks are checkpointed (no vision/audio "
                                       "towers here)"),
    "enable_async_tensor_parallel": ((False,), "async TP (inductor micro-pipeline) is not wired in"),
    "enable_fsdp2_prefetch": ((False,), "explicit FSDP2 prefetch chains are not implemented (FSDP2's implicit "
                              "next-block prefetch is used)"),
    "fsdp2_backward_prefetch_depth": ((2,), "explicit FSDP2 prefetch chains are not implemented"),
    "fsdp2_forward_prefetch_depth": ((1,), "explicit FSDP2 prefetch chains are not implemented"),
}
# MegatronFSDPConfig's own options: meaningful only with strategy megatron_fsdp, which is not implemented.
MEGATRON_FSDP_KEYS = (
    "megatron_fsdp_unit_modules", "zero_dp_strategy", "init_fsdp_with_meta_device", "grad_reduce_in_fp32",
    "preserve_fp32_weights", "overlap_grad_reduce", "overlap_param_gather", "check_for_nan_in_grad",
    "report_nan_in_param_grad", "average_in_collective", "disable_bucketing", "calculate_per_token_loss",
    "keep_fp8_transpose_cache", "nccl_ub", "fsdp_double_buffer",
)
SIZE_KEYS = ("dp_size", "dp_replicate_size")  # the sizes Automodel lets be `none`


def translate_distributed(raw: dict) -> None:
    """Rewrite ``raw["distributed"]`` (a YAML dict) in place into this trainer's ``DistributedConfig`` keys."""
    section = raw.get("distributed")
    if not isinstance(section, dict):
        return
    for key in SIZE_KEYS:
        if isinstance(section.get(key), str) and section[key].lower() in ("none", "null", "auto"):
            section[key] = None  # Automodel writes `dp_size: none` for "inferred from the world size"
    if section.get("strategy") == "megatron_fsdp":
        raise ConfigError("distributed.strategy: megatron_fsdp is not implemented here (it needs megatron-core's "
                          "FSDP); use fsdp2, which covers the same layouts")
    for key in MEGATRON_FSDP_KEYS:
        if key in section:
            raise ConfigError(f"distributed.{key}: a MegatronFSDP option, and strategy megatron_fsdp is not "
                              "implemented here (use fsdp2 and remove it)")
    for key, (accepted, reason) in ACCEPTED_AT_DEFAULT.items():
        if key in section:
            value = section.pop(key)
            if value not in accepted:
                raise ConfigError(f"distributed.{key}={value!r} is not supported: {reason}")
    ac = section.get("activation_checkpointing")
    if ac == "full":
        section["activation_checkpointing"] = True
    elif ac == "selective":
        raise ConfigError("distributed.activation_checkpointing=selective is not supported: only full "
                          "per-block checkpointing (true / full, activation_checkpointing_every for every N-th)")
    if "reshard_after_forward" in section and section["reshard_after_forward"] is None:
        del section["reshard_after_forward"]  # Automodel's heuristic == this trainer's default (true)
    if "enable_compile" in section:
        compile_ = section.pop("enable_compile")
        if section.setdefault("compile", compile_) != compile_:
            raise ConfigError("distributed.enable_compile and distributed.compile disagree; set one of them")


__all__ = ["ACCEPTED_AT_DEFAULT", "MEGATRON_FSDP_KEYS", "translate_distributed"]
