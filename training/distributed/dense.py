"""The dense decoder recipe: parallelism applied to a transformers causal LM on the meta device, in a fixed order:

1. tensor parallel (+ sequence parallel) on the ``tp`` mesh,
2. activation checkpointing (every block, or every N-th),
3. ``torch.compile`` per block (optional),
4. FSDP2 ``fully_shard`` per block then the root, on the ``dp_shard_cp`` mesh, or HSDP on the 2-D
   ``(dp_replicate, dp_shard_cp)`` mesh; DDP instead is applied by ``apply_ddp`` after materialization
   because it broadcasts real weights at construction.

The model is a ``headrace.training.models.loss.CausalLMLoss`` (transformers' module names unchanged), so the FSDP2
root is the module whose forward computes the loss: its unshard covers the lm_head weight the chunked loss
reads.

``headrace.training.distributed.parallelize`` picks the recipe by ``model_type``: this one, or the MoE families'
(``headrace.training.distributed.moe``: expert parallelism and grouped experts first, then this recipe).
Pipeline parallelism (pp) is step 0: ``headrace.training.distributed.pipeline`` splits the model into stage modules
(HF child names, blocks in a ``ModuleDict`` keyed by their global index) and parallelizes each stage, so
every step below handles a model whose ``model.embed_tokens`` / ``model.norm`` / ``lm_head`` may be absent.
Context parallelism (cp) changes no module: FSDP2 already shards over dp_shard x cp, and attention runs
over the cp mesh through the model kwargs (``headrace.training.distributed.context_parallel``).

Why our own TP plan for the Llama family instead of transformers' ``base_model_tp_plan`` (which every
other family uses, see ``headrace.training.models.families``): that plan has no sequence-parallel entries (norms stay
replicated over the full sequence) and its embedding/lm_head styles are fixed, so we write the torch-native
plan (the same module names) and keep it beside the function that applies it. HF attention reshapes with
``-1`` heads, so q/k/v sharded by heads work unmodified; Qwen3's per-head q_norm/k_norm act on head_dim but
their weight gradient sums over all heads (``head_norm_plan``). Position ids must be passed explicitly under
SP (HF would derive them from the sequence-sharded embeddings).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from headrace.config import ConfigError
from headrace.training.config.job_config import DistributedConfig
from headrace.training.distributed.parallel_dims import ParallelDims
from headrace.training.models.families import OWN_TP_PLAN, apply_hf_tp_plan, decoder_blocks, retie


def parallelize_decoder_lm(model: nn.Module, dims: ParallelDims, meshes: dict[str, DeviceMesh], cfg: DistributedConfig,
                           param_dtype: torch.dtype, mlp_plan=None, ac_context_fn=None, adapters=None) -> nn.Module:
    """Any transformers causal LM (``headrace.training.models.families``): TP/SP, AC, compile, FSDP2 over its decoder blocks.
    TP uses the hand-written plan for the Llama family, the model's own ``base_model_tp_plan`` otherwise.
    ``mlp_plan(block, seq_layout)`` gives a Llama-family block's mlp TP entries (default ``dense_mlp_plan``) and
    ``ac_context_fn`` a selective-checkpoint policy (MoE: headrace.training.distributed.moe). ``adapters(model)``
    adds LoRA after TP, so the adapters are sharded like the layers they wrap and FSDP2 sees them
    (``headrace.training.models.lora``)."""
    if dims.tp > 1:
        if model.config.model_type in OWN_TP_PLAN:
            apply_tp(model, meshes["tp"], dims.sequence_parallel, mlp_plan or dense_mlp_plan)
        else:
            apply_hf_tp_plan(model, meshes["tp"], dims.sequence_parallel)
    if adapters is not None:
        adapters(model)
    layers = decoder_blocks(model)  # a ModuleList, or a pipeline stage's ModuleDict keyed by global index
    if cfg.activation_checkpointing:
        for name, block in list(layers.named_children()):
            if int(name) % cfg.activation_checkpointing_every == 0:
                layers.register_module(name, checkpoint_wrapper(
                    block, **({"context_fn": ac_context_fn} if ac_context_fn else {})))
    blocks = list(layers.children())
    if cfg.compile:
        for block in blocks:
            block.compile(backend=cfg.compile_backend)
    # bf16 goes through FSDP2's MixedPrecisionPolicy even with nothing to shard (one rank, or TP only):
    # under autocast HF's RoPE hands fp32 q/k beside a bf16 v to the attention kernel (flash-attn refuses
    # that), while bf16 parameters keep every activation bf16.
    # With nothing sharded the weights stay gathered from forward to backward: a reshard would only make
    # backward cast the same fp32 weights to bf16 a second time (the GPU profile's dtype-copy kernels).
    sharded = dims.dp_replicate * dims.dp_shard * dims.cp > 1
    if cfg.strategy == "fsdp2" and (sharded or param_dtype != torch.float32):
        apply_fsdp(model, blocks, meshes["fsdp"], param_dtype, cfg.reshard_after_forward and sharded)
    return model


def dense_mlp_plan(block: nn.Module, seq) -> dict:
    """Megatron MLP: gate/up column-wise, down row-wise (its output back to the ``seq`` layout)."""
    plan = {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq)}
    if seq != Replicate():
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                         use_local_output=True)
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, mlp_plan=dense_mlp_plan,
             embed_output: Placement | None = None) -> None:
    """Megatron-style TP: q/k/v and gate/up column-wise, o/down row-wise; with SP the norms and the residual
    stream are sharded over the sequence dim and all-gathered just before attention / MLP. ``embed_output``
    overrides the embedding's output layout (a SALM splits the sequence itself after adding audio)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    present = dict(model.named_modules())  # a pipeline stage holds only some of these
    parallelize_module(model, tp_mesh, {name: style for name, style in {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=embed_output or seq),
        **({"model.norm": SequenceParallel()} if sequence_parallel else {}),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }.items() if name in present})
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
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                            use_local_output=True),
        }
    for block in model.model.layers.children():
        parallelize_module(block, tp_mesh, layer_plan | head_norm_plan(block) | mlp_plan(block, seq))
    retie(model)


def head_norm_plan(block: nn.Module) -> dict:
    """Qwen3's per-head q_norm/k_norm see only this rank's heads: their input is marked sharded on the head dim
    (``(B, S, heads, head_dim)``), so the replicated weight's gradient is a partial sum that DTensor all-reduces
    over tp. Without it each tp rank would update the weight from half the heads and the replicas would drift."""
    return {f"self_attn.{name}": SequenceParallel(sequence_dim=2, use_local_output=True)
            for name in ("q_norm", "k_norm") if hasattr(block.self_attn, name)}


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, param_dtype: torch.dtype,
               reshard_after_forward: bool) -> None:
    """fully_shard each block (its all-gather overlaps the previous block's compute), then the root
    (embeddings, final norm, lm_head: tied weights stay in one group, unsharded for the whole loss
    forward). Compute runs in ``param_dtype``; sharded weights and gradient reduction stay fp32."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for i, block in enumerate(blocks):
        # The last block's params are needed again right away by backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def apply_ddp(model: nn.Module, dims: ParallelDims, meshes: dict[str, DeviceMesh]) -> nn.Module:
    """Classic DDP over the whole dp mesh (model already materialized: DDP broadcasts rank 0's weights)."""
    if dims.dp == 1:
        return model
    device_ids = None if next(model.parameters()).device.type == "cpu" else [torch.cuda.current_device()]
    return DistributedDataParallel(model, process_group=meshes["dp"].get_group(), device_ids=device_ids)


__all__ = ["apply_ddp", "apply_fsdp", "apply_tp", "dense_mlp_plan", "head_norm_plan", "parallelize_decoder_lm"]
