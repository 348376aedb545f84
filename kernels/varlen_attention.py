"""Document-masked (varlen) causal attention for packed THD batches.

A packed micro-batch is one flat run of ``T`` tokens holding several documents back to back;
``cu_seqlens`` (int32, ``[0, end_0, end_1, ..., T]``) marks where each document ends. Token ``i``
of document ``d`` attends to tokens ``0..i`` of ``d`` only. Layout is flash-attention's THD:
``q`` is ``(T, H, D)``, ``k``/``v`` are ``(T, H_kv, D)`` with ``H % H_kv == 0`` (GQA).

Backends (``varlen_attention(..., backend=...)``; ``"auto"`` picks the first that applies):

- ``flash``  (CUDA, fp16/bf16, flash-attn installed): ``flash_attn_varlen_func``; work sum(len_i^2).
- ``flex``   (CUDA): compiled ``torch.nn.attention.flex_attention`` with a document BlockMask; work
  about sum(len_i^2) rounded to 128-blocks. Not used on CPU: flex has no backward there.
- ``bucketed`` (CPU default, any device): documents are grouped by their length rounded up to a
  bucket (less than 12.5% padding, or less than ``_MIN_BUCKET`` tokens), each group is gathered into a
  dense ``(docs, H, L, D)`` batch (L = the group's longest document) and run through one SDPA call
  with ``is_causal=True``. Padding
  sits at the end of each document, so causal masking already hides it from real queries and no
  mask tensor is built; SDPA's CPU flash kernel (with native GQA) does the work and the backward.
  Work sum(L_i^2) with a few SDPA calls per micro-batch instead of one per document.
- ``dense_mask``: one SDPA call over all ``T`` tokens with a ``(T, T)`` block-diagonal causal bool
  mask. Work and memory T^2 regardless of the layout; kept as the comparison point in
  ``tools/bench_kernels.py`` (it only wins when one document fills the row).

``varlen_attention_reference`` is the oracle: a Python loop over documents with an explicit fp32
softmax. The per-micro-batch plan (bucket index tensors, block mask) depends only on
``cu_seqlens``; it is cached on the identity of the ``cu_seqlens`` tensor so that every layer of
one forward (and its activation-checkpoint recompute) reuses it. Planned from a device ``cu_seqlens``
it reads the device (a GPU sync per micro-batch); the trainer instead passes ``plan``, made on the host
before the device copy (``headrace.kernels.packed_layout.attention_plan``), and nothing here reads the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "flash", "flex", "bucketed", "dense_mask")
_MIN_BUCKET = 16


def validate_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> None:
    """Raise ValueError unless ``cu_seqlens`` is a 1-D non-decreasing ``[0, ..., total_tokens]``."""
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 (or int64), got {cu_seqlens.dtype}")
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != total_tokens:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the number of tokens ({total_tokens}), got {first}..{last}; "
            "every token (padding included) must belong to a segment"
        )
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries from ``position_ids`` restarting at 0 per document, over the flattened tokens.

    A document starts wherever the position is 0 and at the start of every row (a document never
    spans two rows). Returns int32 ``cu_seqlens`` on the same device.
    """
    flat = position_ids.reshape(-1)
    starts = flat == 0
    row_len = position_ids.shape[-1]
    starts[::row_len] = True
    idx = starts.nonzero().view(-1).to(torch.int32)
    return torch.cat([idx, idx.new_tensor([flat.numel()])])


def document_ids(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Document index of every token, ``(T,)`` int64, from ``cu_seqlens``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    docs = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(docs, lengths, output_size=total_tokens)


def varlen_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Oracle: loop over documents, causal mask and an explicit softmax in fp32. Slow; tests only."""
    validate_cu_seqlens(cu_seqlens, q.shape[0])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    groups = q.shape[1] // k.shape[1]
    outs = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        if end == start:
            continue
        qd = q[start:end].float().transpose(0, 1)  # (H, n, D)
        kd = k[start:end].float().transpose(0, 1).repeat_interleave(groups, 0)
        vd = v[start:end].float().transpose(0, 1).repeat_interleave(groups, 0)
        scores = (qd @ kd.transpose(1, 2)) * scale
        n = end - start
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        outs.append((probs @ vd).transpose(0, 1).to(q.dtype))
    return torch.cat(outs) if outs else q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention confined to each document of a packed THD batch; returns ``(T, H, D_v)``.

    ``q``: ``(T, H, D)``, ``k``/``v``: ``(T, H_kv, D)``; ``cu_seqlens``: int32 document boundaries over
    the T tokens; ``max_seqlen``: longest document (used by flash; computed when None). Differentiable
    on every backend (flex only on CUDA). A plan made on the host (``provide_plan``) is used when given.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"expected q (T,H,D), k/v (T,H_kv,D) with equal T; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if backend == "auto":
        backend = _auto_backend(q)
    if backend == "flash":
        return _flash(q, k, v, cu_seqlens, max_seqlen, scale)
    if backend == "flex":
        return _flex(q, k, v, cu_seqlens, scale)
    if backend == "dense_mask":
        return _dense_mask(q, k, v, cu_seqlens, scale)
    return _bucketed(q, k, v, cu_seqlens, scale)


def _auto_backend(q: torch.Tensor) -> str:
    if q.is_cuda:
        return "flash" if q.dtype in (torch.float16, torch.bfloat16) and _flash_attn_varlen() is not None else "flex"
    return "bucketed"


# --- bucketed SDPA (CPU) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Bucket:
    gather: torch.Tensor  # (docs * length,) token index of each slot; padding slots repeat the document's first token
    docs: int
    length: int
    lengths: torch.Tensor  # (docs,) real tokens of each document; slots at or past it are padding


@dataclass(frozen=True)
class _BucketPlan:
    buckets: tuple[_Bucket, ...]
    token_slot: torch.Tensor  # (T,) each token's slot in the concatenation of all bucket outputs


def bucket_length(length: int) -> int:
    """Padded length of a document's bucket: a multiple of 1/16 of its next power of two (< 12.5% padding)."""
    granule = max(_MIN_BUCKET, (1 << max(length - 1, 0).bit_length()) // 16)
    return -(-length // granule) * granule


def plan_buckets(cu_seqlens: torch.Tensor, total_tokens: int) -> _BucketPlan:
    validate_cu_seqlens(cu_seqlens, total_tokens)
    starts = cu_seqlens[:-1].long().cpu()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().cpu()
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    padded = torch.tensor([bucket_length(n) for n in lengths.tolist()], dtype=torch.long)
    buckets, token_slot, first_slot = [], torch.empty(total_tokens, dtype=torch.long), 0
    for bucket in padded.unique().tolist():
        sel = padded == bucket
        s, n = starts[sel], lengths[sel]
        size = int(n.max())  # a bucket pads to its longest member, so a lone document is not padded at all
        offsets = torch.arange(size)
        valid = offsets[None, :] < n[:, None]
        gather = torch.where(valid, s[:, None] + offsets[None, :], s[:, None])
        token_slot[gather[valid]] = first_slot + valid.reshape(-1).nonzero().view(-1)
        first_slot += gather.numel()
        device = cu_seqlens.device
        buckets.append(_Bucket(gather.reshape(-1).to(device), int(sel.sum()), size, n.to(device)))
    return _BucketPlan(tuple(buckets), token_slot.to(cu_seqlens.device))


def bucket_plan_from_tree(tree: dict) -> _BucketPlan:
    """The ``_BucketPlan`` of ``headrace.kernels.packed_layout.bucket_plan_tree``'s dict (its tensors on the device)."""
    buckets = tuple(_Bucket(*fields) for fields in zip(tree["gather"], tree["docs"], tree["length"], tree["lengths"]))
    return _BucketPlan(buckets, tree["token_slot"])


def _bucketed(q, k, v, cu_seqlens, scale):
    plan = cached_per_batch("bucketed", cu_seqlens, q.shape[0], lambda: plan_buckets(cu_seqlens, q.shape[0]))
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for b in plan.buckets:
        # (docs * L, H, D) -> (docs, H, L, D); padding slots sit after each document's last token.
        qb, kb, vb = (
            x.index_select(0, b.gather).view(b.docs, b.length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)
        )
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(ob.transpose(1, 2).reshape(-1, ob.shape[1], ob.shape[3]))
    return torch.cat(outs).index_select(0, plan.token_slot)


# --- dense block-diagonal mask (comparison point) --------------------------------------------------


def document_causal_mask(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """``(T, T)`` bool mask, True where query i may attend key j (same document, j <= i)."""
    validate_cu_seqlens(cu_seqlens, total_tokens)
    doc = document_ids(cu_seqlens, total_tokens)
    pos = torch.arange(total_tokens, device=cu_seqlens.device)
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def _dense_mask(q, k, v, cu_seqlens, scale):
    mask = cached_per_batch("dense_mask", cu_seqlens, q.shape[0], lambda: document_causal_mask(cu_seqlens, q.shape[0]))
    # 4-D inputs: with 3-D ones CPU SDPA falls back to the unfused math kernel.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


# --- GPU paths -------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _flash(q, k, v, cu_seqlens, max_seqlen, scale):
    fn = _flash_attn_varlen()
    if fn is None or not q.is_cuda:
        raise RuntimeError("backend 'flash' needs CUDA tensors and the flash-attn package (pip install flash-attn)")
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    return fn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), softmax_scale=scale, causal=True)


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic=False: one graph per shape; a dynamic recompile ran ~10x slower (TORCH-CPU-FACTS 5d).
    return torch.compile(flex_attention, dynamic=False)


def _document_block_mask(cu_seqlens: torch.Tensor, total_tokens: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    validate_cu_seqlens(cu_seqlens, total_tokens)
    doc = document_ids(cu_seqlens.to(device), total_tokens)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(
        same_document_causal, B=None, H=None, Q_LEN=total_tokens, KV_LEN=total_tokens, device=device
    )


def block_mask_from_tables(tables: dict, total_tokens: int):
    """The document-causal ``BlockMask`` from ``headrace.kernels.packed_layout.document_block_tables`` (on the device):
    no mask evaluation over token pairs, no host read."""
    from torch.nn.attention.flex_attention import BlockMask

    doc = tables["doc"]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    return BlockMask.from_kv_blocks(
        tables["kv_num_blocks"],
        tables["kv_indices"],
        tables["full_kv_num_blocks"],
        tables["full_kv_indices"],
        mask_mod=same_document_causal,
        seq_lengths=(total_tokens, total_tokens),
    )


def _flex(q, k, v, cu_seqlens, scale, flex_fn=None):
    """``flex_fn`` defaults to the compiled flex_attention (CUDA); tests pass the eager one on CPU."""
    if flex_fn is None:
        if not q.is_cuda:
            raise RuntimeError("backend 'flex' is GPU-only here: flex_attention has no backward on CPU")
        flex_fn = _compiled_flex()
    block_mask = cached_per_batch(
        "flex", cu_seqlens, q.shape[0], lambda: _document_block_mask(cu_seqlens, q.shape[0], q.device)
    )
    out = flex_fn(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


# --- per-micro-batch plan cache --------------------------------------------------------------------

_plan_cache: dict[str, tuple[torch.Tensor, tuple[int, int], object]] = {}
_provided: dict[str, tuple[torch.Tensor, tuple[int, int], object]] = {}


def provide_plan(kind: str, key: torch.Tensor, total_tokens: int, build) -> None:
    """Make ``build`` (a plan from host-made data, ``headrace.kernels.packed_layout``) the way ``cached_per_batch(kind, key,
    ...)`` builds its plan for this ``key`` tensor, instead of planning from the device values; it runs only if
    that backend is used."""
    _provided[kind] = (key, (total_tokens, key._version), build)


def cached_per_batch(kind: str, key: torch.Tensor, total_tokens: int, build):
    """Return ``build()``, reused while the same ``key`` tensor object comes back (all layers of a step);
    a builder given by ``provide_plan`` for this key replaces ``build``.

    Keyed on identity, not contents: comparing contents would sync the GPU in every layer. Holding
    the tensor keeps its id from being reused by a different batch; an in-place edit of the key
    between calls invalidates the entry (its version counter is part of the key).
    """
    hit = _plan_cache.get(kind)
    if hit is not None and hit[0] is key and hit[1] == (total_tokens, key._version):
        return hit[2]
    given = _provided.pop(kind, None)
    if given is not None and given[0] is key and given[1] == (total_tokens, key._version):
        build = given[2]
    plan = build()
    _plan_cache[kind] = (key, (total_tokens, key._version), plan)
    return plan


__all__ = [
    "BACKENDS",
    "block_mask_from_tables",
    "bucket_length",
    "bucket_plan_from_tree",
    "cached_per_batch",
    "cu_seqlens_from_position_ids",
    "document_causal_mask",
    "document_ids",
    "plan_buckets",
    "provide_plan",
    "validate_cu_seqlens",
    "varlen_attention",
    "varlen_attention_reference",
]
