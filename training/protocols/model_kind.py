"""The model kind's spec: everything the trainer, validation, ``headrace.training.eval`` and the tools need to know
about one kind of model (a causal LM, a speech LLM, ...), as one object, so none of them asks which kind it is.

torchtitan's ``TrainSpec`` (``torchtitan/protocols/train_spec.py``) is the model: one frozen record of functions per
model, registered by name (``headrace.training.model_kinds``); the loop looks the job's ``model.kind`` up once and
calls through the record. Adding a kind is one module that builds a ``ModelKind`` plus its config section
(``docs/adding-a-model-kind.md``). Cost: none at run time (a dict lookup per job).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from headrace.training.config.job_config import JobConfig, KindConfig, ModelConfig
    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.distributed.pipeline import Pipeline

# forward(model, micro_batch, autocast) -> the micro-batch's summed loss (a 0-d tensor)
Forward = Callable[["nn.Module", dict, bool], "torch.Tensor"]


@dataclass(frozen=True, kw_only=True)
class ModelKind:
    """One model kind (``model.kind`` in the job config). Every field is a plain function; None where the kind
    does without the feature (the caller then refuses the job with a line naming the kind)."""

    name: str
    # What the config alone knows of the kind (``KIND_CONFIGS[name]``: its sections, bucketed batches, whether it
    # has an LLM whose vocabulary the loader's tokens index and whose FLOPs the MFU counts, ...).
    config: KindConfig
    # The transformers config of the language model (vocabulary, FLOPs, checkpoint record); a SALM's: its LLM's.
    llm_config: Callable[[ModelConfig], PretrainedConfig]
    # The job as it trains: parts taken from a released checkpoint filled in (identity for most kinds).
    prepare_job: Callable[[JobConfig], JobConfig]
    # meta model -> parallelize -> this rank's shards -> init / load (-> DDP): (model, llm config).
    build_model: Callable[[JobConfig, ParallelDims, torch.device], tuple[nn.Module, PretrainedConfig]]
    # This rank's pipeline stages when pp > 1 (None: the kind has no pipeline split rule).
    build_pipeline: Callable[[JobConfig, ParallelDims, torch.device, PretrainedConfig], Pipeline] | None
    # The step's (and validation's) forward for this layout: ``forward(model, batch, autocast)`` -> summed loss.
    step_forward: Callable[[JobConfig, ParallelDims], Forward]
    # The loader's batches -> the step's batches (identity when the loader already yields them).
    wrap_loader: Callable[[Iterable, nn.Module, JobConfig, ParallelDims], Iterable]
    # ``run(forward)`` is one validation pass; the kind may add passes of its own (a SALM: mismatched audio).
    validate: Callable[[Callable[[Forward], dict], Forward], dict]
    # The consolidated export of the trained model under ``out_dir`` (``hf/`` at least). Collective.
    export: Callable[[nn.Module, PretrainedConfig, JobConfig, Path], None]
    # Decoding during training: ``decode(model, cfg, step)`` after every step, its figures on the steps it
    # decodes (rank 0), ``{}`` on the others; None: never.
    decode: Callable[[nn.Module, JobConfig, int], dict] | None = None
    # Why ``python -m headrace.training.eval`` cannot start from this kind's ``hf/`` export (None: it can).
    hf_export_refusal: str | None = None
    # The kind's own validation pass ``(model, val batches, cfg, device, dp_group)`` -> figures (a CTC stage: the
    # loss and the greedy decodes' WER / CER), instead of ``validate``'s loss pass; None: ``validate``.
    own_validation: Callable[..., dict] | None = None
    # After a validation: a line to say once a run (a SALM still not listening), or None; None: nothing to say.
    val_warning: Callable[[dict, JobConfig], str | None] | None = None
    # The batch a rank whose share of the val stream is empty runs (loss-free padding rows), from the loader
    # ``build_loader`` made; None: such a rank cannot pad (the val set must give every rank a batch).
    empty_val_batch: Callable[[Iterable], dict] | None = None
    # ``headrace.training.estimate_batch``: (model on ``device``, its step-batch maker); None: not a bucketed kind.
    batch_probe: Callable[[JobConfig, torch.device], tuple[nn.Module, object]] | None = None


def same_job(cfg: JobConfig) -> JobConfig:
    """``prepare_job`` of a kind whose job needs nothing filled in."""
    return cfg


def same_loader(loader: Iterable, model, cfg, dims) -> Iterable:
    """``wrap_loader`` of a kind whose loader yields the step's batches already."""
    return loader


def one_pass(run: Callable[[Forward], dict], forward: Forward) -> dict:
    """``validate`` of a kind with nothing but the loss pass."""
    return run(forward)


__all__ = ["Forward", "ModelKind", "one_pass", "same_job", "same_loader"]
