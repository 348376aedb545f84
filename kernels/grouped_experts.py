"""Grouped SwiGLU experts: many small expert MLPs over token groups, in one call.

``grouped_experts(x, gate_up, down, counts, act_fn, impl)``: ``x`` ``(N, H)`` holds tokens already sorted by
expert (``counts[e]`` rows for expert ``e``, in expert order); ``gate_up`` ``(E, 2I, H)`` and ``down``
``(E, H, I)`` are transformers' fused 3D expert weights (Qwen3-MoE, Mixtral, OLMoE). Each row gets
``down[e] @ (act(gate) * up)`` with ``gate, up = (gate_up[e] @ x).chunk(2)``. Returns ``(N, H)``.

Implementations:
- ``grouped_mm``: two ``torch._grouped_mm`` calls with cumulative ``offs``; one kernel per projection for all
  experts (CUTLASS on Hopper, a loop inside ATen on CPU), no host sync, empty experts cost nothing. It needs
  16-byte-aligned rows (hidden and expert widths a multiple of 8 in bf16, of 4 in fp32); other widths run
  the loop.
- ``loop``: the plain-torch reference and test oracle: one ``F.linear`` pair per expert over its row slice;
  needs the counts on the host (one device sync) and launches 2E small matmuls.

Pitfall handled here: on CPU, ``_grouped_mm``'s backward rejects an expanded (stride-0) incoming gradient, as
``y.sum().backward()`` produces; ``_contiguous_grad`` makes the gradient contiguous first (measured in
TORCH-CPU-FACTS 6b). Cost: the same FLOPs as a dense MLP over N tokens (3 matmuls of N x H x I each).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLEMENTATIONS = ("grouped_mm", "loop")


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(x) if x.requires_grad else x


def grouped_experts_loop(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor, act_fn
) -> torch.Tensor:
    """Reference: one gate_up / down matmul pair per expert over its contiguous rows."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts.tolist())):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(act_fn(gate) * up, down[e]))
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])


def grouped_experts_mm(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor, act_fn
) -> torch.Tensor:
    """Fast path: ``torch._grouped_mm`` over all experts with offsets (see the module docstring)."""
    offs = counts.cumsum(0).to(torch.int32)
    if x.dtype != gate_up.dtype:  # autocast does not cover _grouped_mm
        x = x.to(gate_up.dtype)
    hidden = _contiguous_grad(torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs))
    gate, up = hidden.chunk(2, dim=-1)
    return _contiguous_grad(torch._grouped_mm(act_fn(gate) * up, down.transpose(1, 2), offs=offs))


def _aligned(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """``_grouped_mm`` needs every operand row to start on a 16-byte boundary (hidden and expert widths)."""
    return all(dim * gate_up.element_size() % 16 == 0 for dim in (down.shape[1], down.shape[2]))


def grouped_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor, act_fn, impl: str = "grouped_mm"
) -> torch.Tensor:
    """Dispatch to ``impl`` (one of ``IMPLEMENTATIONS``). With no rows at all the output still depends on
    ``x`` and the weights, so backward reaches them (zero gradients, not None): under expert parallelism
    every rank must take part in the backward exchanges and FSDP2's reduce-scatter."""
    if x.shape[0] == 0:
        return x.new_zeros(0, down.shape[1]) + 0.0 * (x.sum() + gate_up.sum() + down.sum()).to(x.dtype)
    if impl == "grouped_mm" and _aligned(gate_up, down):
        return grouped_experts_mm(x, gate_up, down, counts, act_fn)
    if impl == "grouped_mm":  # rows not 16-byte aligned (e.g. bf16 with a width not a multiple of 8)
        return grouped_experts_loop(x, gate_up, down, counts, act_fn)
    if impl == "loop":
        return grouped_experts_loop(x, gate_up, down, counts, act_fn)
    raise ValueError(f"unknown grouped experts implementation {impl!r} (one of {', '.join(IMPLEMENTATIONS)})")


__all__ = ["IMPLEMENTATIONS", "grouped_experts", "grouped_experts_loop", "grouped_experts_mm"]
