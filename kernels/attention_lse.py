"""Varlen attention blocks that return their log-sum-exp, the matching backward, and the LSE merge.

Context parallelism splits one document's keys over several ranks, so a query's softmax is computed
piecewise: each piece ("block") attends the queries of a packed THD batch to one set of keys and
returns the output normalised over those keys plus ``lse`` = log(sum(exp(scores))) per query and head.
``merge_into`` combines pieces exactly (out = sum_i exp(lse_i - lse) out_i, lse = logaddexp_i lse_i).
The backward of a block takes the *final* (merged) output and lse: with them the softmax of the whole
row is rebuilt inside each block, P = exp(S - lse), and the block's dq/dk/dv are its exact share of the
gradient (flash attention's backward, D = rowsum(dO * O)), so blocks need no second merge.

A block is queries ``q`` ``(T, H, D)`` against keys/values ``(T, H_kv, D)`` of the same layout
``cu_seqlens`` (segment i of the queries attends segment i of the keys only), either ``causal``
(query j sees keys 0..j of its segment) or full (all keys of its segment).

Backends, chosen by device:

- CPU: segments are bucketed like ``varlen_attention``'s ``bucketed`` backend (``plan_buckets``: a few
  dense ``(docs, H, L, D)`` batches, under 12.5% padding) and run through torch's CPU flash kernel
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (returns the lse) and its backward op. Padding
  slots sit at the end of a segment: causal masking hides them from real queries; full blocks add a
  key-padding mask. In the backward, padding query slots get dO = 0 and lse = +inf, so they add nothing.
  Memory: O(T) besides the inputs (no score matrix is materialised).
- CUDA (fp16/bf16): ``aten._flash_attention_forward`` / ``_backward``, flash-attention 2's varlen kernels
  as shipped inside torch (no extra package), one call per block, native GQA. fp32 on CUDA is refused.

Cost per block: sum(L_i^2) (full) or sum(L_i^2)/2 (causal) query-key pairs, like ``varlen_attention``.
"""

from __future__ import annotations

import torch

from headrace.kernels.varlen_attention import cached_per_batch, plan_buckets


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (T, H, D_v) in q's dtype, lse (T, H) fp32)`` of one block (see the module docstring)."""
    if q.is_cuda:
        return _cuda_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale)
    return _cpu_forward(q, k, v, cu_seqlens, causal, scale)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block given the final merged ``out`` and ``lse`` of its queries."""
    if q.is_cuda:
        return _cuda_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale)
    return _cpu_backward(dout, q, k, v, out, lse, cu_seqlens, causal, scale)


def merge_into(
    acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block's ``(out, lse)`` into the running fp32 ``acc`` (None before the first block)."""
    if acc is None:
        return out.float(), lse
    acc_out, acc_lse = acc
    new_lse = torch.logaddexp(acc_lse, lse)
    merged = acc_out * torch.exp(acc_lse - new_lse)[..., None] + out.float() * torch.exp(lse - new_lse)[..., None]
    return merged, new_lse


# --- CPU: bucketed SDPA flash kernel -----------------------------------------------------------------


def _plan(cu_seqlens: torch.Tensor, total: int):
    return cached_per_batch("lse_blocks", cu_seqlens, total, lambda: plan_buckets(cu_seqlens, total))


def _to_bucket(x: torch.Tensor, bucket) -> torch.Tensor:
    """``(T, H, ...)`` -> ``(docs, H, L, ...)`` for one bucket."""
    return x.index_select(0, bucket.gather).view(bucket.docs, bucket.length, *x.shape[1:]).transpose(1, 2)


def _from_buckets(parts: list[torch.Tensor], plan) -> torch.Tensor:
    """Inverse of ``_to_bucket`` over all buckets: ``(docs, H, L, ...)`` parts -> ``(T, H, ...)`` real tokens."""
    flat = [p.transpose(1, 2).reshape(-1, *p.shape[1:2], *p.shape[3:]) for p in parts]
    return torch.cat(flat).index_select(0, plan.token_slot)


def _padding(bucket) -> torch.Tensor:
    """``(docs, L)`` True at padding slots."""
    return torch.arange(bucket.length, device=bucket.lengths.device)[None, :] >= bucket.lengths[:, None]


def _key_mask(bucket, causal: bool, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive mask hiding padding keys from full blocks (causal ones hide them already)."""
    if causal or bool((bucket.lengths == bucket.length).all()):
        return None
    mask = torch.zeros(bucket.docs, 1, 1, bucket.length, dtype=dtype, device=bucket.lengths.device)
    return mask.masked_fill_(_padding(bucket)[:, None, None, :], float("-inf"))


def _cpu_forward(q, k, v, cu_seqlens, causal, scale):
    plan = _plan(cu_seqlens, q.shape[0])
    outs, lses = [], []
    for b in plan.buckets:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _to_bucket(q, b),
            _to_bucket(k, b),
            _to_bucket(v, b),
            0.0,
            causal,
            attn_mask=_key_mask(b, causal, q.dtype),
            scale=scale,
        )
        outs.append(o)
        lses.append(lse.float()[..., None])
    return _from_buckets(outs, plan), _from_buckets(lses, plan)[..., 0]


def _cpu_backward(dout, q, k, v, out, lse, cu_seqlens, causal, scale):
    plan = _plan(cu_seqlens, q.shape[0])
    grads = ([], [], [])
    for b in plan.buckets:
        pad = _padding(b)[:, None, :]  # (docs, 1, L)
        do = _to_bucket(dout, b).masked_fill(pad[..., None], 0)
        lse_b = _to_bucket(lse[..., None], b)[..., 0].masked_fill(pad, float("inf"))
        parts = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.contiguous(),
            _to_bucket(q, b),
            _to_bucket(k, b),
            _to_bucket(v, b),
            _to_bucket(out, b),
            lse_b,
            0.0,
            causal,
            attn_mask=_key_mask(b, causal, q.dtype),
            scale=scale,
        )
        for acc, g in zip(grads, parts):
            acc.append(g)
    return tuple(_from_buckets(g, plan) for g in grads)


# --- CUDA: flash-attention 2 varlen kernels inside torch --------------------------------------------


def _check_cuda_dtype(q: torch.Tensor) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(
            f"context-parallel attention on CUDA runs flash-attention kernels: it needs bf16/fp16 "
            f"activations, got {q.dtype} (set trainer.precision=bf16)"
        )


def _cuda_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale):
    _check_cuda_dtype(q)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, causal, False, scale=scale
    )
    return out, lse.transpose(0, 1).float()  # varlen lse is (H, T)


def _cuda_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale):
    _check_cuda_dtype(q)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    unused = torch.empty(0, device=q.device)
    rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)  # no dropout: the seed is never read
    return torch.ops.aten._flash_attention_backward(
        dout.contiguous(),
        q,
        k,
        v,
        out.to(q.dtype),
        lse.transpose(0, 1).contiguous(),
        cu,
        cu,
        max_seqlen,
        max_seqlen,
        0.0,
        causal,
        rng_state,
        unused,
        scale=scale,
    )


__all__ = ["block_backward", "block_forward", "merge_into"]
