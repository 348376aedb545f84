"""The registered model converters, by the config section that turns each on, and the job's list of them.

A converter (``headrace.training.protocols.model_converter``) is built from its section when the job sets it;
``build_converters`` returns the job's converters as one ``ModelConverters``, which the model kinds, the
pipeline, the trainer and ``headrace.training.eval`` call at each build point without naming any converter.
Adding one: its module (the ``ModelConverter`` and its config section) and one ``CONVERTERS`` entry
(``docs/adding-a-model-converter.md``). Cost: a getattr chain per registered converter per job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce
from pathlib import Path

import torch
from torch import nn

from headrace.training.config.job_config import JobConfig
from headrace.training.models.float8 import Float8Converter
from headrace.training.models.lora import LoRAConverter
from headrace.training.protocols.model_converter import ModelConverter, StateTransform

# the job config's section (dotted path) -> the converter built from it when the section is set; in this order
CONVERTERS: dict[str, Callable[[object], ModelConverter]] = {
    "quantize.linear.float8": Float8Converter,
    "peft": LoRAConverter,
}


def section(cfg: JobConfig, path: str):
    """The config value at dotted ``path`` (None: the converter is off)."""
    return reduce(getattr, path.split("."), cfg)


def without_section(cfg, path: str):
    """A copy of ``cfg`` with the value at dotted ``path`` set to None (``cfg`` itself is left as it is)."""
    head, _, rest = path.partition(".")
    value = None if not rest else without_section(getattr(cfg, head), rest)
    return dataclasses.replace(cfg, **{head: value})


@dataclass(frozen=True)
class ModelConverters:
    """The job's converters, each build point run over all of them in ``CONVERTERS`` order."""

    items: tuple[ModelConverter, ...]

    @property
    def trainable_only(self) -> bool:
        """Checkpoints hold only the trainable parameters (a frozen base is rebuilt from the job)."""
        return any(c.trainable_only for c in self.items)

    def convert(self, model: nn.Module, device: torch.device) -> None:
        for converter in self.items:
            converter.convert(model, device)

    def after_tp(self, parts_of: Callable[[nn.Module], dict[str, nn.Module]]) -> Callable[[nn.Module], None] | None:
        """The hook a parallelize function runs after TP (``parts_of(model)``: the kind's convertible parts);
        None when no converter has one."""
        hooked = [c for c in self.items if type(c).after_tp is not ModelConverter.after_tp]
        if not hooked:
            return None

        def after_tp(model: nn.Module) -> None:
            for converter in hooked:
                converter.after_tp(parts_of(model))

        return after_tp

    def after_materialize(self, parts: dict[str, nn.Module]) -> None:
        for converter in self.items:
            converter.after_materialize(parts)

    def post_optimizer_hook(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        for converter in self.items:
            converter.post_optimizer_hook(model, optimizer)

    def model_record(self, job: JobConfig) -> dict:
        return {key: value for c in self.items for key, value in c.model_record(job).items()}

    def saved_lines(self, path: Path | str, model: nn.Module, job: JobConfig) -> list[str]:
        return [line for c in self.items if (line := c.saved_line(path, model, job)) is not None]

    def export_transform(self, part: str) -> StateTransform | None:
        """Every converter's transform of part ``part``'s exported state, in order; None when none has one."""
        transforms = [t for c in self.items if (t := c.export_transform(part)) is not None]
        if not transforms:
            return None
        if len(transforms) == 1:
            return transforms[0]
        return lambda state: reduce(lambda s, t: t(s), transforms, state)

    def export(self, model: nn.Module, job: JobConfig, out_dir: Path) -> None:
        for converter in self.items:
            converter.export(model, job, out_dir)


def build_converters(cfg: JobConfig) -> ModelConverters:
    """The converters ``cfg`` turns on, in ``CONVERTERS`` order."""
    return ModelConverters(
        items=tuple(build(value) for path, build in CONVERTERS.items() if (value := section(cfg, path)) is not None)
    )


def for_merged_export(cfg: JobConfig) -> JobConfig:
    """``cfg`` for a model loaded from its own ``hf/`` export: without the converters the export merged in
    (a LoRA run's ``hf/`` holds the merged model)."""
    for path, build in CONVERTERS.items():
        if (value := section(cfg, path)) is not None and build(value).merged_on_export:
            cfg = without_section(cfg, path)
    return cfg


__all__ = ["CONVERTERS", "ModelConverters", "build_converters", "for_merged_export"]
