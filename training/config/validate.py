"""Every rule a training job's config must meet, each written once here; one error type, ``ConfigError``: one
line naming the dotted key and the rule.

``check_config(cfg)`` holds the rules of the config alone between its fields and sections (exactly one model
source, a SALM's bucketed audio, context parallelism's packed rows, known pipeline schedules, ...):
``headrace.training.config.load`` runs it on every job it reads, so a CLI reports them before launching anything.
``check_job(cfg)`` is the whole pass, run by the trainer on every rank before the process group is used:
``check_config``, then the values the types alone do not exclude (counts that must be positive, a learning
rate > 0), the model (a ``model_type`` transformers knows, paths that exist) and the val stream against the
layout; the trainer then checks the parallel degrees against the world size
(``headrace.training.distributed.parallel_dims.ParallelDims.from_config``, where their rules live). ``check_vocab(...)`` compares the tokenizer's vocabulary and the largest token id
each shard recorded (``ShardInfo.max_token``, written by ``dataio shard``/``dataio index``) with the model's
``vocab_size``, so an out-of-range id is a line naming the shard, not an ``IndexError`` deep in the
embedding. All are pure reads of the config and index metadata (microseconds, no data read).
Rules that need the built model (TP heads, MoE experts, pipeline stages) fail where it is built, before any
weight is allocated (``headrace.training.distributed``). The rules between a SALM's speech settings and the
released speech-LLM checkpoint it starts from live beside that mapping (``headrace.training.speech.checkpoints
.with_speech_llm``, which the trainer runs right after ``check_job``).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from headrace.config import ConfigError
from headrace.kernels.hf_attention import ATTENTION_NAME
from headrace.training.config.job_config import KIND_CONFIGS, val_data_config
from headrace.training.config.peft import check_peft
from headrace.training.config.pipeline_schedules import V_SHAPED, schedule_class_name

if TYPE_CHECKING:
    from headrace.dataio.stream.sources.interop import LhotseCutSource
    from headrace.dataio.stream.sources.shard_source import ShardSource

# dotted key -> (rule text, predicate); None passes where the field is optional
_RULES: dict[str, tuple[str, Callable]] = {
    "trainer.max_steps": (">= 1", lambda v: v >= 1),
    "trainer.grad_accum": (">= 1", lambda v: v >= 1),
    "trainer.max_minutes": ("> 0 or null", lambda v: v is None or v > 0),
    "trainer.log_every": (">= 1", lambda v: v >= 1),
    "trainer.max_bad_steps": (">= 1", lambda v: v >= 1),
    "trainer.preemption.exit_code": ("in 0..255", lambda v: 0 <= v <= 255),
    "trainer.preemption.signals": (
        "signal names such as SIGTERM, SIGUSR1 (not SIGKILL / SIGSTOP, which cannot be caught)",
        lambda v: all(catchable_signal(name) for name in v),
    ),
    "optim.lr": ("> 0", lambda v: v > 0),
    "optim.eps": ("> 0", lambda v: v > 0),
    "optim.weight_decay": (">= 0", lambda v: v >= 0),
    "optim.betas": ("two numbers in [0, 1)", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v)),
    "optim.warmup_steps": (">= 0", lambda v: v >= 0),
    "optim.decay_steps": (">= 1 or null", lambda v: v is None or v >= 1),
    "optim.min_lr_ratio": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "optim.max_grad_norm": ("> 0 or null", lambda v: v is None or v > 0),
    "checkpoint.interval": (">= 0 (0: only at the end)", lambda v: v >= 0),
    "checkpoint.keep_last": (">= 1 or null", lambda v: v is None or v >= 1),
}


def catchable_signal(name: str) -> bool:
    """``name`` is a signal a handler may be installed for."""
    return name in signal.Signals.__members__ and name.startswith("SIG") and name not in ("SIGKILL", "SIGSTOP")


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_job(cfg) -> None:
    """ConfigError for the first value of ``cfg`` (a ``JobConfig``) that breaks a rule (module docstring)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    check_config(cfg)
    for key, (rule, ok) in _RULES.items():
        value = _get(cfg, key)
        if not ok(value):
            raise ConfigError(f"{key}: must be {rule}, got {value!r}")
    if cfg.optim.schedule == "minutes" and cfg.trainer.max_minutes is None:
        raise ConfigError("optim.schedule: minutes runs the cosine over trainer.max_minutes, which is unset")
    if not KIND_CONFIGS[cfg.model.kind].has_llm:
        pass  # no LLM to find (the kind's encoder is checked where it is built)
    elif cfg.model.config is not None:
        model_type = cfg.model.config.get("model_type")
        if not isinstance(model_type, str) or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ConfigError(
                f"model.config.model_type: {model_type!r} is not a causal LM model type of "
                f"transformers (e.g. llama, qwen3, mistral, qwen3_moe)"
            )
    else:
        path = cfg.model.config_path or cfg.model.pretrained_path
        if not os.path.exists(path):
            key = "model.config_path" if cfg.model.config_path else "model.pretrained_path"
            raise ConfigError(f"{key}: {path} does not exist")
    if cfg.trainer.eval_every:
        check_validation(cfg)


def check_config(cfg) -> None:
    """The rules between the fields and sections of ``cfg`` (a ``JobConfig``) that need nothing but the config
    (module docstring)."""
    model = cfg.model
    given = [n for n in ("config", "config_path", "pretrained_path") if getattr(model, n) is not None]
    kind = KIND_CONFIGS[model.kind]
    if not kind.has_llm and given:
        raise ConfigError(f"model.kind: {model.kind} has no LLM: leave model.{given[0]} unset")
    if kind.has_llm and len(given) != 1:
        raise ConfigError(f"model: set exactly one of config / config_path / pretrained_path (got {given or 'none'})")
    for section in {k.section for k in KIND_CONFIGS.values() if k.section is not None}:
        if (getattr(model, section) is not None) != (section == kind.section):
            owners = " or ".join(name for name, k in KIND_CONFIGS.items() if k.section == section)
            raise ConfigError(f"model.{section} is required with model.kind: {owners}, and only then")
    for name, other in KIND_CONFIGS.items():
        if other.extra_section is not None and getattr(model, other.extra_section) is not None and other is not kind:
            raise ConfigError(f"model.{other.extra_section} is for model.kind: {name} (this job's kind: {model.kind})")
    if model.speech is not None and model.speech.encoder.from_checkpoint and model.pretrained_path is None:
        raise ConfigError(
            "model.speech.encoder: set one of config / config_path / pretrained_path"
            + (
                ", or start from a speech LLM's checkpoint (Qwen2-Audio, Voxtral) in model.pretrained_path"
                if kind.has_llm
                else f" (model.kind: {model.kind} trains the encoder alone)"
            )
        )
    if kind.bucketed:  # its batches come from data.bucketing, not THD rows
        if cfg.data.bucketing is None or cfg.data.seq_len is not None:
            raise ConfigError(
                f"model.kind: {model.kind} trains on bucketed audio: set data.bucketing and leave data.seq_len unset"
            )
    elif cfg.data.seq_len is None:  # the loop trains THD rows; without seq_len the loader collates plainly
        raise ConfigError("data.seq_len is required for training (the packed rows' length, e.g. 2048)")
    pipeline = cfg.distributed.pipeline
    schedule_class_name(pipeline.pp_schedule)  # an unknown name: one line listing the accepted ones
    if pipeline.pp_microbatch_size < 1:
        raise ConfigError(f"distributed.pipeline.pp_microbatch_size must be >= 1, got {pipeline.pp_microbatch_size}")
    if pipeline.layers_per_stage is not None and pipeline.layers_per_stage < 1:
        raise ConfigError(f"distributed.pipeline.layers_per_stage must be >= 1, got {pipeline.layers_per_stage}")
    profile = cfg.trainer.profile
    if profile is not None and (profile.start < 1 or profile.steps < 1):
        raise ConfigError(
            f"trainer.profile: start and steps must be >= 1, got start={profile.start} steps={profile.steps}"
        )
    if cfg.trainer.eval_every and cfg.data.val is None:
        raise ConfigError(
            f"trainer.eval_every={cfg.trainer.eval_every} needs a data.val stream "
            "(e.g. data.val: {datasets: [{path: ..., split: val}]})"
        )
    check_cp_config(cfg)
    check_peft(cfg.peft, model.kind, KIND_CONFIGS[model.kind].peft_parts)
    check_float8_config(cfg)
    if cfg.distributed.offload_policy == "cpu" and (
        cfg.distributed.strategy != "fsdp2" or not KIND_CONFIGS[cfg.model.kind].float8_and_offload
    ):
        raise ConfigError(
            f"distributed.offload_policy: cpu is FSDP2's CPUOffloadPolicy; it needs strategy: fsdp2 "
            f"and a model kind whose build applies it (model.kind {cfg.model.kind} does not)"
        )


def check_float8_config(cfg) -> None:
    """``quantize.linear.float8`` against the layout: what torchao's float8 training composes with."""
    float8 = cfg.quantize.linear.float8
    if float8 is None:
        return
    key = "quantize.linear.float8"
    if float8.enable_fsdp_float8_all_gather and float8.recipe_name != "tensorwise":
        raise ConfigError(
            f"{key}.enable_fsdp_float8_all_gather needs recipe_name: tensorwise (torchao all-gathers "
            f"float8 weights with one scale per tensor), got {float8.recipe_name}"
        )
    if float8.precompute_float8_dynamic_scale_for_fsdp and not float8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            f"{key}.precompute_float8_dynamic_scale_for_fsdp needs enable_fsdp_float8_all_gather: true "
            "(it precomputes the scales that all-gather casts with)"
        )
    if cfg.distributed.tp_size > 1:
        raise ConfigError(
            f"{key} with distributed.tp_size={cfg.distributed.tp_size} is not supported: the TP plan "
            "would need torchao's float8 TP styles; use FSDP2/HSDP/DDP, PP or CP with float8"
        )
    if not KIND_CONFIGS[cfg.model.kind].float8_and_offload:
        raise ConfigError(
            f"{key}: model.kind {cfg.model.kind} does not convert its linears (float8 applies to model.kind: causal_lm)"
        )


def check_cp_config(cfg) -> None:
    """The rules of context parallelism (``distributed.cp_size`` > 1) for ``cfg`` (a ``JobConfig``)."""
    cp = cfg.distributed.cp_size
    if cp == 1:
        return
    if KIND_CONFIGS[cfg.model.kind].bucketed:
        raise ConfigError(
            f"distributed.cp_size={cp} splits packed text rows: model.kind {cfg.model.kind} is not "
            "supported (set cp_size to 1)"
        )
    if cfg.distributed.pp_size > 1:
        raise ConfigError(
            f"distributed.cp_size={cp} with pp_size={cfg.distributed.pp_size}: pipeline stages do "
            "not pass the CP attention group yet (set one of them to 1)"
        )
    check_cp_rows(cfg.data, cp, "data")
    if cfg.model.attn_implementation != ATTENTION_NAME:
        raise ConfigError(
            f"distributed.cp_size={cp} runs attention through {ATTENTION_NAME}: set "
            f"model.attn_implementation={ATTENTION_NAME} (got {cfg.model.attn_implementation})"
        )


def check_cp_rows(data, cp: int, key: str) -> None:
    """Context parallelism cuts each packed row into 2 x cp chunks: ``data`` (the ``key`` section, a
    ``DataConfig``: ``data`` or the val stream's ``data.val``) must pack rows of a length divisible by 2 x cp."""
    if data.packing == "none" or data.seq_len is None:
        raise ConfigError(
            f"distributed.cp_size={cp} needs packed THD rows: set {key}.packing to greedy or best_fit "
            f"and {key}.seq_len (got packing {data.packing}, seq_len {data.seq_len}; packing: none "
            "gives one padded document per row)"
        )
    if data.seq_len % (2 * cp):
        raise ConfigError(
            f"{key}.seq_len={data.seq_len} must be divisible by 2 x distributed.cp_size = {2 * cp} "
            "(each row is cut into 2 x cp_size chunks)"
        )


def check_validation(cfg) -> None:
    """The rules of validation (``trainer.eval_every``, ``python -m headrace.training.eval``): the val stream runs on the
    job's layout."""
    val_cfg, dist_cfg = val_data_config(cfg.data), cfg.distributed
    if val_cfg is None:
        raise ConfigError(
            "data.val: validation needs a val stream: set data.val in the job config or as an "
            "override, e.g. 'data.val={datasets: [{path: DATASET_DIR, split: val}]}'"
        )
    if dist_cfg.cp_size > 1:
        check_cp_rows(val_cfg, dist_cfg.cp_size, "data.val")
    if dist_cfg.pp_size > 1 and schedule_class_name(dist_cfg.pipeline.pp_schedule) in V_SHAPED:
        raise ConfigError(
            f"distributed.pipeline.pp_schedule {dist_cfg.pipeline.pp_schedule}: validation is not "
            "supported under the V schedules (torch 2.13's forward-only schedule.eval still hands "
            "gradients between a rank's two stages and fails); validate with another schedule, e.g. "
            "python -m headrace.training.eval ... distributed.pipeline.pp_schedule=1f1b"
        )


def check_data_paths(data, key: str = "data") -> None:
    """ConfigError naming the key of a local dataset path of ``data.datasets`` (a ``DataConfig``: the job's, or
    its val stream's with ``key`` ``data.val``) that does not exist (URLs are left to the loader)."""
    for i, entry in enumerate(data.datasets):
        if "://" not in entry.path and not os.path.exists(entry.path):
            raise ConfigError(f"{key}.datasets[{i}].path: {entry.path} does not exist")


def check_vocab(vocab_size: int, tokenizer_path: str | None, sources: Sequence[ShardSource | LhotseCutSource]) -> None:
    """ConfigError when the tokenizer or a shard's recorded largest token id does not fit the model's
    ``vocab_size`` (``sources``: the loader's, ``Loader.stream.sources``; every one has an index)."""
    if tokenizer_path:
        from tokenizers import Tokenizer

        file = Path(tokenizer_path) / "tokenizer.json" if Path(tokenizer_path).is_dir() else Path(tokenizer_path)
        if not file.is_file():
            raise ConfigError(f"model.tokenizer: {file} does not exist")
        size = Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
        if size > vocab_size:
            raise ConfigError(
                f"model.tokenizer: {tokenizer_path} has {size} tokens, more than the model's "
                f"vocab_size {vocab_size}; token ids >= {vocab_size} have no embedding"
            )
    for source in sources:
        for shard in source.index.shards:
            if shard.max_token is not None and shard.max_token >= vocab_size:
                raise ConfigError(
                    f"data: {source.path}/{shard.name} holds token id {shard.max_token}, "
                    f"outside the model's vocab_size {vocab_size} (tokenized for another model?)"
                )


__all__ = [
    "check_config",
    "check_cp_config",
    "check_cp_rows",
    "check_data_paths",
    "check_float8_config",
    "check_job",
    "check_validation",
    "check_vocab",
]
