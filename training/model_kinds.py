"""The registered model kinds, by ``model.kind``, and the one place the job's model is built through its kind.

A new kind is a module that builds a ``ModelKind`` (``headrace.training.protocols.model_kind``) and one entry
in ``MODEL_KINDS`` (``docs/adding-a-model-kind.md``). ``build_model_or_pipeline`` is what the trainer and
``headrace.training.eval`` call: the kind's model, or its pipeline stages when pp > 1.
"""

from __future__ import annotations

import torch
from torch import nn

from headrace.training.causal_lm import CAUSAL_LM
from headrace.training.config.job_config import JobConfig
from headrace.training.distributed.parallel_dims import ParallelDims
from headrace.training.distributed.pipeline import Pipeline
from headrace.training.protocols.model_kind import ModelKind
from headrace.training.speech.ctc_kind import CTC_KIND
from headrace.training.speech.kind import SALM_KIND

MODEL_KINDS: dict[str, ModelKind] = {kind.name: kind for kind in (CAUSAL_LM, SALM_KIND, CTC_KIND)}


def model_kind(cfg: JobConfig) -> ModelKind:
    """The spec of ``cfg.model.kind`` (the config's type already limits it to a registered name)."""
    return MODEL_KINDS[cfg.model.kind]


def build_model(cfg: JobConfig, dims: ParallelDims, device: torch.device):
    """The kind's ``build_model``: (model, llm config), the whole model on this rank's shards."""
    return model_kind(cfg).build_model(cfg, dims, device)


def build_model_or_pipeline(
    cfg: JobConfig, dims: ParallelDims, device: torch.device
) -> tuple[nn.Module, object, Pipeline | None]:
    """``(model, llm config, pipe)``: with pp > 1 this rank's pipeline (``headrace.training.distributed.pipeline``)
    and its model part (transformers' names), else ``build_model``'s model and None."""
    kind = model_kind(cfg)
    if dims.pp == 1:
        return *kind.build_model(cfg, dims, device), None
    if kind.build_pipeline is None:
        raise ValueError(
            f"pp_size > 1 splits a causal LM; model.kind {kind.name!r} has no pipeline split rule "
            "(set distributed.pp_size=1)"
        )
    hf_config = kind.llm_config(cfg.model)
    pipe = kind.build_pipeline(cfg, dims, device, hf_config)
    return pipe.part, hf_config, pipe


__all__ = ["MODEL_KINDS", "build_model", "build_model_or_pipeline", "model_kind"]
