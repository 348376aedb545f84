"""Which token-expert assignments an MoE layer computes, and in which row order: dropless or capacity-limited.

``plan_routes(top_k_index (T, k), top_k_weights (T, k), num_experts, capacity)`` turns the router's top-k
choice into rows grouped by expert: ``token_of_row`` and ``weight_of_row`` (N,) and ``counts`` (E,) rows per
expert, in expert order (what ``headrace.training.distributed.expert_parallel`` dispatches and ``headrace.kernels.grouped_experts`` runs).

- ``capacity=None`` (dropless): all T*k assignments, sorted by expert (stable: by token position within).
- ``Capacity(factor, policy, pad)`` (Megatron-Core's ``moe_expert_capacity_factor``,
  ``moe_token_drop_policy``, ``moe_pad_expert_input_to_capacity``): each expert takes at most
  ``C = ceil(T * k / E * factor)`` assignments of the T tokens this call routes ("local" capacity, as Megatron:
  under expert parallelism each rank caps the tokens it sends, before the exchange). Over-subscribed experts
  keep, per ``policy``, the assignments with the highest router weight (``probs``) or the earliest tokens
  (``position``). A dropped assignment contributes nothing: the token keeps its residual and its other
  experts' outputs, weighted as the router gave them (the family's own top-k renormalization happens before
  dropping; nothing is renormalized after, as in Megatron). ``pad``: every expert gets exactly C rows, the
  free slots filled with token 0 at weight 0 (Megatron pads with zero-probability tokens too), so N = E * C
  depends on shapes only: no data-dependent sizes for torch.compile / CUDA graphs.

Cost: one or two stable argsorts of T*k integers / floats and a few gathers; no host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Capacity:
    factor: float
    policy: str = "probs"  # probs | position
    pad: bool = False

    def per_expert(self, tokens: int, top_k: int, num_experts: int) -> int:
        """Megatron's ``get_capacity``: ceil(tokens * top_k / num_experts * factor)."""
        return math.ceil(tokens * top_k / num_experts * self.factor)


@dataclass
class Routes:
    token_of_row: torch.Tensor  # (N,) token index of each expert row, rows grouped by expert
    weight_of_row: torch.Tensor  # (N,) router weight of each row (0 for padding), differentiable
    counts: torch.Tensor  # (E,) rows per expert
    routed: torch.Tensor  # (E,) assignments the router made per expert (before any drop)
    dropped: torch.Tensor  # () assignments dropped by the capacity


def plan_routes(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int, capacity: Capacity | None
) -> Routes:
    """Rows grouped by expert for ``top_k_index`` / ``top_k_weights`` (module docstring)."""
    tokens, k = top_k_index.shape
    flat_expert, flat_weight = top_k_index.reshape(-1), top_k_weights.reshape(-1)
    counts = torch.bincount(flat_expert, minlength=num_experts)
    if capacity is None:
        order = flat_expert.argsort(stable=True)
        return Routes(order // k, flat_weight[order], counts, counts, counts.new_zeros(()))
    if capacity.policy == "probs":  # by weight, highest first, then (stable) by expert
        by_weight = flat_weight.detach().argsort(descending=True, stable=True)
        order = by_weight[flat_expert[by_weight].argsort(stable=True)]
    else:
        order = flat_expert.argsort(stable=True)
    per_expert = capacity.per_expert(tokens, k, num_experts)
    sorted_expert = flat_expert[order]
    rank_in_expert = torch.arange(order.numel(), device=order.device) - (counts.cumsum(0) - counts)[sorted_expert]
    keep = rank_in_expert < per_expert
    dropped = (counts - per_expert).clamp(min=0).sum()
    if not capacity.pad:
        kept = order[keep]
        return Routes(kept // k, flat_weight[kept], counts.clamp(max=per_expert), counts, dropped)
    # Static layout: slot e * C + rank for kept rows; dropped rows go to one extra slot that is cut off.
    slots = num_experts * per_expert
    slot = torch.where(keep, sorted_expert * per_expert + rank_in_expert, slots)
    token_of_row = order.new_zeros(slots + 1).scatter(0, slot, order // k)[:slots]
    weight_of_row = flat_weight.new_zeros(slots + 1).scatter(0, slot, flat_weight[order])[:slots]
    return Routes(token_of_row, weight_of_row, torch.full_like(counts, per_expert), counts, dropped)


__all__ = ["Capacity", "Routes", "plan_routes"]
