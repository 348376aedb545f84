"""``headrace_varlen``: document-masked attention for transformers models trained on packed batches.

Usage (the trainer does exactly this)::

    from headrace.kernels.hf_attention import packed_attention_kwargs, register_varlen_attention

    attn = register_varlen_attention()            # -> "headrace_varlen"; idempotent
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)   # or model.set_attn_implementation(attn)
    logits = model(input_ids=batch["input_ids"], use_cache=False, **packed_attention_kwargs(batch)).logits
    # batch = dataio packing's {input_ids, labels, position_ids, cu_seqlens, max_seqlen}; labels are
    # already next-token: sum F.cross_entropy(logits, labels, ignore_index=-100), don't pass labels=.
    # Without full logits (headrace.kernels.loss): inside the FSDP root module's forward,
    #   hidden = model.model(input_ids=..., **packed_attention_kwargs(batch)).last_hidden_state
    #   loss_sum, num_tokens = linear_cross_entropy(hidden, model.lm_head.weight, batch["labels"])

``packed_attention_kwargs`` returns ``position_ids`` (rotary positions restart per document) plus
HF's own varlen names ``cu_seq_lens_q/k`` and ``max_length_q/k`` — the same kwargs HF's
``flash_attention_2`` uses for padding-free batches, so a model switched to that implementation
takes the same call. Every decoder layer forwards these kwargs to the attention function unchanged.

Masks: transformers builds a mask only for implementations registered in
``AttentionMaskInterface``. ``headrace_varlen`` is deliberately not registered there, so
``create_causal_mask`` returns None and no (possibly document-crossing) dense mask is ever built;
the attention function refuses any mask it is given. The document structure comes only from
``cu_seq_lens_q`` (or, if absent, from ``position_ids`` restarting at 0).

Context parallelism: with ``cp_group`` (a process group) and ``cp_comm`` (``allgather`` | ``ring``) among
the model kwargs (``context_parallel_kwargs``), the batch is one CP rank's ``headrace.dataio.feed.cp_split`` shard
(``position_ids`` are the global positions, so RoPE is right) and the attention runs over the group
through ``headrace.kernels.cp_attention``.

Scope: training and full-sequence forward. Decoding with a KV cache, a sliding window shorter than
the longest document (a longer one masks nothing: Mistral's 4096 on shorter rows), softcapping and
attention dropout raise NotImplementedError naming the reason; use ``sdpa`` there.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from headrace.kernels.cp_attention import cp_attention
from headrace.kernels.varlen_attention import (
    block_mask_from_tables,
    bucket_plan_from_tree,
    cached_per_batch,
    cu_seqlens_from_position_ids,
    provide_plan,
    validate_cu_seqlens,
    varlen_attention,
)

ATTENTION_NAME = "headrace_varlen"


def register_varlen_attention(name: str = ATTENTION_NAME) -> str:
    """Register ``hf_varlen_attention`` with transformers' AttentionInterface; return the name to use."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, hf_varlen_attention)
    return name


def packed_attention_kwargs(batch: Mapping[str, object]) -> dict[str, object]:
    """Model kwargs carrying the packing metadata of a THD batch (see the module docstring).

    ``batch`` needs ``position_ids`` ``(B, S)``; ``cu_seqlens`` (int32 over the B*S flattened tokens,
    padding included as its own segment) and ``max_seqlen`` are used when present, else derived from
    ``position_ids``. Call it once per micro-batch: the attention plan is cached on the returned
    ``cu_seqlens`` tensor and shared by all layers. A batch carrying ``attention_plan``
    (``headrace.kernels.packed_layout``: checked and planned on the host, before the device copy) is not read here
    nor by the kernels; without one, ``cu_seqlens`` is checked and planned from its device values.
    """
    position_ids = batch["position_ids"]
    total = position_ids.numel()
    cu = batch.get("cu_seqlens")
    cu = cu_seqlens_from_position_ids(position_ids) if cu is None else cu.to(position_ids.device, torch.int32)
    plan = batch.get("attention_plan")
    if plan is not None:
        use_host_plan(plan, cu, total)
        max_seqlen = plan["max_seqlen"]
    else:
        validate_cu_seqlens(cu, total)
        max_seqlen = batch.get("max_seqlen")
        max_seqlen = int((cu[1:] - cu[:-1]).max()) if max_seqlen is None else int(max_seqlen)
    return {
        "position_ids": position_ids,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen,
    }


def use_host_plan(plan: dict, cu: torch.Tensor, total: int) -> None:
    """Let the kernels plan this micro-batch (keyed on ``cu``) from ``plan``'s host-made parts (see above)."""
    if "bucketed" in plan:
        provide_plan("bucketed", cu, total, lambda: bucket_plan_from_tree(plan["bucketed"]))
    if "flex" in plan:
        provide_plan("flex", cu, total, lambda: block_mask_from_tables(plan["flex"], total))


def context_parallel_kwargs(group, mode: str) -> dict[str, object]:
    """Model kwargs that make ``headrace_varlen`` attend over the CP ``group`` (see the module docstring)."""
    return {"cp_group": group, "cp_comm": mode}


# Never traced by torch.compile (a compiled decoder block graph-breaks here): dynamo would bake the first
# micro-batch's cached document plan (headrace.kernels.varlen_attention.cached_per_batch) into the graph and reuse
# it for later packings -- measured: a per-block-compiled FSDP2 step's loss off by 4e-3. The backends run
# compiled or fused kernels of their own (flex is compiled inside, flash-attn is one CUDA call).
@torch.compiler.disable
def hf_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    cp_group=None,
    cp_comm: str = "allgather",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query`` ``(B, H, S, D)``, ``key``/``value`` ``(B, H_kv, S, D)``
    -> ``((B, S, H, D), None)``, attention confined to each document of the flattened B*S tokens."""
    if attention_mask is not None:
        raise ValueError(
            f"{ATTENTION_NAME} takes document boundaries from cu_seq_lens_q/position_ids, not from a mask; "
            "do not pass attention_mask (padding belongs in its own cu_seqlens segment)"
        )
    if dropout:
        raise NotImplementedError(f"{ATTENTION_NAME}: attention dropout is not supported (set attention_dropout=0)")
    if softcap is not None:
        raise NotImplementedError(f"{ATTENTION_NAME}: softcapped attention is not supported")
    batch, heads, seq, dim = query.shape
    if key.shape[2] != seq:
        raise NotImplementedError(
            f"{ATTENTION_NAME} is for training on full packed sequences (query length {seq} != key length "
            f"{key.shape[2]}, e.g. decoding with a KV cache); use attn_implementation='sdpa' for generation"
        )
    cross = cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q
    if cross and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError(f"{ATTENTION_NAME} is self-attention: cu_seq_lens_k must equal cu_seq_lens_q")
    cu = cu_seq_lens_q
    if cu is None:
        if position_ids is None:
            raise ValueError(f"{ATTENTION_NAME} needs cu_seq_lens_q or position_ids; see headrace.kernels.hf_attention")
        cu = cached_per_batch(
            "cu_from_position_ids",
            position_ids,
            batch * seq,
            lambda: cu_seqlens_from_position_ids(position_ids.expand(batch, -1)),
        )
    if sliding_window is not None:
        longest = max_length_q if max_length_q is not None else int((cu[1:] - cu[:-1]).max())
        # A window at least as long as every document masks nothing the document mask does not already.
        if sliding_window < longest:
            raise NotImplementedError(
                f"{ATTENTION_NAME}: sliding window {sliding_window} is shorter than the longest "
                f"document ({longest} tokens); sliding-window attention is not supported"
            )
    if not query.dtype == key.dtype == value.dtype:
        # Under autocast, HF's rotary step hands over fp32 q/k beside bf16 v; flash-attn takes one dtype.
        query, key = query.to(value.dtype), key.to(value.dtype)
    q, k, v = (x.transpose(1, 2).reshape(batch * seq, x.shape[1], x.shape[3]) for x in (query, key, value))
    if cp_group is not None:
        out = cp_attention(q, k, v, cu, cp_group, mode=cp_comm, scale=scaling)
    else:
        out = varlen_attention(q, k, v, cu, max_length_q, scale=scaling)
    return out.view(batch, seq, heads, value.shape[-1]), None
