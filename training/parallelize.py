"""Apply parallelism to a model on the meta device, one function per model family, in a fixed order:

1. tensor parallel (+ sequence parallel) on the ``tp`` mesh,
2. activation checkpointing (every block, or every N-th),
3. ``torch.compile`` per block (optional),
4. FSDP2 ``fully_shard`` per block then the root, on the ``dp_shard_cp`` mesh, or HSDP on the 2-D
   ``(dp_replicate, dp_shard_cp)`` mesh; DDP instead is applied by ``apply_ddp`` after materialization
   because it broadcasts real weights at construction.

The model is a ``training.loss.CausalLMLoss`` (transformers' module names unchanged), so the FSDP2 root is
the module whose forward computes the loss: its unshard covers the lm_head weight the chunked loss reads.

Pipeline (pp), context (cp) and expert (ep) parallelism slot in as steps 0 (stage split), 1b (attention
over the cp mesh) and 1c (expert dispatch); until then a degree > 1 fails early in ``check_supported``.

Why our own TP plan for the Llama family instead of transformers' ``base_model_tp_plan`` (which every
other family uses, see ``training.families``): that plan has no sequence-parallel entries (norms stay
replicated over the full sequence) and its embedding/lm_head styles are fixed, so we write the torch-native
plan (the same module names) and keep it beside the function that applies it. HF attention reshapes with
``-1`` heads, so q/k/v sharded by heads work unmodified; Qwen3's per-head q_norm/k_norm weights become
replicated DTensors so their gradients sum over tp. Position ids must be passed explicitly under SP (HF
would derive them from the sequence-sharded embeddings).
"""

from __future__ import annotations

from collections.abc import Callable

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

from training.config import DistributedConfig
from training.families import LLAMA_LIKE, apply_hf_tp_plan, check_hf_tp_plan, decoder_blocks, retie
from training.parallel_dims import ParallelDims


def check_supported(dims: ParallelDims, hf_config) -> None:
    """Fail before building anything when the layout asks for what is not implemented or cannot split."""
    for name, degree in (("pp_size", dims.pp), ("cp_size", dims.cp), ("ep_size", dims.ep)):
        if degree > 1:
            raise NotImplementedError(f"distributed.{name}={degree}: pipeline / context / expert parallelism "
                                      "are not implemented yet (set it to 1)")
    if dims.tp > 1:
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads or hf_config.num_attention_heads
        if heads % dims.tp or kv_heads % dims.tp:
            raise ValueError(f"tp_size {dims.tp} must divide num_attention_heads {heads} and "
                             f"num_key_value_heads {kv_heads}")
        if hf_config.model_type not in LLAMA_LIKE:
            check_hf_tp_plan(hf_config, dims.sequence_parallel)


def parallelize_decoder_lm(model: nn.Module, dims: ParallelDims, meshes: dict[str, DeviceMesh], cfg: DistributedConfig,
                           param_dtype: torch.dtype) -> nn.Module:
    """Any transformers causal LM (``training.families``): TP/SP, AC, compile, FSDP2 over its decoder blocks.
    TP uses the hand-written plan for the Llama family, the model's own ``base_model_tp_plan`` otherwise."""
    if dims.tp > 1:
        tp_fn = apply_tp if model.config.model_type in LLAMA_LIKE else apply_hf_tp_plan
        tp_fn(model, meshes["tp"], dims.sequence_parallel)
    blocks = decoder_blocks(model)
    if cfg.activation_checkpointing:
        for i, block in enumerate(blocks):
            if i % cfg.activation_checkpointing_every == 0:
                blocks[i] = checkpoint_wrapper(block)
    if cfg.compile:
        for block in blocks:
            block.compile(backend=cfg.compile_backend)
    # bf16 goes through FSDP2's MixedPrecisionPolicy even with nothing to shard (one rank, or TP only):
    # under autocast HF's RoPE hands fp32 q/k beside a bf16 v to the attention kernel (flash-attn refuses
    # that), while bf16 parameters keep every activation bf16.
    sharded = dims.dp_replicate * dims.dp_shard * dims.cp > 1
    if cfg.strategy == "fsdp2" and (sharded or param_dtype != torch.float32):
        apply_fsdp(model, blocks, meshes["fsdp"], param_dtype, cfg.reshard_after_forward)
    return model


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, embed_output: Placement | None = None
             ) -> None:
    """Megatron-style TP: q/k/v and gate/up column-wise, o/down row-wise; with SP the norms and the residual
    stream are sharded over the sequence dim and all-gathered just before attention / MLP. ``embed_output``
    overrides the embedding's output layout (a SALM splits the sequence itself after adding audio)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=embed_output or seq),
        **({"model.norm": SequenceParallel()} if sequence_parallel else {}),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    })
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        layer_plan |= {
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
            # self_attn is called with keyword arguments; gather the sequence before q/k/v.
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                            use_local_output=True),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                      use_local_output=True),
        }
    for block in model.model.layers:
        # Qwen3's per-head q/k RMSNorm: one weight shared by heads that tp splits, so its gradient is a sum
        # over tp ranks; as a Replicate DTensor fed head-sharded input (dim 2 of (B, S, H, D)), DTensor's
        # backward all-reduces it. Left plain, each rank would keep only its own heads' part.
        head_norms = {f"self_attn.{n}": SequenceParallel(sequence_dim=2, use_local_output=True)
                      for n in ("q_norm", "k_norm") if hasattr(block.self_attn, n)}
        parallelize_module(block, tp_mesh, layer_plan | head_norms)
    retie(model)


def apply_fsdp(model: nn.Module, blocks: nn.ModuleList, mesh: DeviceMesh, param_dtype: torch.dtype,
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


# Families that need a parallelize function of their own (none yet); all others take the generic one.
PARALLELIZE_FNS: dict[str, Callable[..., nn.Module]] = {}


def parallelize(model: nn.Module, dims: ParallelDims, meshes: dict[str, DeviceMesh], cfg: DistributedConfig,
                param_dtype: torch.dtype) -> nn.Module:
    """Dispatch on ``config.model_type`` to the family's parallelize function (generic by default)."""
    check_supported(dims, model.config)
    fn = PARALLELIZE_FNS.get(model.config.model_type, parallelize_decoder_lm)
    return fn(model, dims, meshes, cfg, param_dtype)


__all__ = ["PARALLELIZE_FNS", "apply_ddp", "apply_fsdp", "apply_tp", "check_supported", "parallelize"]
