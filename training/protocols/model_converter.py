"""The model converter's protocol: a change to the model a job's config asks for (LoRA adapters, float8 linears)
that the trainer, validation, ``headrace.training.eval`` and the model kinds apply without naming it.

torchtitan's ``protocols/model_converter.py`` is the model: a list of converters built from the config, each
converting the model on the meta device before it is parallelized, with an optional hook after every optimizer
step. headrace's converters also hook the points a frozen base or a merged export needs (after tensor
parallelism, after the weights are materialized, the checkpoint's record, the ``hf/`` export's state). Every hook
has a default that does nothing, so a converter implements only the points it changes. ``ModelConverters``
(``headrace.training.models.converters``) runs the job's list in order at each point. Adding a converter: its
own module and one registry entry (``docs/adding-a-model-converter.md``). Cost: one loop over the job's
converters per build point (none when the job names none).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from headrace.training.config.job_config import JobConfig

# ``state -> state``: what the ``hf/`` export writes of a part, from the model's state dict (None: as it is)
StateTransform = Callable[[dict], dict]


class ModelConverter:
    """One converter of a job (the registry builds it from the job's config). ``parts`` below maps the names a
    kind gives its convertible parts (``llm``; a SALM's also ``encoder``) to those modules."""

    name: str = ""
    # The checkpoint holds only the trainable parameters (a frozen base is rebuilt from the job, not stored).
    trainable_only: bool = False
    # The ``hf/`` export has this converter merged in: a job evaluating that export leaves it out.
    merged_on_export: bool = False

    def convert(self, model: nn.Module, device: torch.device) -> None:
        """The whole model on the meta device, before it is parallelized (torchtitan's ``convert``)."""

    def after_tp(self, parts: dict[str, nn.Module]) -> None:
        """Inside the parallelize function, after tensor parallelism and before FSDP2 (modules sharded by TP)."""

    def after_materialize(self, parts: dict[str, nn.Module]) -> None:
        """After this rank's shards are allocated and initialized or loaded. Collective."""

    def post_optimizer_hook(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Once, after the optimizer is built: hooks of its own on the optimizer (``register_step_post_hook``)."""

    def model_record(self, job: JobConfig) -> dict:
        """Entries of the checkpoint's model record (a resume compares them)."""
        return {}

    def saved_line(self, path: Path | str, model: nn.Module, job: JobConfig) -> str | None:
        """A line rank 0 says after a checkpoint save, or None."""
        return None

    def export_transform(self, part: str) -> StateTransform | None:
        """What the ``hf/`` export writes of part ``part`` (a merged adapter), or None: the state as it is."""
        return None

    def export(self, model: nn.Module, job: JobConfig, out_dir: Path) -> None:
        """Beside the kind's export under ``out_dir``: this converter's own files. Collective."""


__all__ = ["ModelConverter", "StateTransform"]
