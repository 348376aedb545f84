"""The hub's per-expert safetensors layout of transformers' fused MoE experts, for DCP's HF reader and writer.

transformers 5 keeps a MoE layer's experts fused in memory (``mlp.experts.gate_up_proj`` ``(E, 2I, H)``,
``mlp.experts.down_proj`` ``(E, H, I)``) but its ``save_pretrained`` writes them back as the hub checkpoints
store them, one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` /
``down_proj`` for Qwen3-MoE and OLMoE; ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2`` for Mixtral),
reverting the family's load-time conversion (``transformers.conversion_mapping``: ``MergeModulelist(dim=0)``
then ``Concatenate(dim=1)`` for gate_up, ``MergeModulelist(dim=0)`` for down). That is the layout vLLM,
SGLang and transformers 4 read.

``per_expert_views(hf, state)`` reads the family's per-expert names from those same converters and replaces
each fused entry of a (possibly sharded) state dict by per-expert *views* of the experts this rank holds:
a DTensor sharded over experts (``Shard(0)`` on the ep mesh, FSDP2 over ep_shard, always whole experts along
dim 0) gives its local rows, at their global expert index. The views are plain tensors, so DCP writes each key
from, or reads it into, whichever rank holds that expert: no rank gathers a layer, nothing is copied on load.
``hub_names`` then applies the family's reversed renamings (Mixtral's ``mlp`` -> ``block_sparse_moe``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

_FUSED = {"gate_up_proj": ["MergeModulelist", "Concatenate"], "down_proj": ["MergeModulelist"]}


def expert_converters(hf: nn.Module) -> dict[str, tuple[str, list[str]]]:
    """fused parameter (``gate_up_proj`` / ``down_proj``) -> (its target pattern, the per-expert source patterns),
    from transformers' conversion mapping for ``hf``'s family; {} for a model without fused experts."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    found = {}
    for conv in get_model_conversion_mapping(hf, add_legacy=False):
        if not isinstance(conv, WeightConverter):
            continue
        for fused, ops in _FUSED.items():
            target = conv.target_patterns[0]
            if target.endswith(f"experts.{fused}"):
                names = [type(op).__name__ for op in conv.operations]
                if names != ops or any(op.dim != dim for op, dim in zip(conv.operations, (0, 1))):
                    raise ValueError(
                        f"{type(hf).__name__}: transformers converts {target} with {names}, not the "
                        f"{ops} merge this exporter splits; use checkpoint.export_hf_experts: fused"
                    )
                found[fused] = (target, list(conv.source_patterns))
    return found


def local_experts(param):
    """(global index of the first expert this rank holds, its local (E_local, ...) tensor)."""
    if not isinstance(param, DTensor):
        return 0, param
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(shape) != tuple(local.shape) or tuple(shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(
            f"expert weights sharded as {param.placements}: only whole experts along dim 0 can be written per expert"
        )
    return offset[0], local


def per_expert_views(hf: nn.Module, state: dict, keep_fused: set[str] = frozenset()) -> dict:
    """``state`` with each fused experts entry (not in ``keep_fused``) replaced by per-expert views of the local
    experts, under the model-side per-expert names (module doc); other entries unchanged."""
    converters = expert_converters(hf)
    out = {}
    for fqn, value in state.items():
        fused = fqn.rsplit(".", 1)[-1]
        if fused not in converters or fqn in keep_fused:
            out[fqn] = value
            continue
        target, sources = converters[fused]
        if not fqn.endswith(target.lstrip(".")):
            raise ValueError(f"{fqn}: not under transformers' experts pattern {target!r}")
        first, local = local_experts(value)
        parts = local.chunk(len(sources), dim=1)  # gate_up = cat(gate, up) along dim 1; down: one part
        prefix = fqn[: len(fqn) - len(target.lstrip("."))]
        for source, part in zip(sources, parts):
            for j in range(local.shape[0]):
                out[prefix + source.lstrip(".").replace("*", str(first + j))] = part[j]
    return out


def hub_names(hf: nn.Module, fqns) -> dict[str, str]:
    """fqn -> the key ``save_pretrained`` writes for it: the family's renamings reversed (last first)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    reverse = [
        t.reverse_transform()
        for t in reversed(get_model_conversion_mapping(hf, add_legacy=False))
        if isinstance(t, WeightRenaming)
    ]
    return {fqn: renamed(fqn, reverse) for fqn in fqns}


def renamed(key: str, renames) -> str:
    """``key`` through transformers' ``WeightRenaming``s in order (one direction of a family's key mapping)."""
    for rename in renames:
        key, _ = rename.rename_source_key(key)
    return key


__all__ = ["expert_converters", "hub_names", "local_experts", "per_expert_views", "renamed"]
