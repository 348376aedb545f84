"""The CTC stage's model kind (``model.kind: ctc``): ``model.speech``'s encoder trained alone with a CTC head on
bucketed audio (``headrace.training.speech.ctc``), to start a SALM's encoder from its ``encoder/`` export.

What differs from a SALM: no LLM (``llm_config`` is the encoder's config, its ``vocab_size`` the units + blank),
so no vocabulary check of the shards' token ids (the transcripts become characters or tokenizer pieces in
``wrap_loader``) and no FLOP count; validation is its own pass (the loss plus greedy-decode WER / CER); the export
is ``encoder/`` + ``head/`` + ``ctc.json``. Data-parallel layouts only (FSDP2 / HSDP / DDP).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn
from transformers import PretrainedConfig

from headrace.training.config.job_config import KIND_CONFIGS, JobConfig, ModelConfig
from headrace.training.distributed.parallel_dims import ParallelDims
from headrace.training.protocols.model_kind import Forward, ModelKind, one_pass, same_job
from headrace.training.speech.ctc import build_ctc, ctc_loss_sum, ctc_units, export_ctc, validate_ctc, wrap_ctc_loader
from headrace.training.speech.encoders import front_end


def encoder_config(model: ModelConfig) -> PretrainedConfig:
    """The encoder's transformers config, ``vocab_size`` = its CTC units + the blank."""
    speech = model.speech
    config = front_end(speech.encoder.kind, speech.features).config(speech.encoder)
    config.vocab_size = ctc_units(model).size + 1
    return config


def ctc_forward(cfg: JobConfig, dims: ParallelDims) -> Forward:
    return ctc_loss_sum


def export(model: nn.Module, hf_config: PretrainedConfig, cfg: JobConfig, out_dir: Path) -> None:
    export_ctc(model, cfg, out_dir)


def validate(model: nn.Module, batches, cfg: JobConfig, device, dp_group) -> dict:
    return validate_ctc(model, batches, ctc_units(cfg.model), device, dp_group=dp_group)


CTC_KIND = ModelKind(
    name="ctc",
    config=KIND_CONFIGS["ctc"],
    llm_config=encoder_config,
    prepare_job=same_job,
    build_model=build_ctc,
    build_pipeline=None,
    step_forward=ctc_forward,
    wrap_loader=wrap_ctc_loader,
    validate=one_pass,
    export=export,
    hf_export_refusal="a CTC stage has no hf/ export (its export is encoder/ + head/): evaluate its DCP checkpoints",
    own_validation=validate,
)

__all__ = ["CTC_KIND", "ctc_forward", "encoder_config"]
