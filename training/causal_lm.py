"""The causal LM's model kind (``model.kind: causal_lm``, the default): any transformers ``AutoModelForCausalLM``
(``headrace.training.models.families``) trained on packed THD rows.

Build: the model on the meta device wrapped in ``CausalLMLoss`` (forward = decoder + lm_head cross-entropy in
token chunks, so the fp32 ``[tokens, vocab]`` logits never exist), parallelized by its family's recipe
(``headrace.training.distributed.parallelize``), each rank's shard materialized (init or ``model.pretrained_path``),
DDP last when asked; with pp > 1 this rank's pipeline stages (``headrace.training.distributed.pipeline``). The step's
forward is ``headrace.training.step.forward_loss_sum``, with the cp group's attention when cp > 1. Export:
``checkpoint.export_hf`` (``hf/``, loadable by ``AutoModelForCausalLM``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from headrace.training import step
from headrace.training.checkpoint import export
from headrace.training.config.job_config import KIND_CONFIGS, JobConfig
from headrace.training.distributed.context_parallel import cp_attention_kwargs
from headrace.training.distributed.dense import apply_ddp
from headrace.training.distributed.parallel_dims import ParallelDims
from headrace.training.distributed.parallelize import parallelize
from headrace.training.distributed.pipeline import build_pipeline
from headrace.training.models.build import build_hf_config, build_meta_model, materialize, param_dtype
from headrace.training.models.converters import build_converters
from headrace.training.models.loss import CausalLMLoss
from headrace.training.protocols.model_kind import Forward, ModelKind, one_pass, same_job, same_loader


def build_causal_lm(cfg: JobConfig, dims: ParallelDims, device: torch.device) -> tuple[nn.Module, PretrainedConfig]:
    """meta ``CausalLMLoss`` -> the job's model converters (``headrace.training.models.converters``) -> parallelize
    (the converters' hook after TP) -> allocate this rank's shards -> init or load -> the converters' hook after
    it (-> DDP). The whole model is the converters' one part, ``llm``. Returns (model, hf_config)."""
    hf_config = build_hf_config(cfg.model)
    model = CausalLMLoss(build_meta_model(hf_config))
    converters = build_converters(cfg)
    converters.convert(model, device)
    model = parallelize(
        model,
        dims,
        cfg.distributed,
        param_dtype(cfg.trainer.precision),
        after_tp=converters.after_tp(lambda m: {"llm": m}),
    )
    materialize(model, device, cfg.model.pretrained_path, offload=cfg.distributed.offload_policy == "cpu")
    converters.after_materialize({"llm": model})
    if cfg.distributed.strategy == "ddp":
        model = apply_ddp(model, dims)
    return model, hf_config


def causal_lm_forward(cfg: JobConfig, dims: ParallelDims) -> Forward:
    """The chunked loss of ``CausalLMLoss``; attention over the cp group when cp > 1
    (``headrace.training.distributed.context_parallel``). Looked up in ``step`` when called, so a test may
    replace ``step.forward_loss_sum``."""
    if dims.cp_enabled:
        return functools.partial(
            step.forward_loss_sum, attention_kwargs=cp_attention_kwargs(dims.get_mesh("cp"), cfg.distributed.cp_comm)
        )
    return step.forward_loss_sum


def export_causal_lm(model: nn.Module, hf_config: PretrainedConfig, cfg: JobConfig, out_dir: Path) -> None:
    """``out_dir/hf``: the consolidated model and its tokenizer (``checkpoint.export_hf``). Collective."""
    export.export_hf(
        model,
        hf_config,
        out_dir / "hf",
        cfg.model.tokenizer,
        shard_size_mb=cfg.checkpoint.export_shard_size_mb,
        experts_layout=cfg.checkpoint.export_hf_experts,
        transform=build_converters(cfg).export_transform("llm"),
    )


CAUSAL_LM = ModelKind(
    name="causal_lm",
    config=KIND_CONFIGS["causal_lm"],
    llm_config=build_hf_config,
    prepare_job=same_job,
    build_model=build_causal_lm,
    build_pipeline=build_pipeline,
    step_forward=causal_lm_forward,
    wrap_loader=same_loader,
    validate=one_pass,
    export=export_causal_lm,
    empty_val_batch=lambda loader: loader.stage.padding_batch(),
)

__all__ = ["CAUSAL_LM", "build_causal_lm", "causal_lm_forward", "export_causal_lm"]
