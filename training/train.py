"""The training loop. ``train(cfg)`` at the bottom runs the job as a sequence of steps, each a function here:

- ``init_distributed`` + ``set_up_meshes``: the process group, ``ParallelDims`` and its device meshes;
- ``build_trainer``: the model on the meta device wrapped in ``CausalLMLoss`` (forward = decoder + lm_head
  cross-entropy in token chunks, so the fp32 ``[tokens, vocab]`` logits never exist), parallelized (TP/SP ->
  AC -> compile -> FSDP2/HSDP, or DDP; this rank's pipeline stages when pp > 1), each rank's shard
  materialized, and its optimizer; a ``Trainer`` holds this live state and the step reached;
- ``build_train_loader`` (this dp rank's loader), ``resume`` (the newest checkpoint, if any);
- ``run_steps``: ``train_step`` until ``max_steps``, logging, validating and checkpointing on their steps;
- ``save_final_checkpoint``, ``export_model`` (``hf/``), the summary.

One step = ``grad_accum`` packed THD micro-batches. The loss is a sum of token cross-entropies divided
by the number of real tokens (labels != -100) in the whole global batch: that count is all-reduced over
the loss mesh (dp x cp) *before* the first backward, so every micro-step's gradient is already correctly
scaled and the result does not depend on how tokens split across micro-steps or ranks. FSDP2 and DDP
average gradients over dp, so each rank's loss is multiplied by the dp x cp size to make that average a
sum. Gradients are reduced only on the last micro-step (``defer_fsdp_grad_sync``).

Context parallelism (``distributed.cp_size`` > 1, ``training.distributed.context_parallel``): the prefetcher keeps only
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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
from training.components import checkpoint
from training.distributed import moe
from training.config.job_config import JobConfig
from training.distributed.context_parallel import (
    cp_attention_kwargs,
    cp_step_metrics,
    rank_batch_transform,
    reset_exchanged_bytes,
)
from training.models.loss import CausalLMLoss
from training.components.metrics import (
    MetricsLogger,
    ThroughputWindow,
    build_metrics_logger,
    flops_per_token,
    max_memory_gib,
    peak_flops,
)
from training.models.build import build_hf_config, build_meta_model, materialize, one_document_per_row
from training.components.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from training.distributed.parallel_dims import MESH_DIMS, ParallelDims, format_coordinates, rank_coordinates
from training.distributed.dense import apply_ddp
from training.distributed.parallelize import parallelize
from training.distributed.pipeline import Pipeline, build_pipeline, pipeline_metrics
from training.step import pipeline_train_step
from training.components.profiling import StepProfiler
from training.config.validate import check_job, check_vocab
from training.components.telemetry import rank_spread
from training.validation import make_validator

if TYPE_CHECKING:
    from transformers import PretrainedConfig

STEP_INPUTS = ("input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "fill",  # what a step reads
               "audio", "audio_lens", "audio_mask",  # + a SALM's (training.speech)
               "cp_imbalance")  # + context parallelism's (training.distributed.context_parallel)


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
    already shifted). ``attention_kwargs``: extra attention kwargs (the CP group, ``training.distributed.context_parallel``)."""
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
    """``(model, hf_config, pipe)``: with pp > 1 this rank's pipeline (``training.distributed.pipeline``) and its model part
    (transformers' names), else ``build_model``'s model and None."""
    if dims.pp == 1:
        return *build_model(cfg, dims, meshes, device), None
    hf_config = build_hf_config(cfg.model)
    pipe = build_pipeline(cfg, dims, meshes, device, hf_config)
    return pipe.part, hf_config, pipe


def step_forward(cfg: JobConfig, dims: ParallelDims, meshes: dict[str, DeviceMesh]) -> Callable:
    """``forward(model, batch, autocast)`` -> summed loss of a batch: a SALM's, or the causal LM's (attention
    over the cp group when cp > 1, ``training.distributed.context_parallel``)."""
    if cfg.model.kind == "salm":
        from training.speech.job import salm_loss_sum

        return salm_loss_sum
    if dims.cp > 1:
        return functools.partial(forward_loss_sum,
                                 attention_kwargs=cp_attention_kwargs(meshes["cp"], cfg.distributed.cp_comm))
    return forward_loss_sum


def uses_autocast(cfg: JobConfig, model: nn.Module) -> bool:
    """bf16 through ``torch.autocast``: on every model but an FSDP2 one, which casts via its policy."""
    return cfg.trainer.precision == "bf16" and not isinstance(model, FSDPModule)


def print_on_rank0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


@dataclass(kw_only=True)
class Trainer:
    """The live state of a job: what ``build_trainer`` made and the step reached. The functions below take it
    first (as ``training.distributed.pipeline``'s take a ``Pipeline``); ``train`` calls them in order."""

    cfg: JobConfig
    device: torch.device
    dims: ParallelDims
    meshes: dict[str, DeviceMesh]
    model: nn.Module  # with pp > 1 this rank's pipeline part
    hf_config: PretrainedConfig  # a SALM's: its LLM's
    pipe: Pipeline | None
    optimizer: torch.optim.Optimizer
    forward: Callable[[nn.Module, dict, bool], torch.Tensor]  # ``step_forward``'s
    autocast: bool
    step: int = 0  # the last step trained (or resumed from)

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.trainer.output_dir)

    @property
    def checkpoints(self) -> Path:
        return self.out_dir / "checkpoints"


def with_model_layout(cfg: JobConfig) -> JobConfig:
    """``cfg``, or its one-document-per-row variant when the model has no attention interface (said once)."""
    if (unpacked := one_document_per_row(cfg)) is not cfg:
        print_on_rank0("the model has no attention interface (training.models.families): one document per row, sdpa, "
                       "data.packing: none")
    return unpacked


def set_up_meshes(cfg: JobConfig, device: torch.device) -> tuple[ParallelDims, dict[str, DeviceMesh]]:
    """``ParallelDims`` over the world and its meshes; rank 0 prints every rank's coordinates. Collective."""
    world = dist.get_world_size()
    dims = ParallelDims.from_config(cfg.distributed, world)  # its rules already passed check_job (as ConfigError)
    meshes = dims.build_meshes(device.type)
    coords = rank_coordinates(meshes["world"])
    print_on_rank0(f"mesh {dict(zip(MESH_DIMS, dims.shape))} on {world} ranks\n{format_coordinates(coords)}")
    return dims, meshes


def save_job_config(cfg: JobConfig) -> None:
    """Rank 0 creates ``trainer.output_dir`` and writes the resolved job there (``config.yaml``)."""
    if dist.get_rank() == 0:
        out_dir = Path(cfg.trainer.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "config.yaml", "w") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


def build_trainer(cfg: JobConfig, device: torch.device, dims: ParallelDims, meshes: dict[str, DeviceMesh]) -> Trainer:
    """The model (this rank's pipeline part when pp > 1) from one seed on every rank, its optimizer (the
    learning rate is set per step, ``take_step``) and the step's forward."""
    torch.manual_seed(cfg.trainer.seed)  # same seed everywhere for init
    model, hf_config, pipe = build_model_or_pipeline(cfg, dims, meshes, device)
    return Trainer(cfg=cfg, device=device, dims=dims, meshes=meshes, model=model, hf_config=hf_config, pipe=pipe,
                   optimizer=build_optimizer(model, cfg.optim), forward=step_forward(cfg, dims, meshes),
                   autocast=uses_autocast(cfg, model))


def build_train_loader(trainer: Trainer, make_loader: Callable[[int, int], Iterable] | None) -> Iterable:
    """This dp rank's loader (``make_loader``, by default ``dataio.build_loader`` on ``data:``), its tokens checked
    against the model's vocabulary; a SALM's audio batches get the prompt + transcript token layout."""
    cfg = trainer.cfg
    if make_loader is None:
        from dataio import build_loader

        make_loader = functools.partial(build_loader, cfg.data)
    loader = make_loader(trainer.meshes["dp"].get_local_rank(), trainer.dims.dp)
    give_tail_group(loader)
    check_vocab(trainer.hf_config.vocab_size, cfg.model.tokenizer, getattr(loader, "sources", ()))
    if cfg.model.kind == "salm":
        from training.speech.job import wrap_loader

        loader = wrap_loader(loader, trainer.model, cfg, trainer.dims)
    return loader


def resume(trainer: Trainer, loader) -> None:
    """Continue from the newest complete checkpoint (``checkpoint.resume``): model, optimizer, RNG, every
    dp rank's loader position and the step; then apply a chained job's own data seed (``trainer.data_seed``,
    ``training.launch --jobs``)."""
    cfg = trainer.cfg
    resume_from = checkpoint.latest(trainer.checkpoints) if cfg.checkpoint.resume else None
    if resume_from is not None:
        state = checkpoint.load(resume_from, trainer.model, trainer.optimizer)
        loader.load_state_dict(state["loader"])
        trainer.step = state["step"]
        print_on_rank0(f"resumed from {resume_from} at step {trainer.step}")
    if cfg.trainer.data_seed is not None:
        first = loader.reseed(cfg.trainer.data_seed)
        print_on_rank0(f"data seed {cfg.trainer.data_seed} orders each dataset's epochs from {first} on")


def take_step(trainer: Trainer, micro_batches: list[dict], profiler: StepProfiler) -> dict:
    """Step ``trainer.step``: its learning rate, fresh per-step counters, then ``train_step`` (or the pipeline's)."""
    cfg, loss_mesh = trainer.cfg, trainer.meshes["dp_cp"]
    set_lr(trainer.optimizer, lr_at(trainer.step, cfg.optim, cfg.trainer.max_steps))
    moe.reset_step(trainer.model)
    reset_exchanged_bytes()  # cp_bytes_sent is per step
    with profiler.step(trainer.step):
        if trainer.pipe is not None:
            stats = pipeline_train_step(trainer.pipe, trainer.optimizer, micro_batches, loss_mesh,
                                        max_grad_norm=cfg.optim.max_grad_norm)
        else:
            stats = train_step(trainer.model, trainer.optimizer, micro_batches, loss_mesh,
                               max_grad_norm=cfg.optim.max_grad_norm,
                               defer_grad_sync=cfg.distributed.defer_fsdp_grad_sync, autocast=trainer.autocast,
                               forward=trainer.forward)
    return stats


def step_record(trainer: Trainer, stats: dict, micro_batches: list[dict], throughput: dict, step_time: float) -> dict:
    """The metrics of step ``trainer.step`` (global figures on every rank): ``stats`` from the step, the window's
    ``throughput``, memory, MoE, pipeline stage, per-rank spread and CP figures. Collectives on every rank."""
    device, loss_mesh = trainer.device, trainer.meshes["dp_cp"]
    return {
        "step": trainer.step, "loss": stats["loss"], "lr": trainer.optimizer.param_groups[0]["lr"],
        "grad_norm": stats["grad_norm"], "tokens": stats["tokens"], **throughput,
        "max_mem": max_memory_gib(device), **moe.step_metrics(trainer.model, loss_mesh),
        **(pipeline_metrics(trainer.pipe, max_memory_gib(device)) if trainer.pipe is not None else {}),
        **rank_spread(step_time, throughput["data_wait_frac"], device),
        **(cp_step_metrics(micro_batches) if trainer.dims.cp > 1 else {}),
    }


def save_checkpoint(trainer: Trainer, batches: DevicePrefetcher) -> None:
    """Checkpoint ``trainer.step`` with every dp rank's loader state as of the last batch trained on. Collective."""
    checkpoint.save(trainer.checkpoints, trainer.step, trainer.model, trainer.optimizer,
                    checkpoint.gather_loader_states(batches, trainer.meshes["dp"]),
                    keep_last=trainer.cfg.checkpoint.keep_last)


def run_steps(trainer: Trainer, batches: DevicePrefetcher, logger: MetricsLogger, profiler: StepProfiler,
              validate: Callable[[], dict] | None) -> None:
    """Steps until ``trainer.max_steps`` or the end of a finite stream. Logs every ``log_every`` steps, validates
    every ``eval_every`` (a SALM also decodes every ``model.speech.eval_every``), saves every
    ``checkpoint.interval`` steps before the last; the last step always logs and validates."""
    cfg = trainer.cfg
    max_steps = cfg.trainer.max_steps
    flops_tok = flops_per_token(trainer.hf_config, cfg.data.seq_len or 0)  # a SALM's: the LLM's matmuls only
    window = ThroughputWindow(batches.waits, trainer.step, flops_per_token=flops_tok, peak=peak_flops(trainer.device),
                              world=dist.get_world_size())
    while trainer.step < max_steps:
        try:
            micro = next_micro_batches(batches, cfg.trainer.grad_accum)
        except StopIteration:  # a finite stream (data.epochs) ended: stop here, still save and export
            print_on_rank0(f"data exhausted after step {trainer.step}")
            return
        trainer.step += 1
        stats = take_step(trainer, micro, profiler)
        window.add(micro, trainer.dims.dp * trainer.dims.cp)
        step = trainer.step
        if step % cfg.trainer.log_every == 0 or step == max_steps:
            logger.log(step_record(trainer, stats, micro, *window.figures(step)))
            window.restart(step)
        if cfg.model.kind == "salm" and cfg.model.speech.eval_every and step % cfg.model.speech.eval_every == 0:
            from training.speech.eval import eval_in_training

            eval_in_training(trainer.model, cfg, step)  # rank 0 prints the WER and writes the hypotheses
        if validate is not None and (step % cfg.trainer.eval_every == 0 or step == max_steps):
            with window.paused():  # validation time is not training throughput
                logger.log_val({"step": step, **validate()})
        if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0 and step < max_steps:
            with window.paused():  # checkpoint time is not training throughput
                save_checkpoint(trainer, batches)


def save_final_checkpoint(trainer: Trainer, batches: DevicePrefetcher) -> None:
    """``checkpoint.save_final``: the last step's checkpoint, unless the interval already wrote it."""
    folder = trainer.checkpoints
    saved_already = checkpoint.latest(folder) == checkpoint.checkpoint_dir(folder, trainer.step)
    if trainer.cfg.checkpoint.save_final and trainer.step > 0 and not saved_already:
        save_checkpoint(trainer, batches)


def export_model(trainer: Trainer) -> None:
    """``checkpoint.export_hf``: the consolidated ``hf/`` of the model (a SALM's: ``export_salm``). Collective."""
    cfg = trainer.cfg
    if cfg.checkpoint.export_hf and cfg.model.kind == "salm":
        from training.speech.job import export_salm

        export_salm(trainer.model, cfg, trainer.out_dir)
    elif cfg.checkpoint.export_hf:
        checkpoint.export_hf(trainer.model, trainer.hf_config, trainer.out_dir / "hf", cfg.model.tokenizer,
                             shard_size_mb=cfg.checkpoint.export_shard_size_mb,
                             experts_layout=cfg.checkpoint.export_hf_experts)


def train(cfg: JobConfig, make_loader: Callable[[int, int], Iterable] | None = None) -> list[dict]:
    """Run the job described by ``cfg``; returns the logged metric records (global figures, on every rank).

    ``make_loader(dp_rank, dp_size)`` (an iterable of batch dicts with ``state_dict`` / ``load_state_dict``)
    replaces ``dataio.build_loader(cfg.data, dp_rank, dp_size)``; tests use it to feed hand-made batches.
    """
    check_job(cfg)  # every input rule, before any process group work (ConfigError: one line from rank 0)
    device = pick_device(cfg.trainer.device)
    init_distributed(device.type)
    cfg = with_model_layout(cfg)
    dims, meshes = set_up_meshes(cfg, device)
    save_job_config(cfg)
    trainer = build_trainer(cfg, device, dims, meshes)
    loader = build_train_loader(trainer, make_loader)
    torch.manual_seed(seed_for_rank(cfg.trainer.seed, meshes["dp"].get_local_rank()))
    resume(trainer, loader)  # a resumed run restores its RNG too
    validate = (make_validator(cfg, dims, meshes, device, trainer.model, trainer.pipe)
                if cfg.trainer.eval_every else None)
    logger = build_metrics_logger(cfg, dist.get_rank())
    profiler = StepProfiler(cfg.trainer.profile, trainer.out_dir, dist.get_rank(), device)
    batches = DevicePrefetcher(loader, device, transform=rank_batch_transform(dims, meshes))

    run_steps(trainer, batches, logger, profiler, validate)

    batches.close()
    profiler.close()
    save_final_checkpoint(trainer, batches)
    export_model(trainer)
    logger.summary()
    logger.close()
    return logger.history


__all__ = ["Trainer", "build_model", "build_model_or_pipeline", "build_trainer", "gradient_sync", "init_distributed",
           "seed_for_rank", "step_forward", "train", "train_step", "uses_autocast"]
