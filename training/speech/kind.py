"""The SALM's model kind (``model.kind: salm``): speech encoder + adapter + a transformers causal LM, trained on
bucketed audio batches (``headrace.training.speech.job``).

What differs from the causal LM (``headrace.training.causal_lm``): the job may start from a released speech LLM
(``with_speech_llm`` fills its parts in), the loader's audio batches get the prompt + transcript token layout
(``wrap_loader``), validation adds the mismatched-audio pass (``headrace.training.speech.listening``), the model
decodes its eval split every ``model.speech.eval_every`` steps, the export holds four parts (``export_salm``),
and ``headrace.training.estimate_batch`` sizes its buckets. No pipeline split rule (pp > 1 is refused).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from headrace.training.config.job_config import KIND_CONFIGS, JobConfig
from headrace.training.distributed.parallel_dims import ParallelDims
from headrace.training.models.build import build_hf_config
from headrace.training.protocols.model_kind import Forward, ModelKind
from headrace.training.speech.checkpoints import with_speech_llm
from headrace.training.speech.eval import eval_in_training
from headrace.training.speech.job import SpeechBatches, build_salm, export_salm, salm_loss_sum, wrap_loader
from headrace.training.speech.listening import not_listening_warning, validate_listening
from headrace.training.speech.model import SALM, build_meta_salm, materialize_salm


def salm_forward(cfg: JobConfig, dims: ParallelDims) -> Forward:
    """The same forward in every layout: the SALM splits its own sequence under SP."""
    return salm_loss_sum


def export(model: nn.Module, hf_config: PretrainedConfig, cfg: JobConfig, out_dir: Path) -> None:
    export_salm(model, cfg, out_dir)


def decode_on_its_steps(model: nn.Module, cfg: JobConfig, step: int) -> dict:
    """``eval_in_training`` on the steps ``model.speech.eval_every`` names; ``{}`` on the others."""
    every = cfg.model.speech.eval_every
    return eval_in_training(model, cfg, step) if every and step % every == 0 else {}


def batch_probe(cfg: JobConfig, device: torch.device) -> tuple[SALM, SpeechBatches]:
    """The whole SALM on ``device`` (one process) and its step-batch maker, for ``estimate_batch``."""
    model = build_meta_salm(build_hf_config(cfg.model, text_model=True), cfg.model.speech)
    materialize_salm(model, device, cfg.model.pretrained_path)
    return model, SpeechBatches([], model, cfg.model.speech, cfg.model.tokenizer)


def not_listening(record: dict, cfg: JobConfig) -> str | None:
    """The warning of a SALM whose validation still shows it ignores the audio (``not_listening_warning``)."""
    return not_listening_warning(record, cfg.model.speech.warn_not_listening_after)


SALM_KIND = ModelKind(
    name="salm",
    config=KIND_CONFIGS["salm"],
    llm_config=functools.partial(build_hf_config, text_model=True),
    prepare_job=with_speech_llm,
    build_model=build_salm,
    build_pipeline=None,
    step_forward=salm_forward,
    wrap_loader=wrap_loader,
    validate=validate_listening,
    export=export,
    decode=decode_on_its_steps,
    hf_export_refusal="a SALM is evaluated from its DCP checkpoints (the hf/ export holds only its LLM); its "
    "decoding WER: python -m headrace.training.speech.eval",
    batch_probe=batch_probe,
    val_warning=not_listening,
)

__all__ = ["SALM_KIND", "batch_probe", "decode_on_its_steps", "not_listening", "salm_forward"]
