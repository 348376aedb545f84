"""The ``peft:`` section (LoRA), as NeMo Automodel's recipes and Hugging Face ``LoraConfig`` spell it.

    peft:                          # NeMo Automodel's block, as written
      _target_: nemo_automodel.components._peft.lora.PeftConfig
      target_modules: ["*.q_proj", "*.v_proj"]    # or match_all_linear: true, or exclude_modules: [...]
      dim: 8
      alpha: 32
      dropout: 0.0
    peft: {r: 8, lora_alpha: 32, lora_dropout: 0.05, target_modules: [q_proj, v_proj]}   # Hugging Face's names

``translate_peft`` maps the Hugging Face names (``r``, ``lora_alpha``, ``lora_dropout``: peft drops out the
adapter's input, so ``dropout_position: pre``) and Automodel's ``_target_`` onto ``PeftConfig`` before the tree is
typed. Every other key of either block is accepted only at the value that means what this trainer does
(``use_triton: false``, ``lora_dtype: null``, ``bias: none``, ...); any other value, or a key neither block has,
fails with one line naming it. ``headrace.training.models.lora`` applies the config (docs/lora.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from headrace.config import ConfigError

AUTOMODEL_TARGET = "nemo_automodel.components._peft.lora.PeftConfig"
HF_NAMES = {"r": "dim", "lora_alpha": "alpha", "lora_dropout": "dropout"}
# key -> (values meaning what this trainer does, why other values are refused); consumed, no field of their own
ACCEPTED_AT_DEFAULT = {
    "use_triton": ((False,), "the Triton LoRA kernel is not implemented here: the adapter runs as two matmuls"),
    "lora_dtype": ((None,), "adapters keep the base's fp32 master dtype; bf16 compute comes from trainer.precision"),
    "bias": (("none",), "only the LoRA matrices are trained (peft's bias: none)"),
    "use_rslora": ((False,), "the scale is alpha / r (rank-stabilized scaling is not implemented)"),
    "use_dora": ((False,), "DoRA is not implemented"),
    "fan_in_fan_out": ((False,), "transformers' nn.Linear layers store (out, in)"),
    "modules_to_save": (
        (None, []),
        "train whole modules through the model's own settings (e.g. a SALM's "
        "model.speech.adapter), not peft.modules_to_save",
    ),
    "task_type": ((None, "CAUSAL_LM"), "this trainer trains causal LMs"),
    "init_lora_weights": ((True,), "set the adapter's init with lora_A_init"),
    "inference_mode": ((False,), "training needs trainable adapters"),
}


@dataclass(kw_only=True)
class PeftConfig:
    """LoRA on the selected ``nn.Linear`` layers: ``y = W x + (alpha / dim) * B A x``, ``W`` frozen.

    Module selection (names as in the transformers model, e.g. ``model.layers.0.self_attn.q_proj``; a SALM's
    encoder's as in its encoder): a pattern with ``*`` is a wildcard over the whole name (Automodel's rule),
    one without is the name or its last components (peft's rule: ``q_proj``); ``exclude_modules`` removes names;
    none given: ``*_proj``; ``match_all_linear``: every ``nn.Linear`` but the ``lm_head`` (the loss reads its weight
    in chunks, headrace.training.models.loss)."""

    target_modules: list[str] | None = None  # None: the default selection; [] selects nothing and is refused
    exclude_modules: list[str] = field(default_factory=list)
    match_all_linear: bool = False
    dim: int = 8  # the rank r
    alpha: float = 32.0
    dropout: float = 0.0
    dropout_position: Literal["pre", "post"] = "post"  # pre: on the adapter's input (peft); post: on its output
    lora_A_init: Literal["kaiming", "xavier"] = "kaiming"  # kaiming: peft's default (B starts at zero either way)
    pretrained_path: str | None = None  # a peft adapter directory (adapter_config.json + adapter_model.safetensors)
    export_adapter: bool = True  # write output_dir/lora/ (a peft adapter directory) beside the merged hf/
    parts: list[Literal["llm", "encoder"]] = field(default_factory=lambda: ["llm"])  # model.kind salm: where

    @property
    def scaling(self) -> float:
        return self.alpha / self.dim


def translate_peft(raw: dict) -> None:
    """Rewrite ``raw["peft"]`` (a YAML dict) in place into ``PeftConfig`` keys (module docstring)."""
    section = raw.get("peft")
    if not isinstance(section, dict):
        return
    target = section.pop("_target_", AUTOMODEL_TARGET)
    if target != AUTOMODEL_TARGET:
        raise ConfigError(f"peft._target_={target!r}: only LoRA ({AUTOMODEL_TARGET}) is implemented")
    for hf_name, name in HF_NAMES.items():
        if hf_name in section:
            if name in section:
                raise ConfigError(f"peft: {hf_name} and {name} are the same setting; set one of them")
            section[name] = section.pop(hf_name)
            if hf_name == "lora_dropout":
                section.setdefault("dropout_position", "pre")  # where peft applies it
    for key, (accepted, reason) in ACCEPTED_AT_DEFAULT.items():
        if key in section:
            value = section.pop(key)
            if value not in accepted:
                raise ConfigError(f"peft.{key}={value!r} is not supported: {reason}")
    for key in ("target_modules", "exclude_modules"):
        if isinstance(section.get(key), str):  # Automodel and peft take one pattern as a string
            section[key] = [section[key]]


def check_peft(peft: PeftConfig | None, model_kind: str, kind_parts: tuple[str, ...]) -> None:
    """ConfigError for a ``peft:`` value no model could honour (called by ``check_config``); ``kind_parts``: the
    parts model kind ``model_kind`` has adapters for."""
    if peft is None:
        return
    if peft.dim < 1:
        raise ConfigError(f"peft.dim (r) must be >= 1, got {peft.dim}")
    if not (math.isfinite(peft.alpha) and peft.alpha > 0):
        raise ConfigError(
            f"peft.alpha must be a finite number > 0, got {peft.alpha} (the adapter's output is scaled by "
            "alpha / dim: at 0 training cannot change the model)"
        )
    if peft.target_modules == []:
        raise ConfigError(
            "peft.target_modules: [] selects no module; leave it out for the default (*_proj), or name modules"
        )
    if not 0 <= peft.dropout < 1:
        raise ConfigError(f"peft.dropout must be in [0, 1), got {peft.dropout}")
    if peft.match_all_linear and peft.target_modules:
        raise ConfigError("peft: match_all_linear and target_modules both select modules; set one of them")
    if not set(peft.parts) <= set(kind_parts):
        raise ConfigError(f"peft.parts={peft.parts}: model.kind {model_kind} has parts {', '.join(kind_parts)}")
    if not peft.parts or len(set(peft.parts)) != len(peft.parts):
        raise ConfigError(f"peft.parts: name llm and/or encoder once each, got {peft.parts}")


__all__ = ["ACCEPTED_AT_DEFAULT", "AUTOMODEL_TARGET", "PeftConfig", "check_peft", "translate_peft"]
