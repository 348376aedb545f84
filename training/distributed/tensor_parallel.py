"""Tensor parallelism (+ sequence parallelism) of a causal LM on the meta device: every TP plan in one place.

Two plans, by ``model_type`` (``headrace.training.models.families``):
- the Llama family and the MoE families (``OWN_TP_PLAN``): ``apply_tp``, the hand-written Megatron plan kept
  beside the function that applies it. Why not transformers' ``base_model_tp_plan``: it has no
  sequence-parallel entries (norms stay replicated over the full sequence) and its embedding / lm_head styles
  are fixed. HF attention reshapes with ``-1`` heads, so q/k/v sharded by heads work unmodified; Qwen3's
  per-head q_norm/k_norm act on head_dim but their weight gradient sums over all heads (``head_norm_plan``).
  Position ids must be passed explicitly under SP (HF would derive them from the sequence-sharded embeddings).
  ``mlp_plan`` gives a block's mlp entries (``dense_mlp_plan``; MoE: ``headrace.training.distributed.moe``).
- every other family: its own ``base_model_tp_plan`` translated to torch styles (``TP_STYLES``) by
  ``apply_hf_tp_plan``, without SP; ``check_hf_tp_plan`` refuses, before building, a plan that cannot serve.
Embeddings and the output head are vocab-sharded either way, tied ones re-tied (``retie``). The family
recipes (``headrace.training.distributed.dense``, ``speech/parallelize``) call these first, on the ``tp`` mesh.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from headrace.config import ConfigError
from headrace.training.models.families import LLAMA_LIKE
from headrace.training.models.loss import unwrap_causal_lm


# transformers' TP style names (transformers/integrations/tensor_parallel.py) -> torch parallel styles.
# colwise: output features sharded, the local result feeds the next op (local heads); rowwise: input
# sharded on its last dim, output all-reduced; *_gather_output / *_split_input: the output is gathered
# whole (used where a norm or a fused projection needs every feature) and the next row-wise layer
# slices its replicated input again; embedding_rowwise: vocab-parallel embedding (token ids replicated,
# each rank looks up its vocabulary slice, the partial rows are summed), the style the trainer gives every
# input embedding. Other styles (packed_*, moe_*, replicated_with_grad_allreduce, mla_kv_a_proj, ...) are
# refused by check_hf_tp_plan, naming the module and style.
TP_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
}


def dense_mlp_plan(block: nn.Module, seq) -> dict:
    """Megatron MLP: gate/up column-wise, down row-wise (its output back to the ``seq`` layout)."""
    plan = {
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=seq),
    }
    if seq != Replicate():
        plan["mlp"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    mlp_plan=dense_mlp_plan,
    embed_output: Placement | None = None,
) -> None:
    """Megatron-style TP: q/k/v and gate/up column-wise, o/down row-wise; with SP the norms and the residual
    stream are sharded over the sequence dim and all-gathered just before attention / MLP. ``embed_output``
    overrides the embedding's output layout (a SALM splits the sequence itself after adding audio)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    present = dict(model.named_modules())  # a pipeline stage holds only some of these
    parallelize_module(
        model,
        tp_mesh,
        {
            name: style
            for name, style in {
                "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=embed_output or seq),
                **({"model.norm": SequenceParallel()} if sequence_parallel else {}),
                "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
            }.items()
            if name in present
        },
    )
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        layer_plan |= {
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
            # self_attn is called with keyword arguments; gather the sequence before q/k/v.
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            ),
        }
    for block in model.model.layers.children():
        parallelize_module(block, tp_mesh, layer_plan | head_norm_plan(block) | mlp_plan(block, seq))
    retie(model)


def head_norm_plan(block: nn.Module) -> dict:
    """Qwen3's per-head q_norm/k_norm see only this rank's heads: their input is marked sharded on the head dim
    (``(B, S, heads, head_dim)``), so the replicated weight's gradient is a partial sum that DTensor all-reduces
    over tp. Without it each tp rank would update the weight from half the heads and the replicas would drift."""
    return {
        f"self_attn.{name}": SequenceParallel(sequence_dim=2, use_local_output=True)
        for name in ("q_norm", "k_norm")
        if hasattr(block.self_attn, name)
    }


def check_hf_tp_plan(hf_config, sequence_parallel: bool) -> None:
    """Fail before building when ``tp_size > 1`` cannot be served by the model's own plan."""
    plan = getattr(hf_config, "base_model_tp_plan", None)
    if not plan:
        raise ConfigError(
            f"distributed.tp_size > 1: model_type {hf_config.model_type!r} has no base_model_tp_plan "
            "in transformers (set tp_size: 1)"
        )
    if sequence_parallel:
        raise ConfigError(
            f"distributed.sequence_parallel: model_type {hf_config.model_type!r} has no "
            f"sequence-parallel plan (written for {', '.join(LLAMA_LIKE)}); set it false"
        )
    unknown = {k: v for k, v in plan.items() if v not in TP_STYLES}
    if unknown:
        raise ConfigError(
            f"distributed.tp_size > 1: model_type {hf_config.model_type!r} uses TP styles "
            f"{unknown} that the trainer does not translate (known: {', '.join(TP_STYLES)})"
        )


def apply_hf_tp_plan(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """TP from the model's ``base_model_tp_plan``; vocab-sharded embedding and head, re-tied when shared."""
    hf = unwrap_causal_lm(model)
    base = hf.base_model
    embedding, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    # the embedding is styled below with the head, once, whether or not the plan names it
    in_base = {module: name for name, module in base.named_modules()}
    plan = {k: v for k, v in hf.config.base_model_tp_plan.items() if k != in_base.get(embedding)}
    parallelize_module(base, tp_mesh, {k: TP_STYLES[v]() for k, v in plan.items()})
    names = {module: name for name, module in model.named_modules()}
    parallelize_module(
        model,
        tp_mesh,
        {
            names[embedding]: TP_STYLES["embedding_rowwise"](),
            names[head]: ColwiseParallel(output_layouts=Replicate()),
        },
    )
    retie(model)


def retie(model: nn.Module) -> None:
    """parallelize_module gives each module a new Parameter; tied embeddings must share one again (the
    embedding's row-wise and the head's column-wise styles both shard dim 0, so the layouts agree)."""
    hf = unwrap_causal_lm(model)
    if getattr(hf.config, "tie_word_embeddings", False):
        hf.get_output_embeddings().weight = hf.get_input_embeddings().weight


__all__ = ["TP_STYLES", "apply_hf_tp_plan", "apply_tp", "check_hf_tp_plan", "dense_mlp_plan", "head_norm_plan", "retie"]
