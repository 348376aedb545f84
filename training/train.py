"""The training loop: read top to bottom to see everything a step does.

``train(cfg)`` sets up the process group and the device mesh (``ParallelDims``), builds the model on
the meta device wrapped in ``CausalLMLoss`` (forward = decoder + lm_head cross-entropy in token chunks,
so the fp32 ``[tokens, vocab]`` logits never exist), parallelizes it (TP/SP -> AC -> compile ->
FSDP2/HSDP, or DDP), materializes each rank's shard, resumes from the newest checkpoint if any, and runs
``train_step`` until ``max_steps``.

One step = ``grad_accum`` packed THD micro-batches. The loss is a sum of token cross-entropies divided
by the number of real tokens (labels != -100) in the whole global batch: that count is all-reduced over
the loss mesh (dp x cp) *before* the first backward, so every micro-step's gradient is already correctly
scaled and the result does not depend on how tokens split across micro-steps or ranks. FSDP2 and DDP
average gradients over dp, so each rank's loss is multiplied by the dp x cp size to make that average a
sum. Gradients are reduced only on the last micro-step (``defer_fsdp_grad_sync``).

Context parallelism (``distributed.cp_size`` > 1, ``training.context_parallel``): the prefetcher keeps only
this rank's head-tail chunks of each packed batch before the device copy, and attention runs over the cp
group; the loss and gradient arithmetic above is unchanged (dp x cp is already the loss mesh).

Attention stays inside each document: the model runs kernels' ``headrace_varlen`` attention (registered
with transformers' AttentionInterface) fed by ``cu_seq_lens_q`` / ``position_ids`` from the batch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from configtree import to_dict
from dataio.batching.prefetch import DevicePrefetcher
from kernels.hf_attention import packed_attention_kwargs
from kernels.loss import IGNORE_INDEX
from training import checkpoint, moe
from training.config import JobConfig
from training.context_parallel import cp_attention_kwargs, cp_batch_transform, cp_step_metrics, reset_exchanged_bytes
from training.loss import CausalLMLoss
from training.metrics import MetricsLogger, flops_per_token, max_memory_gib, peak_flops
from training.model import build_hf_config, build_meta_model, materialize, one_document_per_row
from training.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from training.parallel_dims import MESH_DIMS, ParallelDims, format_coordinates, gather_objects, rank_coordinates
from training.parallelize import apply_ddp, parallelize
from training.pipeline import build_pipeline, pipeline_metrics, pipeline_train_step
from training.profiling import StepProfiler
from training.wandb_run import open_run
from training.validate import check_job, check_vocab
from training.telemetry import rank_spread
from training.validation import make_validator

STEP_INPUTS = ("input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "fill",  # what a step reads
               "audio", "audio_lens", "audio_mask",  # + a SALM's (training.speech)
               "cp_imbalance")  # + context parallelism's (training.context_parallel)


def init_distributed(device_type: str) -> None:
    """Join the torchrun process group; a plain ``python -m training`` becomes a 1-rank group."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo")


@contextlib.contextmanager
def process_group_closed():
    """Destroy the process group the body joined, also when it raises (torchrun entry points)."""
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def pick_device(name: str) -> torch.device:
    """``trainer.device``: ``auto`` is this rank's GPU when CUDA is available, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"trainer.device=cuda but torch {torch.__version__} sees no CUDA device "
                             "(use trainer.device=cpu or auto)")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def seed_for_rank(seed: int, dp_rank: int) -> int:
    """Training-time RNG seed: distinct per data-parallel rank, shared by its TP/CP/PP peers."""
    return seed + 1_000_003 * dp_rank


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Reduce gradients in this backward only when ``enabled`` (FSDP2 and DDP; a no-op otherwise)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    elif isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    else:
        yield


def forward_loss_sum(model: nn.Module, batch: dict, autocast: bool,
                     attention_kwargs: dict | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy of one packed micro-batch through a ``CausalLMLoss`` (labels are
    already shifted). ``attention_kwargs``: extra attention kwargs (the CP group, ``training.context_parallel``)."""
    ctx = torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        return model(input_ids=batch["input_ids"], labels=batch["labels"], **packed_attention_kwargs(batch),
                     **(attention_kwargs or {}))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[dict], loss_mesh: DeviceMesh,
               *, max_grad_norm: float | None, defer_grad_sync: bool, autocast: bool,
               forward: Callable[[nn.Module, dict, bool], torch.Tensor] = forward_loss_sum) -> dict:
    """One optimizer step over ``micro_batches``; returns the global mean loss, grad norm and token count.
    ``forward(model, micro_batch, autocast)`` gives a micro-batch's summed loss."""
    group = loss_mesh.get_group()
    global_tokens = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches).to(torch.float64)
    dist.all_reduce(global_tokens, group=group)
    scale = loss_mesh.size() / global_tokens.clamp(min=1).item()
    loss_sum = torch.zeros((), dtype=torch.float64, device=global_tokens.device)
    for i, mb in enumerate(micro_batches):
        with gradient_sync(model, i == len(micro_batches) - 1 or not defer_grad_sync):
            loss = forward(model, mb, autocast)
            (loss * scale).backward()
        loss_sum += loss.detach()
    grad_norm = clip_grad_norm(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum, group=group)
    return {"loss": (loss_sum / global_tokens.clamp(min=1)).item(), "grad_norm": grad_norm,
            "tokens": int(global_tokens.item())}


def next_micro_batches(batches: DevicePrefetcher, count: int) -> list[dict]:
    """The next ``count`` batches (already on the device), keeping only what the step reads."""
    return [{k: v for k, v in next(batches).items() if k in STEP_INPUTS} for _ in range(count)]


def new_tail_group():
    """The group of a finite packed stream's tail agreement (``stream.sync_group``): one all_reduce run in
    the prefetcher's read-ahead thread, so on a gloo group of its own, never one the step's collectives use
    at the same time (a mesh dim spanning every rank reuses the default group). Collective: every rank
    calls it at the same point."""
    return dist.new_group(backend="gloo")


def give_tail_group(loader) -> None:
    stream = getattr(loader, "stream", None)
    if stream is not None and dist.is_initialized():
        stream.sync_group = new_tail_group()


def build_model(cfg: JobConfig, dims: ParallelDims, meshes: dict[str, DeviceMesh], device: torch.device):
    """meta ``CausalLMLoss`` -> parallelize -> allocate this rank's shards -> init or load (-> DDP).
    Returns (model, hf_config)."""
    if cfg.model.kind == "salm":
        from training.speech.job import build_salm

        return build_salm(cfg, dims, meshes, device)
    hf_config = build_hf_config(cfg.model)
    param_dtype = torch.bfloat16 if cfg.trainer.precision == "bf16" else torch.float32
    model = parallelize(CausalLMLoss(build_meta_model(hf_config)), dims, meshes, cfg.distributed, param_dtype)
    materialize(model, device, cfg.model.pretrained_path)
    if cfg.distributed.strategy == "ddp":
        model = apply_ddp(model, dims, meshes)
    return model, hf_config


def build_model_or_pipeline(cfg: JobConfig, dims: ParallelDims, meshes: dict[str, DeviceMesh], device: torch.device):
    """``(model, hf_config, pipe)``: with pp > 1 this rank's pipeline (``training.pipeline``) and its model part
    (transformers' names), else ``build_model``'s model and None."""
    if dims.pp == 1:
        return *build_model(cfg, dims, meshes, device), None
    hf_config = build_hf_config(cfg.model)
    pipe = build_pipeline(cfg, dims, meshes, device, hf_config)
    return pipe.part, hf_config, pipe


def step_forward(cfg: JobConfig, dims: ParallelDims, meshes: dict[str, DeviceMesh]) -> Callable:
    """``forward(model, batch, autocast)`` -> summed loss of a batch: a SALM's, or the causal LM's (attention
    over the cp group when cp > 1, ``training.context_parallel``)."""
    if cfg.model.kind == "salm":
        from training.speech.job import salm_loss_sum

        return salm_loss_sum
    if dims.cp > 1:
        return functools.partial(forward_loss_sum,
                                 attention_kwargs=cp_attention_kwargs(meshes["cp"], cfg.distributed.cp_comm))
    return forward_loss_sum


def gather_loader_states(batches: DevicePrefetcher, dp_mesh: DeviceMesh) -> list:
    """Every dp rank's loader state as of the last batch trained on, ordered by dp rank (TP/CP/PP
    peers hold identical ones). Taken from the prefetcher, which may have read ahead of the step."""
    by_dp = dict(gather_objects((dp_mesh.get_local_rank(), batches.state_dict())))
    return [by_dp[r] for r in range(len(by_dp))]


def train(cfg: JobConfig, make_loader: Callable[[int, int], Iterable] | None = None) -> list[dict]:
    """Run the job described by ``cfg``; returns the logged metric records (global figures, on every rank).

    ``make_loader(dp_rank, dp_size)`` (an iterable of batch dicts with ``state_dict`` / ``load_state_dict``)
    replaces ``dataio.build_loader(cfg.data, dp_rank, dp_size)``; tests use it to feed hand-made batches.
    """
    check_job(cfg)  # every input rule, before any process group work (ConfigError: one line from rank 0)
    device = pick_device(cfg.trainer.device)
    init_distributed(device.type)
    rank, world = dist.get_rank(), dist.get_world_size()
    if (unpacked := one_document_per_row(cfg)) is not cfg:
        cfg = unpacked
        if rank == 0:
            print("the model has no attention interface (training.families): one document per row, sdpa, "
                  "data.packing: none",
                  flush=True)
    dims = ParallelDims.from_config(cfg.distributed, world)  # its rules already passed check_job (as ConfigError)
    meshes = dims.build_meshes(device.type)
    coords = rank_coordinates(meshes["world"])
    out_dir = Path(cfg.trainer.output_dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"mesh {dict(zip(MESH_DIMS, dims.shape))} on {world} ranks\n{format_coordinates(coords)}",
              flush=True)
        with open(out_dir / "config.yaml", "w") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)

    torch.manual_seed(cfg.trainer.seed)  # same seed everywhere for init
    model, hf_config, pipe = build_model_or_pipeline(cfg, dims, meshes, device)
    autocast = cfg.trainer.precision == "bf16" and not isinstance(model, FSDPModule)  # FSDP2 casts via its policy
    optimizer = build_optimizer(model, cfg.optim)

    dp_rank, dp_size = meshes["dp"].get_local_rank(), dims.dp
    if make_loader is None:
        from dataio import build_loader

        make_loader = functools.partial(build_loader, cfg.data)
    loader = make_loader(dp_rank, dp_size)
    give_tail_group(loader)
    check_vocab(hf_config.vocab_size, cfg.model.tokenizer, getattr(loader, "sources", ()))
    if cfg.model.kind == "salm":  # audio batches -> prompt + transcript token layout
        from training.speech.job import wrap_loader

        loader = wrap_loader(loader, model, cfg, dims)
    forward = step_forward(cfg, dims, meshes)
    torch.manual_seed(seed_for_rank(cfg.trainer.seed, dp_rank))
    ckpt_dir = out_dir / "checkpoints"
    step = 0
    resume_from = checkpoint.latest(ckpt_dir) if cfg.checkpoint.resume else None
    if resume_from is not None:
        state = checkpoint.load(resume_from, model, optimizer)
        loader.load_state_dict(state["loader"])
        step = state["step"]
        if rank == 0:
            print(f"resumed from {resume_from} at step {step}", flush=True)
    if cfg.trainer.data_seed is not None:  # a chained job's own seed (training.launch --jobs)
        first = loader.reseed(cfg.trainer.data_seed)
        if rank == 0:
            print(f"data seed {cfg.trainer.data_seed} orders each dataset's epochs from {first} on", flush=True)
    validate = make_validator(cfg, dims, meshes, device, model, pipe) if cfg.trainer.eval_every else None

    run = open_run(cfg.logging.wandb, out_dir, to_dict(cfg)) if cfg.logging.wandb and rank == 0 else None
    logger = MetricsLogger(out_dir, enabled=rank == 0, console=cfg.logging.console,
                           tensorboard=cfg.logging.tensorboard, wandb_run=run)
    profiler = StepProfiler(cfg.trainer.profile, out_dir, rank, device)
    flops_tok = flops_per_token(hf_config, cfg.data.seq_len or 0)  # a SALM's: the LLM's matmuls only
    peak = peak_flops(device)
    batches = DevicePrefetcher(loader, device, transform=cp_batch_transform(dims.cp, meshes["cp"].get_local_rank())
                               if dims.cp > 1 else None)
    window_start, window_batches, window_tokens, window_fill = time.perf_counter(), 0, 0, []
    window_first_step = step
    while step < cfg.trainer.max_steps:
        try:
            micro = next_micro_batches(batches, cfg.trainer.grad_accum)
        except StopIteration:  # a finite stream (data.epochs) ended: stop here, still save and export
            if rank == 0:
                print(f"data exhausted after step {step}", flush=True)
            break
        step += 1
        set_lr(optimizer, lr_at(step, cfg.optim, cfg.trainer.max_steps))
        moe.reset_step(model)
        reset_exchanged_bytes()  # cp_bytes_sent is per step
        with profiler.step(step):
            if pipe is not None:
                stats = pipeline_train_step(pipe, optimizer, micro, meshes["dp_cp"],
                                            max_grad_norm=cfg.optim.max_grad_norm)
            else:
                stats = train_step(model, optimizer, micro, meshes["dp_cp"], max_grad_norm=cfg.optim.max_grad_norm,
                                   defer_grad_sync=cfg.distributed.defer_fsdp_grad_sync, autocast=autocast,
                                   forward=forward)
        window_tokens += sum(mb["input_ids"].numel() for mb in micro) * dims.dp * dims.cp
        window_fill += [float(mb["fill"]) if "fill" in mb else
                        float((mb["labels"] != IGNORE_INDEX).float().mean()) for mb in micro]
        if step % cfg.trainer.log_every == 0 or step == cfg.trainer.max_steps:
            elapsed = time.perf_counter() - window_start
            tokens_per_s = window_tokens / elapsed
            flops_per_s = tokens_per_s * flops_tok / world
            wait = sum(batches.waits[window_batches:])
            logger.log({
                "step": step, "loss": stats["loss"], "lr": optimizer.param_groups[0]["lr"],
                "grad_norm": stats["grad_norm"], "tokens": stats["tokens"],
                "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / world,
                "flops_per_s": flops_per_s, "mfu": flops_per_s / peak if peak else None,
                "data_wait_frac": wait / elapsed,
                "pack_fill": sum(window_fill) / len(window_fill),
                "max_mem": max_memory_gib(device), **moe.step_metrics(model, meshes["dp_cp"]),
                **(pipeline_metrics(pipe, max_memory_gib(device)) if pipe is not None else {}),
                **rank_spread((elapsed - wait) / (step - window_first_step), wait / elapsed, device),
                **(cp_step_metrics(micro) if dims.cp > 1 else {}),
            })
            window_start, window_batches, window_tokens, window_fill = time.perf_counter(), len(batches.waits), 0, []
            window_first_step = step
        if cfg.model.kind == "salm" and cfg.model.speech.eval_every and step % cfg.model.speech.eval_every == 0:
            from training.speech.eval import eval_in_training

            eval_in_training(model, cfg, step)  # rank 0 prints the WER and writes the hypotheses
        if validate is not None and (step % cfg.trainer.eval_every == 0 or step == cfg.trainer.max_steps):
            validating = time.perf_counter()
            logger.log_val({"step": step, **validate()})
            window_start += time.perf_counter() - validating  # validation time is not training throughput
        interval = cfg.checkpoint.interval
        if interval and step % interval == 0 and step < cfg.trainer.max_steps:
            saving = time.perf_counter()
            checkpoint.save(ckpt_dir, step, model, optimizer, gather_loader_states(batches, meshes["dp"]),
                            keep_last=cfg.checkpoint.keep_last)
            window_start += time.perf_counter() - saving  # checkpoint time is not training throughput

    batches.close()
    profiler.close()
    saved_already = checkpoint.latest(ckpt_dir) == checkpoint.checkpoint_dir(ckpt_dir, step)
    if cfg.checkpoint.save_final and step > 0 and not saved_already:
        checkpoint.save(ckpt_dir, step, model, optimizer, gather_loader_states(batches, meshes["dp"]),
                        keep_last=cfg.checkpoint.keep_last)
    if cfg.checkpoint.export_hf and cfg.model.kind == "salm":
        from training.speech.job import export_salm

        export_salm(model, cfg, out_dir)
    elif cfg.checkpoint.export_hf:
        checkpoint.export_hf(model, hf_config, out_dir / "hf", cfg.model.tokenizer,
                             shard_size_mb=cfg.checkpoint.export_shard_size_mb,
                             experts_layout=cfg.checkpoint.export_hf_experts)
    logger.summary()
    logger.close()
    return logger.history


__all__ = ["build_model", "build_model_or_pipeline", "gradient_sync", "init_distributed", "seed_for_rank",
           "step_forward", "train", "train_step"]
