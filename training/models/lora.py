"""LoRA: low-rank adapters on a frozen transformers model, under FSDP2 / TP / PP, in and out in peft's format.

Algorithm: each selected ``nn.Linear`` (``headrace.training.config.peft.PeftConfig``) keeps its weight ``W`` and
gets two small ``nn.Linear`` children, ``lora_A`` (r x in) and ``lora_B`` (out x r);
``y = W x + b + (alpha / r) * B A dropout(x)``. The base is frozen; only A and B (and whatever the model's own
settings leave trainable, e.g. a SALM's speech adapter) reach the optimizer. B starts at zero, so step 0 is the
base model exactly.

Why not peft's own ``LoraLayer``: peft wraps the linear (``q_proj.base_layer``), so the TP plan's module names
and the checkpoint's parameter names change, and its layer is built on real tensors, not on DTensor shards
of a meta model. The layer here is the one torchtitan and NeMo Automodel write: the linear's class is swapped
for ``LoRALinear`` (same ``weight`` / ``bias`` FQNs, so loading the base and the ``hf/`` export are unchanged),
and the adapters are added *after* tensor parallelism, on the meta device, sharded like the layer they wrap:
a column-wise ``W`` (``Shard(0)``) gets a replicated A and a column-wise B (B A x comes out sharded like W x);
a row-wise ``W`` (``Shard(1)``) gets a row-wise A and a replicated B (the partial sum B A x joins W x's before
the layer's one reduction). No collective is added to the forward. FSDP2 then shards frozen and trainable
parameters of a block in one unit. peft stays the format: ``save_adapter`` writes ``adapter_config.json``
through peft's ``LoraConfig`` and ``adapter_model.safetensors`` under peft's keys
(``base_model.model.<module>.lora_A.weight``), and ``load_adapter`` reads such a directory (DCP's safetensors
reader, each rank its own slices).

Cost: r (in + out) parameters per adapted layer, two thin matmuls in its forward; the merged export
(``merged_state``) builds each adapted layer's full ``B A`` once (one weight matrix of transient memory).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from headrace.config import ConfigError, to_dict
from headrace.training.config.peft import PeftConfig
from headrace.training.errors import JobInputError
from headrace.training.models.adapter_dir import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_config_file,
    read_adapter_tensors,
    read_config_object,
    stored_keys,
)
from headrace.training.models.loss import CausalLMLoss, unwrap_ddp
from headrace.training.protocols.model_converter import ModelConverter, StateTransform

PEFT_PREFIX = "base_model.model."  # peft's names of the base model's modules in an adapter file
HEAD_NAMES = ("lm_head", "embed_out")  # the output embedding: the chunked loss reads its weight, not its forward
DEFAULT_TARGETS = ["*_proj"]  # Automodel's default
_ADAPTER_KEY = re.compile(r"\.lora_[AB]\.weight$")


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with ``lora_A`` / ``lora_B`` children; made only by ``add_adapter`` (class swap)."""

    scaling: float
    lora_dropout: float
    dropout_position: str
    lora_A_init: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.dropout_position == "pre" and self.lora_dropout:
            x = F.dropout(x, self.lora_dropout, self.training)
        delta = self.lora_B(self.lora_A(x)) * self.scaling
        if self.dropout_position == "post" and self.lora_dropout:
            delta = F.dropout(delta, self.lora_dropout, self.training)
        return out + delta

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """A from ``lora_A_init`` (kaiming: peft's default), B zero: the adapted layer equals the base."""
        if self.lora_A_init == "xavier":
            nn.init.xavier_uniform_(self.lora_A.weight)
        else:
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)


def adapter_placements(weight: DTensor) -> tuple[list, list]:
    """(A's, B's) placements for a layer whose weight has ``weight``'s: per mesh dim, column-wise (Shard(0))
    -> (Replicate, Shard(0)), row-wise (Shard(1)) -> (Shard(1), Replicate), else both replicated."""
    a, b = [], []
    for p in weight.placements:
        a.append(Shard(1) if p == Shard(1) else Replicate())
        b.append(Shard(0) if p == Shard(0) else Replicate())
    return a, b


def add_adapter(linear: nn.Linear, cfg: PeftConfig) -> None:
    """Make ``linear`` a ``LoRALinear`` (module docstring), its adapters on ``linear.weight``'s device and mesh."""
    weight = linear.weight
    out_features, in_features = weight.shape  # a DTensor's: the global shape
    lora_A = nn.Linear(in_features, cfg.dim, bias=False, device=weight.device, dtype=weight.dtype)
    lora_B = nn.Linear(cfg.dim, out_features, bias=False, device=weight.device, dtype=weight.dtype)
    if isinstance(weight, DTensor):
        a, b = adapter_placements(weight)
        lora_A.weight = nn.Parameter(distribute_tensor(lora_A.weight.detach(), weight.device_mesh, a))
        lora_B.weight = nn.Parameter(distribute_tensor(lora_B.weight.detach(), weight.device_mesh, b))
    linear.lora_A, linear.lora_B = lora_A, lora_B
    linear.__class__ = LoRALinear
    linear.scaling, linear.lora_dropout = cfg.scaling, cfg.dropout
    linear.dropout_position, linear.lora_A_init = cfg.dropout_position, cfg.lora_A_init


def wildcard(pattern: str, name: str) -> bool:
    """``pattern`` against module name ``name``: with ``*`` a wildcard over the whole name (NeMo Automodel's
    rule, ``*`` crosses dots), without one the name itself or its last dotted components (peft's rule)."""
    if "*" in pattern:
        return re.fullmatch(".*".join(re.escape(part) for part in pattern.split("*")), name) is not None
    return name == pattern or name.endswith("." + pattern)


def selected_modules(model: nn.Module, cfg: PeftConfig) -> list[str]:
    """The names of the modules ``cfg`` selects in ``model``; a selected module LoRA cannot wrap is a one-line
    ``ConfigError`` (the output head, MoE experts, anything but a plain ``nn.Linear``)."""
    targets = cfg.target_modules or ([] if cfg.match_all_linear else DEFAULT_TARGETS)
    names = []
    for name, module in model.named_modules():
        linear = type(module) is nn.Linear
        chosen = (
            (linear and name.rsplit(".", 1)[-1] not in HEAD_NAMES)
            if cfg.match_all_linear
            else any(wildcard(p, name) for p in targets)
        )
        if not name or not chosen or any(wildcard(p, name) for p in cfg.exclude_modules):
            continue  # the root module (the loss wrapper) is never a target
        if name.rsplit(".", 1)[-1] in HEAD_NAMES:
            raise ConfigError(
                f"peft: {name} is the output head, which the loss reads as a weight in chunks (not "
                "through its forward): LoRA cannot adapt it; remove it from peft.target_modules"
            )
        if ".experts" in f".{name}":
            raise ConfigError(
                f"peft: {name} holds MoE experts (3-D grouped weights): LoRA on experts is not "
                "supported; target the attention projections, e.g. target_modules: ['*.self_attn.*']"
            )
        if not linear and not any(p == name or name.endswith("." + p) for p in targets):
            continue  # a wildcard selects among the nn.Linear layers (NeMo Automodel's rule): "*" is every one
        if not linear:
            raise ConfigError(
                f"peft: {name} is a {type(module).__name__}, not an nn.Linear: LoRA wraps "
                "nn.Linear layers only (narrow peft.target_modules)"
            )
        names.append(name)
    return names


def apply_lora(model: nn.Module, cfg: PeftConfig) -> list[str]:
    """Freeze ``model`` and add adapters to the modules ``cfg`` selects (after TP, before AC / compile / FSDP2;
    on the meta device). Returns their names; none selected is a ``ConfigError``."""
    names = selected_modules(model, cfg)
    if not names:
        raise ConfigError(
            f"peft: target_modules {cfg.target_modules or DEFAULT_TARGETS} (exclude_modules "
            f"{cfg.exclude_modules}) select no nn.Linear of the model"
        )
    modules = dict(model.named_modules())
    for name in names:  # before any adapter is made: a rank past a layer's own is refused, not allocated
        if cfg.dim > min(modules[name].weight.shape):
            raise ConfigError(
                f"peft.dim {cfg.dim} exceeds the rank of {name} ({tuple(modules[name].weight.shape)}): an "
                f"adapter's rank is at most min(in, out) = {min(modules[name].weight.shape)}"
            )
    model.requires_grad_(False)
    for name in names:
        add_adapter(modules[name], cfg)
    return names


def is_adapter_key(key: str) -> bool:
    return _ADAPTER_KEY.search(key) is not None


def adapter_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def init_adapters(model: nn.Module, cfg: PeftConfig, label: str = "") -> None:
    """After the base is materialized (its init also touched A and B): the adapters' own init, then the peft
    adapter of ``cfg.pretrained_path`` when given; rank 0 says what is trained. Collective."""
    for layer in adapter_layers(model):
        layer.reset_adapter()
    if cfg.pretrained_path is not None:
        load_adapter(model, cfg, cfg.pretrained_path)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(
            f"LoRA{label}: {len(adapter_layers(model))} layers, r={cfg.dim}, alpha={cfg.alpha:g}: "
            f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"
            + (f", adapter from {cfg.pretrained_path}" if cfg.pretrained_path else ""),
            flush=True,
        )


def read_adapter_config(path: str | Path) -> dict:
    """``adapter_config.json`` of a peft adapter directory (plain JSON), after the rules this trainer needs."""
    file = adapter_config_file(path)
    config = read_config_object(file)
    if config.get("peft_type") != "LORA":
        raise JobInputError(f"peft.pretrained_path: {file} holds a {config.get('peft_type')} adapter, not LORA")
    unsupported = {
        k: config.get(k)
        for k in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "modules_to_save")
        if config.get(k)
    }
    if config.get("bias", "none") != "none":
        unsupported["bias"] = config["bias"]
    if unsupported:
        raise JobInputError(f"peft.pretrained_path: {file} uses {unsupported}, which this trainer does not implement")
    return config


def _from_every_rank(obj) -> list:
    """``obj`` of every rank, in rank order (a collective; models/ sits below distributed/, whose
    ``gather_objects`` is the same call)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def load_adapter(model: nn.Module, cfg: PeftConfig, path: str | Path) -> None:
    """Fill the adapters of ``model`` (any layout) from peft adapter directory ``path``: its ``r`` /
    ``lora_alpha`` must be ``cfg``'s and it must adapt exactly the modules ``cfg`` selects. Collective."""
    config = read_adapter_config(path)
    if (config.get("r"), config.get("lora_alpha")) != (cfg.dim, cfg.alpha):
        raise JobInputError(
            f"peft.pretrained_path: {path} has r={config.get('r')}, lora_alpha="
            f"{config.get('lora_alpha')}; this job's peft has dim={cfg.dim}, alpha={cfg.alpha:g}"
        )
    state = {k: v for k, v in get_model_state_dict(model).items() if is_adapter_key(k)}
    stored = stored_keys(path)
    everyone = {k for keys in _from_every_rank(sorted(state)) for k in keys}  # pipeline stages hold parts
    wanted = {PEFT_PREFIX + k for k in everyone}
    if wanted != stored:
        differ = [
            f"{len(keys)} keys {what} (e.g. {keys[0]})"
            for keys, what in ((sorted(wanted - stored), "missing"), (sorted(stored - wanted), "not selected"))
            if keys
        ]
        raise JobInputError(
            f"peft.pretrained_path: {path} adapts other modules than peft selects: "
            f"{', '.join(differ)}; set peft.target_modules to the adapter's target_modules "
            f"{config.get('target_modules')}"
        )
    read_adapter_tensors({PEFT_PREFIX + k: v for k, v in state.items()}, path)
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def full_adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter weight of this rank's ``model`` (part), whole, on the CPU. Collective over its meshes."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
        for k, v in get_model_state_dict(model).items()
        if is_adapter_key(k)
    }


def save_adapter(model: nn.Module, cfg: PeftConfig, out_dir: str | Path, base: str | None) -> Path:
    """``out_dir`` as a peft adapter directory that ``peft.PeftModel.from_pretrained(base_model, out_dir)``
    loads: ``adapter_config.json`` (peft's ``LoraConfig``, ``target_modules`` the exact module names) and
    ``adapter_model.safetensors``. Collective (pipeline stages' adapters are gathered); rank 0 writes."""
    from peft import LoraConfig  # peft pulls in accelerate (~1 s): only a run that exports an adapter pays

    tensors = {}
    for part in _from_every_rank(full_adapter_tensors(model)):  # small: r (in + out) per layer
        tensors.update(part)
    out_dir = Path(out_dir)
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        modules = sorted({_ADAPTER_KEY.sub("", k) for k in tensors})
        LoraConfig(
            r=cfg.dim,
            lora_alpha=cfg.alpha,
            lora_dropout=cfg.dropout,
            target_modules=modules,
            base_model_name_or_path=base,
            task_type="CAUSAL_LM",
        ).save_pretrained(str(out_dir))
        save_file(
            {PEFT_PREFIX + k: v.contiguous() for k, v in tensors.items()},
            str(out_dir / ADAPTER_WEIGHTS),
            metadata={"format": "pt"},
        )
    dist.barrier()
    return out_dir


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """``state`` (a model state dict, plain or DTensor shards) with each adapted weight replaced by
    ``W + scaling * B A`` and the adapter keys dropped: the base model's keys, for the ``hf/`` export. A and B
    are gathered whole (small); each rank keeps its own slice of ``B A`` (no scatter). Collective."""
    merged = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for key in [k for k in state if k.endswith(".lora_A.weight")]:
        module = key[: -len(".lora_A.weight")]
        a, b = (state[f"{module}.lora_{x}.weight"] for x in "AB")
        a, b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (a, b))
        weight = state[f"{module}.weight"]
        delta = (b.float() @ a.float() * scaling).to(weight.dtype)
        if isinstance(weight, DTensor):
            delta = distribute_tensor(delta, weight.device_mesh, weight.placements, src_data_rank=None)
        merged[f"{module}.weight"] = weight.detach() + delta
    return merged


def merger(cfg: PeftConfig) -> Callable[[dict], dict]:
    """``merged_state`` at ``cfg``'s scale: the ``transform`` of the ``hf/`` export."""
    return partial(merged_state, scaling=cfg.scaling)


def llm_of(model: nn.Module) -> nn.Module:
    """The causal LM whose adapters the ``lora/`` export holds: ``model`` itself, or a SALM's LLM."""
    model = unwrap_ddp(model)
    return model if isinstance(model, CausalLMLoss) else model.llm


def base_reference(job) -> dict:
    """What a LoRA checkpoint records instead of the frozen base (a resume compares it): where the base comes
    from (``model.pretrained_path``, or the seeded init) and the adapter settings."""
    settings = {k: v for k, v in to_dict(job.peft).items() if k != "export_adapter"}
    return {"base": job.model.pretrained_path or f"initialized from trainer.seed {job.trainer.seed}", **settings}


def checkpoint_size_line(path, model: nn.Module, job) -> str:
    """One line: what checkpoint ``path`` stores of this rank's model (the trainable parameters and their two AdamW
    moments) against the frozen base it references. Counted from the tensors, not the files: an asynchronous
    save is still being written when this is said."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    stored = 3 * sum(p.numel() * p.element_size() for p in trainable)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return (
        f"LoRA checkpoint {Path(str(path)).name}: {stored / 2**20:.2f} MiB on this rank "
        f"({sum(p.numel() for p in trainable):,} trainable parameters + their AdamW state); the frozen base "
        f"({frozen / 2**20:.1f} MiB, {job.model.pretrained_path or 'seeded init'}) is referenced, not copied"
    )


@dataclass(frozen=True)
class LoRAConverter(ModelConverter):
    """``peft:`` as a model converter: adapters on the parts ``cfg.parts`` names, added after TP and initialized
    after the base is materialized; checkpoints hold the trainable state and record the base they adapt; the
    ``hf/`` export merges the adapters, ``lora/`` holds them alone (peft's format)."""

    cfg: PeftConfig
    name = "lora"
    trainable_only = True
    merged_on_export = True

    def after_tp(self, parts: dict[str, nn.Module]) -> None:
        for part in self.cfg.parts:  # each part frozen; a SALM's speech adapter keeps its own freeze setting
            apply_lora(parts[part], self.cfg)

    def after_materialize(self, parts: dict[str, nn.Module]) -> None:
        for part in self.cfg.parts:  # ``cfg.pretrained_path`` is the LLM's adapter
            cfg = self.cfg if part == "llm" else replace(self.cfg, pretrained_path=None)
            init_adapters(parts[part], cfg, f" ({part})" if len(parts) > 1 else "")

    def model_record(self, job) -> dict:
        return {"peft": base_reference(job)}

    def saved_line(self, path, model: nn.Module, job) -> str | None:
        return checkpoint_size_line(path, model, job)

    def export_transform(self, part: str) -> StateTransform | None:
        return merger(self.cfg) if part in self.cfg.parts else None

    def export(self, model: nn.Module, job, out_dir: Path) -> None:
        if self.cfg.export_adapter:  # beside the merged hf/: the adapter alone, peft's format
            save_adapter(llm_of(model), self.cfg, out_dir / "lora", job.model.pretrained_path)


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "LoRAConverter",
    "LoRALinear",
    "adapter_placements",
    "apply_lora",
    "base_reference",
    "checkpoint_size_line",
    "init_adapters",
    "llm_of",
    "merger",
    "is_adapter_key",
    "load_adapter",
    "merged_state",
    "read_adapter_config",
    "save_adapter",
    "selected_modules",
    "wildcard",
]
