"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE from transformers) and expert parallelism.

``parallelize_moe_lm`` is the MoE family's parallelize function (``headrace.training.distributed.parallelize``
dispatches to it on ``model_type``). On the meta model, in this order:

1. every sparse MLP's experts module runs ``headrace.training.distributed.expert_parallel`` (sort by expert, or with
   ``moe.capacity_factor`` drop what exceeds each expert's capacity (``headrace.training.distributed.moe_routing``),
   [EP exchange], grouped GEMM or per-expert loop, combine); with ``ep_size > 1`` its fused 3D weights ``gate_up_proj``
   ``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)`` become DTensors ``Shard(0)`` on the ``ep`` mesh (each rank
   holds E/ep experts, DCP reshards them to any other ep) and are ``fully_shard``-ed over ``ep_shard``;
2. then the dense recipe (``parallelize_decoder_lm``): TP/SP on attention only (the router and experts
   see the whole sequence on every tp rank), activation checkpointing, compile, FSDP2 of blocks (router,
   norms, attention) and root over the dp x cp mesh.

Meshes (NeMo Automodel's ``moe_mesh``): ep is carved from dp x cp: the flattened ``dp_cp`` dim is unflattened
into ``(ep_shard, ep)`` with ep innermost, so an ep group is ep neighbouring data-parallel ranks.

Router load-balancing loss: the model's own ``load_balancing_loss_func`` (Switch Transformer) on each
micro-batch's router logits, times ``router_aux_loss_coef`` (or ``moe.aux_loss_coef``) and the micro-batch's
labelled-token count, is added to the summed cross-entropy; the trainer divides the sum by the global token
count, so a one-micro-batch step gives exactly transformers' ``loss + coef * aux_loss``.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInputOutput
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from headrace.config import ConfigError
from headrace.kernels.grouped_experts import IMPLEMENTATIONS
from headrace.kernels.loss import IGNORE_INDEX
from headrace.training.config.job_config import DistributedConfig
from headrace.training.distributed.expert_parallel import MoEStats, install_experts_forward
from headrace.training.distributed.moe_routing import Capacity
from headrace.training.distributed.parallel_dims import ParallelDims
from headrace.training.distributed.dense import offload_policy, parallelize_decoder_lm
from headrace.training.distributed.tensor_parallel import dense_mlp_plan
from headrace.training.models.loss import unwrap_ddp

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def num_experts(hf_config) -> int:
    return getattr(hf_config, "num_experts", None) or hf_config.num_local_experts


def sparse_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, MoE mlp) for every decoder layer whose mlp routes to experts (Qwen3-MoE may mix in dense)."""
    return [(i, block.mlp) for i, block in enumerate(model.model.layers) if hasattr(block.mlp, "experts")]


def check_moe(dims: ParallelDims, cfg: DistributedConfig, hf_config) -> None:
    """One ConfigError (a ValueError the CLI prints as one line) per unsupported key or combination, before
    anything is built."""
    moe = cfg.moe
    experts = num_experts(hf_config)
    if experts % dims.ep:
        raise ConfigError(
            f"distributed.ep_size={dims.ep} must divide the model's num_experts={experts} "
            "(each ep rank holds num_experts / ep_size experts)"
        )
    if moe.experts_implementation not in (*IMPLEMENTATIONS, "hf"):
        raise ConfigError(
            f"distributed.moe.experts_implementation={moe.experts_implementation!r}: one of "
            f"{', '.join((*IMPLEMENTATIONS, 'hf'))}"
        )
    if moe.experts_implementation == "hf" and dims.ep > 1:
        raise ConfigError(
            "distributed.moe.experts_implementation=hf keeps transformers' experts forward, which "
            "cannot dispatch across ranks: use grouped_mm or loop with ep_size > 1"
        )
    if not moe.wrap_outer_model and cfg.strategy == "fsdp2":
        raise ConfigError(
            "distributed.moe.wrap_outer_model=false is not supported: the FSDP2 root holds the "
            "embeddings and lm_head, whose weight the chunked loss reads unsharded in the root forward"
        )
    if moe.lm_head_precision not in (None, "bf16", "bfloat16") and cfg.strategy == "fsdp2":
        raise ConfigError(
            f"distributed.moe.lm_head_precision={moe.lm_head_precision!r} is not supported: lm_head "
            "shares the root FSDP2 group's MixedPrecisionPolicy (use trainer.precision=fp32)"
        )
    if moe.ignore_router_for_ac and not cfg.activation_checkpointing:
        raise ConfigError(
            "distributed.moe.ignore_router_for_ac=true only matters with distributed.activation_checkpointing=true"
        )
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        raise ConfigError(f"distributed.moe.capacity_factor={moe.capacity_factor} must be > 0 (null: dropless)")
    if moe.capacity_factor is not None and moe.experts_implementation == "hf":
        raise ConfigError(
            "distributed.moe.capacity_factor needs experts_implementation grouped_mm or loop: "
            "transformers' own experts forward cannot drop tokens"
        )
    if moe.pad_to_capacity and moe.capacity_factor is None:
        raise ConfigError(
            "distributed.moe.pad_to_capacity=true needs distributed.moe.capacity_factor (dropless "
            "routing has no capacity to pad to)"
        )
    if dims.tp > 1 and hf_config.model_type == "olmoe":
        raise ConfigError(
            "tp_size > 1 with olmoe is not supported: its q_norm/k_norm normalize over all heads "
            "at once, which a head-sharded q/k projection cannot compute locally"
        )


def moe_mlp_plan(block: nn.Module, seq) -> dict:
    """TP plan for a block's mlp: the dense plan for a dense one, nothing for a sparse one (its experts are not
    tensor-parallel); under
    SP the whole sequence is gathered before the router and each rank keeps its slice of the output."""
    if not hasattr(block.mlp, "experts"):
        return dense_mlp_plan(block, seq)
    if seq == Replicate():
        return {}
    return {
        "mlp": PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
    }


def shard_experts(mlp: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Fused 3D expert weights -> DTensor Shard(0) over ep (on meta: no communication, no memory)."""
    for name in EXPERT_PARAMS:
        param = getattr(mlp.experts, name)
        mlp.experts.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))


_ROUTER_SAVED_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten._softmax.default)


class _RouterScope:
    """How many router forwards are running now (set by hooks on every router, read by the AC policy).
    Saved: the router's logits and probabilities; its top-k and renormalization (which HF does in place, and
    a saved tensor must not be mutated) are recomputed from the saved probabilities, identically."""

    def __init__(self):
        self.depth = 0

    def policy(self, ctx, op, *args, **kwargs):
        if self.depth and op in _ROUTER_SAVED_OPS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def router_saving_ac(model: nn.Module):
    """``moe.ignore_router_for_ac``: a selective-checkpoint context whose policy saves the routers' matmul and
    softmax outputs (replayed, not recomputed, in backward) and recomputes everything else in the block."""
    scope = _RouterScope()
    for _, mlp in sparse_blocks(model):
        mlp.gate.register_forward_pre_hook(lambda *_: setattr(scope, "depth", scope.depth + 1))
        mlp.gate.register_forward_hook(lambda *_: setattr(scope, "depth", scope.depth - 1))
    return functools.partial(create_selective_checkpoint_contexts, scope.policy)


def router_aux_loss(
    router_logits, labels: torch.Tensor, *, loss_fn, num_experts: int, top_k: int, coef: float, stats: MoEStats
) -> torch.Tensor:
    """``coef * aux * labelled tokens`` of one micro-batch (summed like the cross-entropy; module doc)."""
    aux = loss_fn(tuple(router_logits), num_experts, top_k)
    stats.aux_losses.append(float(aux.detach()))
    return coef * aux * (labels != IGNORE_INDEX).sum()


def parallelize_moe_lm(
    model: nn.Module, dims: ParallelDims, cfg: DistributedConfig, param_dtype: torch.dtype, after_tp=None
) -> nn.Module:
    """Experts (EP, grouped GEMM), router aux loss, then the dense recipe; see the module docstring."""
    hf_config = model.config
    check_moe(dims, cfg, hf_config)
    experts = num_experts(hf_config)
    stats = MoEStats()
    model.moe_stats = stats
    ep_group = ep_mesh = None
    if dims.ep_enabled:
        ep_mesh = dims.get_mesh("ep")
        ep_group = ep_mesh.get_group()
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    capacity = (
        None
        if cfg.moe.capacity_factor is None
        else Capacity(factor=cfg.moe.capacity_factor, policy=cfg.moe.token_drop_policy, pad=cfg.moe.pad_to_capacity)
    )
    blocks = sparse_blocks(model)
    if not blocks:  # else expert parallelism, the grouped experts and the aux loss would silently not apply
        raise ConfigError(
            f"model_type {hf_config.model_type!r}: no decoder layer's mlp holds `experts` (the "
            "transformers MoE layout headrace.training.distributed.moe reads)"
        )
    for layer, mlp in blocks:
        if cfg.moe.experts_implementation != "hf":
            install_experts_forward(
                mlp.experts,
                layer=layer,
                num_experts=experts,
                ep_group=ep_group,
                ep=dims.ep,
                impl=cfg.moe.experts_implementation,
                stats=stats,
                capacity=capacity,
            )
        if ep_mesh is not None:
            shard_experts(mlp, ep_mesh)
            fully_shard(
                mlp.experts,
                mesh=dims.get_mesh("ep_shard"),
                mp_policy=mp,
                offload_policy=offload_policy(cfg),
                reshard_after_forward=cfg.moe.reshard_after_forward,
            )
    coef = cfg.moe.aux_loss_coef if cfg.moe.aux_loss_coef is not None else hf_config.router_aux_loss_coef
    if coef:
        model.router_aux_loss = functools.partial(
            router_aux_loss,
            loss_fn=sys.modules[type(model.causal_lm).__module__].load_balancing_loss_func,
            num_experts=experts,
            top_k=hf_config.num_experts_per_tok,
            coef=coef,
            stats=stats,
        )
    ac_context_fn = router_saving_ac(model) if cfg.moe.ignore_router_for_ac else None
    return parallelize_decoder_lm(
        model, dims, cfg, param_dtype, mlp_plan=moe_mlp_plan, ac_context_fn=ac_context_fn, after_tp=after_tp
    )


def step_metrics(model: nn.Module, loss_mesh: DeviceMesh) -> dict:
    """This step's MoE figures over all ranks (a collective on ``loss_mesh``; {} for dense models):
    ``moe_imbalance`` (max over layers of max/mean tokens per expert, 1.0 = perfectly balanced),
    ``moe_dropped`` (fraction of the router's token-expert assignments the capacity factor dropped),
    ``moe_aux_loss`` (mean over micro-batches and ranks), ``a2a_bytes`` (sent per rank, forward + backward)
    and ``a2a_s`` (seconds in the token exchanges, the slowest rank)."""
    stats = getattr(unwrap_ddp(model), "moe_stats", None)
    if stats is None:
        return {}
    group = loss_mesh.get_group()
    layers = sorted(stats.tokens_per_expert)
    counts = torch.stack([stats.tokens_per_expert[i] for i in layers]) if layers else torch.zeros(0, 1)
    dist.all_reduce(counts, group=group)
    sums = torch.tensor(
        [sum(stats.aux_losses), len(stats.aux_losses), stats.a2a_bytes, stats.dropped], dtype=torch.float64
    )
    dist.all_reduce(sums, group=group)
    seconds = torch.tensor(stats.a2a_seconds, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    imbalance = (counts.max(1).values / counts.mean(1).clamp(min=1e-9)).max().item() if layers else None
    ranks = loss_mesh.size()
    routed = counts.sum().item()
    return {
        "moe_imbalance": imbalance,
        "moe_dropped": sums[3].item() / routed if routed else None,
        "moe_aux_loss": (sums[0] / sums[1]).item() if sums[1] else None,
        "a2a_bytes": sums[2].item() / ranks,
        "a2a_s": seconds.item(),
    }


def reset_step(model: nn.Module) -> None:
    """Start a new step's accumulators (no-op for dense models)."""
    stats = getattr(unwrap_ddp(model), "moe_stats", None)
    if stats is not None:
        stats.reset()


__all__ = ["check_moe", "parallelize_moe_lm", "reset_step", "step_metrics"]
