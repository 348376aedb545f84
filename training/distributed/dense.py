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

Step 1 is ``headrace.training.distributed.tensor_parallel`` (every TP plan); steps 2-4 and DDP are the shared
pieces here (``apply_ac``, ``apply_compile``, ``uses_fsdp`` + ``apply_fsdp``, ``apply_ddp``) that each family
group's recipe calls in this order (the MoE families', a SALM's: ``headrace.training.speech.parallelize``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from headrace.training.config.job_config import DistributedConfig
from headrace.training.distributed.parallel_dims import ParallelDims
from headrace.training.distributed.tensor_parallel import apply_hf_tp_plan, apply_tp, dense_mlp_plan
from headrace.training.models.families import OWN_TP_PLAN, decoder_blocks


def parallelize_decoder_lm(
    model: nn.Module,
    dims: ParallelDims,
    cfg: DistributedConfig,
    param_dtype: torch.dtype,
    mlp_plan=None,
    ac_context_fn=None,
    after_tp=None,
) -> nn.Module:
    """Any transformers causal LM (``headrace.training.models.families``): TP/SP, AC, compile, FSDP2 over its decoder blocks.
    TP uses the hand-written plan for the Llama family, the model's own ``base_model_tp_plan`` otherwise.
    ``mlp_plan(block, seq_layout)`` gives a Llama-family block's mlp TP entries (default ``dense_mlp_plan``) and
    ``ac_context_fn`` a selective-checkpoint policy (MoE: headrace.training.distributed.moe). ``after_tp(model)``
    runs the model converters' hook after TP (LoRA adds its adapters there, so they are sharded like the layers
    they wrap and FSDP2 sees them; ``headrace.training.models.converters``)."""
    if dims.tp_enabled:
        if model.config.model_type in OWN_TP_PLAN:
            apply_tp(model, dims.get_mesh("tp"), dims.sequence_parallel, mlp_plan or dense_mlp_plan)
        else:
            apply_hf_tp_plan(model, dims.get_mesh("tp"), dims.sequence_parallel)
    if after_tp is not None:
        after_tp(model)
    layers = decoder_blocks(model)  # a ModuleList, or a pipeline stage's ModuleDict keyed by global index
    apply_ac(layers, cfg, ac_context_fn)
    blocks = list(layers.children())
    apply_compile(blocks, cfg)
    if uses_fsdp(dims, cfg, param_dtype):
        # With nothing sharded the weights stay gathered from forward to backward: a reshard would only make
        # backward cast the same fp32 weights to bf16 a second time (the GPU profile's dtype-copy kernels).
        apply_fsdp(
            model,
            blocks,
            dims.get_mesh("fsdp"),
            param_dtype,
            cfg.reshard_after_forward and dims.dp_sharded,
            offload_policy(cfg),
        )
    return model


def apply_ac(layers: nn.Module, cfg: DistributedConfig, context_fn=None) -> None:
    """Activation checkpointing of every ``activation_checkpointing_every``-th block of ``layers`` (a ModuleList,
    or a pipeline stage's ModuleDict keyed by global index), in place; ``context_fn``: a selective policy."""
    if not cfg.activation_checkpointing:
        return
    for name, block in list(layers.named_children()):
        if int(name) % cfg.activation_checkpointing_every == 0:
            layers.register_module(
                name, checkpoint_wrapper(block, **({"context_fn": context_fn} if context_fn else {}))
            )


def apply_compile(blocks: list[nn.Module], cfg: DistributedConfig) -> None:
    """``torch.compile`` each block in place (``distributed.compile``): one graph per block type, reused."""
    if cfg.compile:
        for block in blocks:
            block.compile(backend=cfg.compile_backend)


def uses_fsdp(dims: ParallelDims, cfg: DistributedConfig, param_dtype: torch.dtype) -> bool:
    """FSDP2 wraps the model when asked and there is something to shard, or bf16 to compute in: bf16 goes through
    its MixedPrecisionPolicy even on one rank (or TP only), since under autocast HF's RoPE hands fp32 q/k beside a
    bf16 v to the attention kernel (flash-attn refuses that), while bf16 parameters keep every activation bf16."""
    return cfg.strategy == "fsdp2" and (dims.dp_sharded or param_dtype != torch.float32 or cfg.offload_policy == "cpu")


def offload_policy(cfg: DistributedConfig) -> OffloadPolicy:
    """FSDP2's policy for ``distributed.offload_policy``: the base ``OffloadPolicy`` keeps shards on the device.
    Pinned host memory needs CUDA, so a CPU-only run offloads unpinned (to the memory it computes in anyway)."""
    if cfg.offload_policy == "cpu":
        return CPUOffloadPolicy(pin_memory=cfg.offload_pin_memory and torch.cuda.is_available())
    return OffloadPolicy()


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reshard_after_forward: bool,
    offload: OffloadPolicy = OffloadPolicy(),
) -> None:
    """fully_shard each block (its all-gather overlaps the previous block's compute), then the root
    (embeddings, final norm, lm_head: tied weights stay in one group, unsharded for the whole loss
    forward). Compute runs in ``param_dtype``; sharded weights and gradient reduction stay fp32; with a
    ``CPUOffloadPolicy`` the shards, their gradients and the optimizer step stay in host memory."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for i, block in enumerate(blocks):
        # The last block's params are needed again right away by backward: keep them gathered.
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=reshard_after_forward and i < len(blocks) - 1,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward)


def apply_ddp(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """Classic DDP over the whole dp mesh (model already materialized: DDP broadcasts rank 0's weights)."""
    if dims.dp == 1:
        return model
    device_ids = None if next(model.parameters()).device.type == "cpu" else [torch.cuda.current_device()]
    return DistributedDataParallel(model, process_group=dims.get_mesh("dp").get_group(), device_ids=device_ids)


__all__ = [
    "apply_ac",
    "apply_compile",
    "apply_ddp",
    "apply_fsdp",
    "offload_policy",
    "parallelize_decoder_lm",
    "uses_fsdp",
]
