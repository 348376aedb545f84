"""Loading a job: YAML (or a dict) plus dotted ``a.b=c`` overrides, NeMo Automodel's spellings translated, typed
into the ``JobConfig`` tree and checked against the rules of the config alone (``headrace.training.config.validate``).
Cost: the YAML parse; nothing is imported from transformers and no file but the YAML is read.
"""

from __future__ import annotations

import copy

from headrace.config import apply_overrides, from_dict, load_yaml
from headrace.training.config.automodel_compat import translate_distributed, translate_fp8
from headrace.training.config.job_config import JobConfig
from headrace.training.config.peft import translate_peft
from headrace.training.config.validate import check_config


def load_job_config(path: str | None, overrides: list[str] = (), base: dict | None = None) -> JobConfig:
    """Read ``path`` (YAML) or ``base``, apply dotted overrides, check the types and the rules of the config
    alone (``check_config``): the one way to get a JobConfig."""
    raw = load_yaml(path) if path else copy.deepcopy(base or {})
    apply_overrides(raw, list(overrides))
    translate_distributed(raw)  # Automodel's spellings (dp_size: none, ...); unsupported keys fail here
    translate_fp8(raw)  # Automodel's top-level fp8: block -> quantize.linear.float8
    translate_peft(raw)  # Automodel's / Hugging Face's LoRA names; keys that mean something else fail here
    cfg = from_dict(JobConfig, raw, "")
    check_config(cfg)
    return cfg


__all__ = ["load_job_config"]
