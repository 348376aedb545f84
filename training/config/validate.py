"""Start-up checks of a training job's inputs: every rule a value must meet, before anything runs.

``check_job(cfg, world_size)`` runs on every rank before the process group is used and raises
``ConfigError`` (the dotted key and the rule) for a value the types alone do not exclude: counts that
must be positive, a learning rate that must be > 0, an unknown ``model_type``, inconsistent parallel
degrees. ``check_vocab(...)`` compares the tokenizer's vocabulary and the largest token id each shard
recorded (``ShardInfo.max_token``, written by ``dataio shard``/``dataio index``) with the model's
``vocab_size``, so an out-of-range id is a line naming the shard, not an ``IndexError`` deep in the
embedding. Both are pure reads of the config and index metadata (microseconds, no data read).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from configtree import ConfigError

# dotted key -> (rule text, predicate); None passes where the field is optional
_RULES: dict[str, tuple[str, Callable]] = {
    "trainer.max_steps": (">= 1", lambda v: v >= 1),
    "trainer.grad_accum": (">= 1", lambda v: v >= 1),
    "trainer.log_every": (">= 1", lambda v: v >= 1),
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


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_job(cfg, world_size: int | None = None) -> None:
    """ConfigError for the first value of ``cfg`` (a ``JobConfig``) that breaks a rule (module docstring)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from training.distributed.parallel_dims import ParallelDims

    for key, (rule, ok) in _RULES.items():
        value = _get(cfg, key)
        if not ok(value):
            raise ConfigError(f"{key}: must be {rule}, got {value!r}")
    if cfg.model.config is not None:
        model_type = cfg.model.config.get("model_type")
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ConfigError(f"model.config.model_type: {model_type!r} is not a causal LM model type of "
                              f"transformers (e.g. llama, qwen3, mistral, qwen3_moe)")
    else:
        path = cfg.model.config_path or cfg.model.pretrained_path
        if not os.path.exists(path):
            key = "model.config_path" if cfg.model.config_path else "model.pretrained_path"
            raise ConfigError(f"{key}: {path} does not exist")
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    try:
        ParallelDims.from_config(cfg.distributed, world_size)
    except ValueError as e:  # its messages name the rule; here they become a config error (one line)
        raise ConfigError(str(e) if str(e).startswith("distributed.") else f"distributed: {e}") from None
    if cfg.trainer.eval_every:
        from training.config.validate import check_validation

        check_validation(cfg)


def check_vocab(vocab_size: int, tokenizer_path: str | None, sources) -> None:
    """ConfigError when the tokenizer or a shard's recorded largest token id does not fit the model's
    ``vocab_size`` (``sources``: the loader's ``ShardSource``s; others are skipped)."""
    if tokenizer_path:
        from tokenizers import Tokenizer

        file = Path(tokenizer_path) / "tokenizer.json" if Path(tokenizer_path).is_dir() else Path(tokenizer_path)
        if not file.is_file():
            raise ConfigError(f"model.tokenizer: {file} does not exist")
        size = Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
        if size > vocab_size:
            raise ConfigError(f"model.tokenizer: {tokenizer_path} has {size} tokens, more than the model's "
                              f"vocab_size {vocab_size}; token ids >= {vocab_size} have no embedding")
    for source in sources:
        index = getattr(source, "index", None)
        for shard in getattr(index, "shards", ()):
            if shard.max_token is not None and shard.max_token >= vocab_size:
                raise ConfigError(f"data: {source.path}/{shard.name} holds token id {shard.max_token}, "
                                  f"outside the model's vocab_size {vocab_size} (tokenized for another model?)")


__all__ = ["check_job", "check_vocab"]
