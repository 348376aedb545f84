"""Routed-experts forward for transformers' fused 3D experts, with or without expert parallelism (EP).

``install_experts_forward(experts, ep_group, impl, stats)`` replaces the forward of one HF experts module
(``Qwen3MoeExperts`` / ``MixtralExperts`` / ``OlmoeExperts``: ``forward(x, top_k_index, top_k_weights)``)
on that instance; the router, the module's parameters and their names stay transformers' own.

Algorithm (dropless by default: every routed token is computed, however unbalanced the routing):
1. sort the T*k (token, expert) assignments by expert; ``counts[e]`` assignments go to expert e
   (``headrace.training.distributed.moe_routing``; with a capacity factor it first drops what exceeds each expert's capacity,
   computed on this rank's tokens, and may pad every expert to exactly that capacity);
2. EP only: exchange the counts (``all_to_all_single`` on E integers), then send each rank the rows for
   its E/ep experts and receive the rows other ranks routed to ours (``all_to_all_single`` with uneven
   splits, autograd-aware: its backward is the reverse exchange), and regroup the received rows
   (ordered by source rank, then expert) by local expert;
3. run the local experts over their contiguous rows (``headrace.kernels.grouped_experts``: grouped GEMM or loop);
4. undo 2 (regroup, reverse exchange) and sum each token's k outputs weighted by the router's weights.

Cost per MoE layer and rank: two exchanges of k * T * H activations forward and two backward, plus one
of E counts; the expert matmuls are those of the routed tokens only. ``MoEStats`` records tokens per
expert (forward only, not during an activation-checkpoint recompute), the assignments dropped, and bytes /
seconds spent in the token exchanges, for the trainer's per-step metrics.

Expert gradients: under EP each rank's local expert gradient already sums the contributions of the
whole ep group (the exchange's backward brings them home), and FSDP2 then averages over ``ep_shard``;
the trainer scales each rank's loss by dp x cp so that dense gradients, averaged over dp x cp, become
sums. ``_scale_grad(w, 1/ep)`` removes the ep-fold surplus so expert gradients equal the single-process ones.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from headrace.kernels.grouped_experts import grouped_experts
from headrace.training.distributed.moe_routing import Capacity, plan_routes


@dataclass
class MoEStats:
    """Per-rank accumulators between two ``reset`` calls (one optimizer step)."""

    tokens_per_expert: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (E,) float64 counts
    dropped: float = 0.0  # assignments the capacity factor dropped (all layers)
    aux_losses: list[float] = field(default_factory=list)  # router load-balancing loss per micro-batch
    a2a_bytes: int = 0
    a2a_seconds: float = 0.0

    def add_counts(self, layer: int, counts: torch.Tensor, dropped: torch.Tensor) -> None:
        """The router's assignments per expert (before any capacity drop) and how many were dropped."""
        counts = counts.detach().to("cpu", torch.float64)
        self.tokens_per_expert[layer] = self.tokens_per_expert.get(layer, 0) + counts
        self.dropped += float(dropped)

    def reset(self) -> None:
        self.tokens_per_expert, self.aux_losses, self.a2a_bytes, self.a2a_seconds = {}, [], 0, 0.0
        self.dropped = 0.0


def _timed_all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group, stats) -> torch.Tensor:
    start = time.perf_counter()
    dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)
    if stats is not None:
        stats.a2a_seconds += time.perf_counter() - start
        stats.a2a_bytes += inp.numel() * inp.element_size()
    return out


class _AllToAll(torch.autograd.Function):
    """Rows exchanged with ``in_splits`` sent / ``out_splits`` received; backward swaps the splits."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, stats):
        ctx.splits, ctx.group, ctx.stats = (out_splits, in_splits), group, stats
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        return _timed_all_to_all(out, x, out_splits, in_splits, group, stats)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        return _timed_all_to_all(back, grad, in_splits, out_splits, ctx.group, ctx.stats), None, None, None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _local(weight: torch.Tensor, ep: int) -> torch.Tensor:
    """This rank's expert slice (a DTensor sharded over the ep mesh) with the 1/ep gradient correction."""
    if isinstance(weight, DTensor):
        weight = weight.to_local()
    return _ScaleGrad.apply(weight, 1.0 / ep) if ep > 1 else weight


def _in_backward() -> bool:
    """True while autograd runs a backward pass (an activation-checkpoint recompute happens there)."""
    return torch._C._current_graph_task_id() != -1


def routed_experts_forward(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    layer: int,
    num_experts: int,
    ep_group,
    ep: int,
    impl: str,
    stats: MoEStats | None,
    capacity: Capacity | None = None,
) -> torch.Tensor:
    """``experts(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)`` (module doc)."""
    routes = plan_routes(top_k_index, top_k_weights, num_experts, capacity)
    counts = routes.counts
    if stats is not None and not _in_backward():
        stats.add_counts(layer, routes.routed, routes.dropped)
    rows = hidden_states[routes.token_of_row]
    gate_up, down = _local(experts.gate_up_proj, ep), _local(experts.down_proj, ep)
    if ep == 1:
        out_rows = grouped_experts(rows, gate_up, down, counts, experts.act_fn, impl)
    else:
        local_experts = num_experts // ep
        received_counts = torch.empty_like(counts)  # (source rank, local expert) flattened
        dist.all_to_all_single(received_counts, counts, group=ep_group)
        send = counts.view(ep, local_experts).sum(1).tolist()
        recv = received_counts.view(ep, local_experts).sum(1).tolist()
        received = _AllToAll.apply(rows, recv, send, ep_group, stats)
        expert_of_received = torch.repeat_interleave(
            torch.arange(local_experts, device=counts.device).repeat(ep), received_counts
        )
        by_expert = expert_of_received.argsort(stable=True)
        local_counts = received_counts.view(ep, local_experts).sum(0)
        computed = grouped_experts(received[by_expert], gate_up, down, local_counts, experts.act_fn, impl)
        computed = computed[by_expert.argsort()]
        out_rows = _AllToAll.apply(computed, send, recv, ep_group, stats)
    weighted = out_rows * routes.weight_of_row[:, None]
    out = hidden_states.new_zeros(hidden_states.shape)
    return out.index_add(0, routes.token_of_row, weighted.to(out.dtype))


def install_experts_forward(
    experts: nn.Module,
    *,
    layer: int,
    num_experts: int,
    ep_group,
    ep: int,
    impl: str,
    stats: MoEStats | None,
    capacity: Capacity | None = None,
) -> None:
    """Make ``experts`` (one HF fused-experts module) run ``routed_experts_forward``."""
    experts.forward = functools.partial(
        routed_experts_forward,
        experts,
        layer=layer,
        num_experts=num_experts,
        ep_group=ep_group,
        ep=ep,
        impl=impl,
        stats=stats,
        capacity=capacity,
    )


__all__ = ["MoEStats", "install_experts_forward", "routed_experts_forward"]
