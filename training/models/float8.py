"""FP8 linears through torchao: ``quantize.linear.float8`` (torchtitan's section; Automodel's ``fp8:`` block).

``convert_linears`` swaps the model's ``nn.Linear`` layers for torchao ``Float8Linear`` on the meta device,
before tensor parallelism and FSDP2 (torchtitan's order: model converters, then parallelize). Each matmul
casts its input, weight and output gradient to float8 with dynamic scales (one per tensor, or per row with
``rowwise``) and runs ``torch._scaled_mm``; the weights, the optimizer state and everything else stay in
``trainer.precision``. The gain is the matmul time of large GEMMs (H100 and later: twice bf16's peak), paid
for by the casts and amax reductions around each one, so small layers are left alone.

Layers skipped, each with its reason (``convert_linears`` returns them; the trainer prints them):
- ``lm_head``: the chunked loss reads ``lm_head.weight`` straight into its own matmul
  (``headrace.kernels.loss``), so a Float8Linear there would never run;
- a name containing one of ``filter_fqns``;
- a layer whose input or output size is not a multiple of 16 (``torch._scaled_mm``'s alignment).

With FSDP2, ``enable_fsdp_float8_all_gather`` all-gathers the float8 weights (half bf16's bytes, tensorwise
only) and ``precompute_float8_dynamic_scale_for_fsdp`` computes every weight's scale in one all-reduce after
the optimizer step instead of one per layer in forward (``register_scale_precompute``). Hardware: CUDA
needs compute capability 8.9 (Ada, Hopper) or later; an older GPU is refused in one line unless ``emulate``
(torchao's emulated matmul, also what the CPU tests compare against). On CPU torch's own ``_scaled_mm`` runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from headrace.config import ConfigError
from headrace.training.config.job_config import Float8Config
from headrace.training.protocols.model_converter import ModelConverter

FLOAT8_ALIGNMENT = 16  # torch._scaled_mm needs both matrix dimensions divisible by 16


def float8_skip_reason(name: str, module: nn.Linear, cfg: Float8Config) -> str | None:
    """Why ``module`` (named ``name``) stays a plain Linear, or None when it becomes a Float8Linear."""
    if name == "lm_head" or name.endswith(".lm_head"):
        return "the chunked loss reads lm_head.weight directly (the layer's forward never runs)"
    matched = [fqn for fqn in cfg.filter_fqns if fqn in name]
    if matched:
        return f"quantize.linear.float8.filter_fqns: {matched[0]!r}"
    if module.in_features % FLOAT8_ALIGNMENT or module.out_features % FLOAT8_ALIGNMENT:
        return (
            f"{module.in_features}x{module.out_features} is not a multiple of {FLOAT8_ALIGNMENT} "
            "(torch._scaled_mm's alignment)"
        )
    return None


def torchao_config(cfg: Float8Config):
    """torchao's ``Float8LinearConfig`` for ``cfg``: the named recipe, then this job's switches."""
    float8 = _torchao_float8()
    base = float8.Float8LinearConfig.from_recipe_name(cfg.recipe_name)
    return dataclasses.replace(
        base,
        enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather,
        force_recompute_fp8_weight_in_bwd=cfg.force_recompute_fp8_weight_in_bwd,
        emulate=cfg.emulate,
    )


def check_float8_device(cfg: Float8Config, device: torch.device) -> None:
    """One line when this device cannot run float8 matmuls (and emulation was not asked for)."""
    if device.type == "cuda" and not cfg.emulate and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"quantize.linear.float8: {name} (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}) has no float8 matmul; "
            "it needs 8.9 or later (Ada, Hopper, Blackwell); set quantize.linear.float8.emulate: true "
            "to check the numerics, or remove the section"
        )


def convert_linears(model: nn.Module, cfg: Float8Config) -> dict[str, str]:
    """Swap ``model``'s eligible ``nn.Linear`` layers for torchao ``Float8Linear`` in place (works on the meta
    device). Returns the skipped layers' names with the reason."""
    skipped = {
        name: reason
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and (reason := float8_skip_reason(name, module, cfg))
    }
    _torchao_float8().convert_to_float8_training(
        model, config=torchao_config(cfg), module_filter_fn=lambda module, name: name not in skipped
    )
    return skipped


def apply_float8(model: nn.Module, float8: Float8Config, device: torch.device) -> None:
    """``quantize.linear.float8`` on a model still on the meta device (before parallelize); rank 0 says what it
    converted and what it skipped, with the reasons."""
    check_float8_device(float8, device)
    skipped = convert_linears(model, float8)
    if dist.get_rank() == 0:
        converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        by_reason: dict[str, list[str]] = {}
        for name, reason in skipped.items():
            by_reason.setdefault(reason, []).append(name)
        reasons = "; ".join(
            f"{', '.join(names[:2])}{f' and {len(names) - 2} more' if len(names) > 2 else ''} ({reason})"
            for reason, names in by_reason.items()
        )
        print(
            f"quantize.linear.float8 ({float8.recipe_name}): {converted} linears in float8"
            + (f"; left as they are: {reasons}" if skipped else ""),
            flush=True,
        )


def register_scale_precompute(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Float8Config) -> None:
    """With ``precompute_float8_dynamic_scale_for_fsdp``: after each optimizer step, every FSDP2-sharded float8
    weight's scale in one all-reduce (what the next forward's all-gather casts with)."""
    if cfg.precompute_float8_dynamic_scale_for_fsdp:
        precompute = _torchao_float8().precompute_float8_dynamic_scale_for_fsdp
        optimizer.register_step_post_hook(lambda *_: precompute(model))


@dataclass(frozen=True)
class Float8Converter(ModelConverter):
    """``quantize.linear.float8`` as a model converter: the linears converted on the meta device, and with
    ``precompute_float8_dynamic_scale_for_fsdp`` the scales' all-reduce after each optimizer step."""

    cfg: Float8Config
    name = "float8"

    def convert(self, model: nn.Module, device: torch.device) -> None:
        apply_float8(model, self.cfg, device)

    def post_optimizer_hook(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        register_scale_precompute(model, optimizer, self.cfg)


def high_precision_weights(state: dict) -> dict:
    """``state`` with every FSDP2 shard that torchao's float8 all-gather wrapped (a tensor subclass holding the
    high-precision weight, which safetensors cannot write) replaced by that weight, sharing its storage (so a
    checkpoint load fills the weight in place); other values as they are. Checkpoints and the hf/ export use it."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def plain(value):
        if not isinstance(value, DTensor) or not is_traceable_wrapper_subclass(local := value.to_local()):
            return value
        names, _ = local.__tensor_flatten__()
        (inner,) = (getattr(local, name) for name in names)
        return DTensor.from_local(inner, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())

    return {key: plain(value) for key, value in state.items()}


def _torchao_float8():
    # torchao loads its CUDA extensions and registers torch.compile constants on import (~1 s): only jobs
    # with a float8 section pay for it.
    try:
        import torchao.float8
    except ImportError as exc:
        raise ConfigError("quantize.linear.float8 needs torchao: pip install 'headrace[fp8]'") from exc
    return torchao.float8


__all__ = [
    "FLOAT8_ALIGNMENT",
    "Float8Converter",
    "apply_float8",
    "check_float8_device",
    "convert_linears",
    "float8_skip_reason",
    "high_precision_weights",
    "register_scale_precompute",
    "torchao_config",
]
