"""The training loop. ``train(cfg)`` at the bottom runs the job as a sequence of steps, each a function here:

- ``ParallelDims.from_config`` (the degrees' rules), ``init_distributed`` + ``set_up_meshes``: the process
  group and every device mesh, held by the ``ParallelDims`` (``get_mesh``);
- ``build_trainer``: the model through its kind's spec (``headrace.training.model_kinds``: a causal LM,
  ``headrace.training.causal_lm``, or a SALM, ``headrace.training.speech.kind``), built on the meta device,
  parallelized (TP/SP -> AC -> compile -> FSDP2/HSDP, or DDP; this rank's pipeline stages when pp > 1), each
  rank's shard materialized, and its optimizer; a ``Trainer`` holds this live state and the step reached. The
  loop never asks which kind it trains: the loader wrap, the forward, decoding and export come from the spec;
- ``build_train_loader`` (this dp rank's loader), ``resume`` (the newest checkpoint, if any);
- ``run_steps``: ``train_step`` until ``max_steps``, logging, validating and checkpointing on their steps;
- ``save_final_checkpoint``, ``export_model`` (``hf/``), the summary.

One step = ``grad_accum`` packed THD micro-batches through ``headrace.training.step`` (forward, loss scaled by the
global batch's real-token count, backward, clip, optimizer step).

Context parallelism (``distributed.cp_size`` > 1, ``headrace.training.distributed.context_parallel``): the prefetcher
keeps only this rank's head-tail chunks of each packed batch before the device copy, and attention runs over
the cp group; the step's loss and gradient arithmetic is unchanged (dp x cp is already the loss mesh).

Attention stays inside each document: the model runs kernels' ``headrace_varlen`` attention (registered
with transformers' AttentionInterface) fed by ``cu_seq_lens_q`` / ``position_ids`` from the batch.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import yaml
from torch import nn

from headrace.config import to_dict
from headrace.dataio.feed.even import even_batches
from headrace.dataio.feed.prefetch import DevicePrefetcher
from headrace.dataio.loader import build_loader
from headrace.dataio.stream.ordering.seeding import rank_seed
from headrace.training.checkpoint import export, layout, restore, saver, store
from headrace.training.components.nonfinite import NonFiniteGuard, check_finite_state
from headrace.training.components.metrics import (
    MetricsLogger,
    ThroughputWindow,
    attention_flops_per_pair,
    build_metrics_logger,
    flops_per_token,
    matmul_flops_per_token,
    max_memory_gib,
    peak_flops,
)
from headrace.training.components.optim import build_optimizer, lr_at, set_lr
from headrace.training.components.wall_clock import WallClock
from headrace.training.components.preemption import Preemption
from headrace.training.checkpoint.save_buffers import allocate_save_buffers
from headrace.training.components.profiling import StepProfiler
from headrace.training.components.telemetry import ComputeClock, rank_spread, sum_over_dp
from headrace.training.config.job_config import JobConfig
from headrace.training.errors import named_write
from headrace.training.components.data import open_data, shard_sources, worker_choice_line
from headrace.training.config.validate import check_data_paths, check_job, check_vocab
from headrace.training.distributed import moe
from headrace.training.distributed.context_parallel import cp_step_metrics, reset_exchanged_bytes
from headrace.training.distributed.parallel_dims import MESH_DIMS, ParallelDims, format_coordinates, rank_coordinates
from headrace.training.distributed.pipeline import Pipeline, pipeline_metrics
from headrace.training.distributed.process_group import init_distributed, new_tail_group, pick_device, world_size
from headrace.training.model_kinds import build_model_or_pipeline, model_kind
from headrace.training.models.build import one_document_per_row
from headrace.training.models.converters import ModelConverters, build_converters
from headrace.training.components.run_lock import lock_output_dir
from headrace.training.protocols.model_kind import ModelKind
from headrace.training.step import next_micro_batches, pipeline_train_step, train_step, uses_autocast
from headrace.training.step_inputs import DeferredRecords, step_batch_transform
from headrace.training.validation import make_validator

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def host_float(value: float | torch.Tensor | None) -> float | None:
    """``value`` as a Python float: a device scalar of the step is read here, at a checkpoint or the summary."""
    return None if value is None else float(value)


def even_if_finite(batches: DevicePrefetcher, cfg: JobConfig) -> Iterator[dict]:
    """What the steps read: ``batches``, evened out over the ranks when the stream is finite (``data.epochs``):
    a rank that ran out trains on loss-free copies of its last batch until every rank has (a step's
    collectives need every rank). Collective when finite."""
    if cfg.data.epochs is None:
        return iter(batches)
    return even_batches(batches, new_tail_group())


def print_on_rank0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


@dataclass(kw_only=True)
class Trainer:
    """The live state of a job: what ``build_trainer`` made and the step reached. The functions below take it
    first (as ``headrace.training.distributed.pipeline``'s take a ``Pipeline``); ``train`` calls them in order."""

    cfg: JobConfig
    kind: ModelKind  # cfg.model.kind's spec: what the loop calls for this kind of model
    converters: ModelConverters  # the job's model converters: their checkpoint and export hooks
    device: torch.device
    dims: ParallelDims  # the degrees and every mesh (dims.get_mesh)
    model: nn.Module  # with pp > 1 this rank's pipeline part
    hf_config: PretrainedConfig  # a SALM's: its LLM's
    pipe: Pipeline | None
    optimizer: torch.optim.Optimizer
    forward: Callable[[nn.Module, dict, bool], torch.Tensor]  # ``step_forward``'s
    autocast: bool
    step: int = 0  # the last step trained (or resumed from)
    # the run's first logged loss (kept across resumes: the summary's); a device scalar until read at a save
    first_loss: float | torch.Tensor | None = None
    saver: saver.Saver = field(init=False)  # blocking or background saves (checkpoint.async_mode)
    guard: NonFiniteGuard = field(init=False)  # skipped non-finite steps: named, counted, bounded
    warned: bool = False  # the kind's ``val_warning`` was said (once a run)
    clock: WallClock = field(init=False)  # trainer.max_minutes spent (the stop and optim.schedule: minutes)

    def __post_init__(self):
        self.saver = saver.Saver(self.cfg.checkpoint.async_mode)
        self.clock = WallClock(None, self.device)
        self.guard = NonFiniteGuard(self.cfg.trainer.max_bad_steps, self.device)

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.trainer.output_dir)

    @property
    def checkpoints(self) -> Path | str:
        """``checkpoint.folder`` (a path or URL), else ``output_dir/checkpoints``."""
        return self.cfg.checkpoint.folder or self.out_dir / "checkpoints"


def with_model_layout(cfg: JobConfig) -> JobConfig:
    """``cfg``, or its one-document-per-row variant when the model has no attention interface (said once)."""
    if (unpacked := one_document_per_row(cfg, model_kind(cfg).llm_config)) is not cfg:
        print_on_rank0(
            "the model has no attention interface (headrace.training.models.families): one document per row, sdpa, "
            "data.packing: none"
        )
    return unpacked


def set_up_meshes(dims: ParallelDims, device: torch.device) -> None:
    """``dims``' meshes over the world; rank 0 prints every rank's coordinates. Collective."""
    dims.build_meshes(device.type)
    coords = rank_coordinates(dims.get_mesh("world"))
    print_on_rank0(f"mesh {dict(zip(MESH_DIMS, dims.shape))} on {dims.world_size} ranks\n{format_coordinates(coords)}")


def save_job_config(cfg: JobConfig) -> None:
    """Rank 0 creates ``trainer.output_dir`` and writes the resolved job there (``config.yaml``)."""
    if dist.get_rank() == 0:
        out_dir = Path(cfg.trainer.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        with named_write(out_dir / "config.yaml"), open(out_dir / "config.yaml", "w") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


def build_trainer(cfg: JobConfig, device: torch.device, dims: ParallelDims) -> Trainer:
    """The model (this rank's pipeline part when pp > 1) from one seed on every rank, its optimizer (the
    learning rate is set per step, ``take_step``) and the step's forward."""
    torch.manual_seed(cfg.trainer.seed)  # same seed everywhere for init
    kind = model_kind(cfg)
    model, hf_config, pipe = build_model_or_pipeline(cfg, dims, device)
    optimizer = build_optimizer(model, cfg.optim)
    converters = build_converters(cfg)
    converters.post_optimizer_hook(model, optimizer)
    return Trainer(
        cfg=cfg,
        kind=kind,
        converters=converters,
        device=device,
        dims=dims,
        model=model,
        hf_config=hf_config,
        pipe=pipe,
        optimizer=optimizer,
        forward=kind.step_forward(cfg, dims),
        autocast=uses_autocast(cfg, model),
    )


def build_train_loader(trainer: Trainer, make_loader: Callable[[int, int], Iterable] | None) -> Iterable:
    """This dp rank's loader (``make_loader``, by default ``headrace.dataio.build_loader`` on ``data:``), its tokens checked
    against the model's vocabulary, through the kind's ``wrap_loader`` (a SALM's audio batches get the prompt +
    transcript token layout)."""
    cfg = trainer.cfg
    if make_loader is None:
        check_data_paths(cfg.data)
        make_loader = functools.partial(build_loader, cfg.data)
    loader = open_data("data", lambda: make_loader(trainer.dims.get_mesh("dp").get_local_rank(), trainer.dims.dp))
    if line := worker_choice_line(loader):
        print_on_rank0(line)
    if trainer.kind.config.has_llm:  # else the kind turns transcripts into its own units (a CTC stage)
        check_vocab(trainer.hf_config.vocab_size, cfg.model.tokenizer, shard_sources(loader))
    return trainer.kind.wrap_loader(loader, trainer.model, cfg, trainer.dims)


def resume(trainer: Trainer, loader) -> None:
    """Continue from the newest complete checkpoint this run wrote (``restore.load_newest``: sealed, same model
    config, an incomplete one skipped): model, optimizer, RNG, every dp rank's loader position, the step and the
    run's first loss; then apply a chained job's own data seed (``trainer.data_seed``, ``headrace.training.launch --jobs``)."""
    cfg = trainer.cfg
    found = None
    if cfg.checkpoint.resume:
        found = restore.load_newest(
            trainer.checkpoints,
            trainer.model,
            trainer.optimizer,
            model_record(trainer),
            local=trainer.out_dir / "checkpoints",
            trainable_only=trainer.converters.trainable_only,
        )
    if found is not None:
        resume_from, state = found
        loader.load_state_dict(state["loader"])
        trainer.step = state["step"]
        trainer.first_loss = state["first_loss"]
        print_on_rank0(f"resumed from {resume_from} at step {trainer.step}")
    if cfg.trainer.data_seed is not None:
        first = loader.reseed(cfg.trainer.data_seed)
        print_on_rank0(f"data seed {cfg.trainer.data_seed} orders each dataset's epochs from {first} on")


def take_step(trainer: Trainer, micro_batches: list[dict], profiler: StepProfiler) -> dict:
    """Step ``trainer.step``: its learning rate, fresh per-step counters, then ``train_step`` (or the pipeline's)."""
    cfg, loss_mesh = trainer.cfg, trainer.dims.get_mesh("dp_cp")
    set_lr(trainer.optimizer, lr_at(trainer.step, cfg.optim, cfg.trainer.max_steps, trainer.clock.fraction))
    moe.reset_step(trainer.model)
    reset_exchanged_bytes()  # cp_bytes_sent is per step
    with profiler.step(trainer.step):
        if trainer.pipe is not None:
            stats = pipeline_train_step(
                trainer.pipe, trainer.optimizer, micro_batches, loss_mesh, max_grad_norm=cfg.optim.max_grad_norm
            )
        else:
            stats = train_step(
                trainer.model,
                trainer.optimizer,
                micro_batches,
                loss_mesh,
                max_grad_norm=cfg.optim.max_grad_norm,
                defer_grad_sync=cfg.distributed.defer_fsdp_grad_sync,
                autocast=trainer.autocast,
                forward=trainer.forward,
            )
    return stats


def step_record(
    trainer: Trainer, stats: dict, micro_batches: list[dict], throughput: dict, step_time: float, compute_time: float
) -> dict:
    """The metrics of step ``trainer.step`` (global figures on every rank): ``stats`` from the step (device
    scalars, left as they are: ``DeferredRecords`` reads them), the window's ``throughput``, memory, MoE,
    pipeline stage, per-rank spread (wall and own compute time) and CP figures. Collectives on every rank."""
    device, loss_mesh = trainer.device, trainer.dims.get_mesh("dp_cp")
    return {
        "step": trainer.step,
        "loss": stats["loss"],
        "lr": trainer.optimizer.param_groups[0]["lr"],
        "grad_norm": stats["grad_norm"],
        "tokens": stats["tokens"],
        **throughput,
        "max_mem": max_memory_gib(device),
        **moe.step_metrics(trainer.model, loss_mesh),
        **(pipeline_metrics(trainer.pipe, max_memory_gib(device)) if trainer.pipe is not None else {}),
        **rank_spread(step_time, throughput["data_wait_frac"], device, compute_time),
        **(cp_step_metrics(micro_batches) if trainer.dims.cp > 1 else {}),
    }


def model_record(trainer: Trainer) -> dict:
    """What a checkpoint records of the model and a resume compares: its config, and the converters' entries
    (LoRA: the base it adapts, since the checkpoint holds only the trainable state, and the adapter settings)."""
    return {**layout.model_config_record(trainer.hf_config), **trainer.converters.model_record(trainer.cfg)}


def save_checkpoint(trainer: Trainer, batches: DevicePrefetcher) -> None:
    """Checkpoint ``trainer.step`` with every dp rank's loader state as of the last batch trained on, once its
    state is known finite. Collective."""
    check_finite_state(trainer.model, trainer.optimizer, trainer.step)
    path = trainer.saver.save(
        trainer.checkpoints,
        trainer.step,
        trainer.model,
        trainer.optimizer,
        saver.gather_loader_states(batches, trainer.dims.get_mesh("dp")),
        keep_last=trainer.cfg.checkpoint.keep_last,
        extra={"model_config": model_record(trainer), "first_loss": host_float(trainer.first_loss)},
        local=trainer.out_dir / "checkpoints",
        trainable_only=trainer.converters.trainable_only,
    )
    for line in trainer.converters.saved_lines(path, trainer.model, trainer.cfg):
        print_on_rank0(line)


def run_steps(
    trainer: Trainer,
    batches: DevicePrefetcher,
    logger: MetricsLogger,
    profiler: StepProfiler,
    validate: Callable[[], dict] | None,
    stop: Preemption,
) -> None:
    """Steps until ``trainer.max_steps``, the end of a finite stream or a preemption signal (``stop``, agreed at
    every step boundary). Logs every ``log_every`` steps, validates every ``eval_every`` (the kind may also decode:
    a SALM every ``model.speech.eval_every``), saves every ``checkpoint.interval`` steps before the last; the last
    step always logs and validates."""
    cfg = trainer.cfg
    if trainer.kind.config.has_llm:  # a SALM's: the LLM's matmuls only
        flops = {
            "flops_per_token": flops_per_token(trainer.hf_config, cfg.data.seq_len or 0),
            "matmul_flops_per_token": matmul_flops_per_token(trainer.hf_config),
            "flops_per_pair": attention_flops_per_pair(trainer.hf_config),
        }
    else:  # no LLM to count the FLOPs of (a CTC stage): no MFU figures
        flops = {"flops_per_token": 0.0}
    window = ThroughputWindow(
        batches.waits, trainer.step, peak=peak_flops(trainer.device), world=dist.get_world_size(), **flops
    )
    clock = ComputeClock(trainer.device)
    records = DeferredRecords(trainer.device, trainer.guard.checked(logger.log))
    try:
        loop_steps(trainer, batches, logger, profiler, validate, window, clock, records, stop)
    finally:
        records.flush()


def loop_steps(
    trainer: Trainer,
    batches: DevicePrefetcher,
    logger: MetricsLogger,
    profiler: StepProfiler,
    validate: Callable[[], dict] | None,
    window: ThroughputWindow,
    clock: ComputeClock,
    records: DeferredRecords,
    stop: Preemption,
) -> None:
    """``run_steps``'s loop (see there)."""
    cfg = trainer.cfg
    max_steps = cfg.trainer.max_steps
    inputs = trainer.guard.watch(window.stages.watch(even_if_finite(batches, cfg)))
    trainer.clock = WallClock(cfg.trainer.max_minutes, trainer.device)
    last = False
    while not last and trainer.step < max_steps:
        if stop.agreed(trainer.step):  # the step boundary: every rank stops here, saves and exits (train)
            print_on_rank0(f"{stop.reason()} received: stopping after step {trainer.step} to save")
            return
        try:
            micro = next_micro_batches(inputs, cfg.trainer.grad_accum)
        except StopIteration:  # a finite stream (data.epochs) ended: stop here, still save and export
            print_on_rank0(f"data exhausted after step {trainer.step}")
            return
        trainer.saver.raise_if_failed()  # a background save that failed stops the run at the next step
        trainer.step += 1
        with clock.step():
            stats = take_step(trainer, micro, profiler)
        trainer.guard.add(trainer.step, stats["skipped"], len(micro))
        window.add(micro, trainer.dims.dp * trainer.dims.cp)
        step = trainer.step
        last = step == max_steps or trainer.clock.out_of_time()
        if last and step < max_steps:
            print_on_rank0(f"trainer.max_minutes {cfg.trainer.max_minutes:g} spent: step {step} is the last")
        if step % cfg.trainer.log_every == 0 or last:
            pairs = sum_over_dp(window.attention_pairs, trainer.dims.dp)
            throughput, step_time = window.figures(step, pairs)
            if window.skipped_conversations is not None:  # every rank reads the same datasets: all or none call
                throughput["skipped_conversations"] = round(sum_over_dp(window.skipped_conversations, trainer.dims.dp))
            record = step_record(trainer, stats, micro, throughput, step_time, clock.window_mean())
            records.push(record | trainer.guard.window_figures(step))
            window.restart(step)
            if trainer.first_loss is None:
                trainer.first_loss = stats["loss"]
        if trainer.kind.decode is not None:
            decoded = trainer.kind.decode(trainer.model, cfg, step)  # rank 0: the WER, and the hypotheses' file
            if decoded:
                logger.log_decoded(step, decoded)
        if validate is not None and (step % cfg.trainer.eval_every == 0 or last):
            with window.paused():  # validation time is not training throughput
                record = {"step": step, "minutes": trainer.clock.minutes(), **validate()}
            logger.log_val(record)
            if trainer.kind.val_warning is not None and not trainer.warned:
                if line := trainer.kind.val_warning(record, cfg):  # said once a run (a SALM not listening)
                    print_on_rank0(line)
                    trainer.warned = True
        if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0 and not last:
            if not trainer.guard.ready_to_save():  # the newest checkpoint stays the last good one
                print_on_rank0(
                    f"checkpoint of step {step} not written: its last {trainer.guard.run_read} step(s) were skipped "
                    "(non-finite); the next interval saves"
                )
            else:
                with window.paused():  # checkpoint time is not training throughput
                    save_checkpoint(trainer, batches)


def save_final_checkpoint(trainer: Trainer, batches: DevicePrefetcher, always: bool = False) -> None:
    """``checkpoint.save_final`` (or ``always``: a preempted run's): the last step's checkpoint, unless the interval
    already wrote it; returns once every save is written."""
    trainer.saver.wait(say=True)
    folder = trainer.checkpoints
    saved_already = layout.latest(folder) == layout.checkpoint_dir(folder, trainer.step)
    if (trainer.cfg.checkpoint.save_final or always) and trainer.step > 0 and not saved_already:
        save_checkpoint(trainer, batches)
        trainer.saver.wait()


EXPORT_MARK = "headrace_export.json"  # in hf/: the step and options it was exported with


def export_model(trainer: Trainer) -> None:
    """The kind's export: the consolidated ``hf/`` of the model (and a SALM's other parts), said on rank 0;
    skipped when ``hf/`` already holds this step with these options (a finished run started again). Collective."""
    cfg = trainer.cfg
    if not cfg.checkpoint.export_hf:
        return
    out = trainer.out_dir / "hf"
    mark = {
        "step": trainer.step,
        "experts_layout": cfg.checkpoint.export_hf_experts,
        "shard_size_mb": cfg.checkpoint.export_shard_size_mb,
    }
    current = [None]
    if dist.get_rank() == 0 and (out / EXPORT_MARK).is_file():
        try:
            current[0] = json.loads((out / EXPORT_MARK).read_text()) == mark
        except ValueError:  # a damaged mark: export again
            current[0] = False
    dist.broadcast_object_list(current, src=0)
    if current[0]:
        print_on_rank0(f"{out} already holds step {trainer.step}: export skipped")
        return
    print_on_rank0(f"exporting step {trainer.step} to {out} ...")
    start = time.perf_counter()
    with export.export_errors(out):
        trainer.kind.export(trainer.model, trainer.hf_config, cfg, trainer.out_dir)
        trainer.converters.export(trainer.model, cfg, trainer.out_dir)  # beside the kind's: the converters' own files
    if dist.get_rank() == 0 and out.is_dir():
        (out / EXPORT_MARK).write_text(json.dumps(mark))
        if store.is_url(trainer.checkpoints):  # checkpoint.folder on object storage: hf/ goes there too
            store.upload_tree(out, store.join(str(trainer.checkpoints), "hf"), last=EXPORT_MARK)
    print_on_rank0(f"exported {out} in {time.perf_counter() - start:.1f} s")


def train(cfg: JobConfig, make_loader: Callable[[int, int], Iterable] | None = None) -> list[dict]:
    """Run the job described by ``cfg``; returns the logged metric records (global figures, on every rank).

    ``make_loader(dp_rank, dp_size)`` (an iterable of batch dicts with ``state_dict`` / ``load_state_dict``)
    replaces ``headrace.dataio.build_loader(cfg.data, dp_rank, dp_size)``; tests use it to feed hand-made batches.
    A preemption signal (``trainer.preemption``) ends it with a checkpoint and ``Preempted`` (a ``SystemExit``).
    """
    stop = Preemption(cfg.trainer.preemption)
    try:
        return run_job(cfg, make_loader, stop)
    finally:
        stop.release()


def run_job(cfg: JobConfig, make_loader: Callable[[int, int], Iterable] | None, stop: Preemption) -> list[dict]:
    """``train``'s body; ``stop`` is installed before the loader starts (its workers fork with the handlers)."""
    check_job(cfg)  # every input rule, before any process group work (ConfigError: one line from rank 0)
    dims = ParallelDims.from_config(cfg.distributed, world_size())  # the degrees' rules
    cfg = model_kind(cfg).prepare_job(cfg)  # a SALM on a Qwen2-Audio / Voxtral checkpoint: its parts, prompt, tokenizer
    device = pick_device(cfg.trainer.device)
    init_distributed(device.type)
    cfg = with_model_layout(cfg)
    set_up_meshes(dims, device)
    held = lock_output_dir(Path(cfg.trainer.output_dir))  # rank 0 holds it until the job ends
    save_job_config(cfg)
    trainer = build_trainer(cfg, device, dims)
    stop.install()
    loader = build_train_loader(trainer, make_loader)
    torch.manual_seed(rank_seed(cfg.trainer.seed, dims.get_mesh("dp").get_local_rank()))
    resume(trainer, loader)  # a resumed run restores its RNG too
    allocate_save_buffers(
        trainer.saver, trainer.model, trainer.optimizer, trainer.converters.trainable_only
    )  # off the step
    validate = make_validator(cfg, dims, device, trainer.model, trainer.pipe) if cfg.trainer.eval_every else None
    logger = build_metrics_logger(cfg, dist.get_rank())
    profiler = StepProfiler(cfg.trainer.profile, trainer.out_dir, dist.get_rank(), device)
    batches = DevicePrefetcher(loader, device, transform=step_batch_transform(dims, device.type))

    run_steps(trainer, batches, logger, profiler, validate, stop)

    batches.close()
    profiler.close()
    if stop.stopped_at is not None:  # preempted: the checkpoint of this step, then the stated exit code
        start = time.perf_counter()
        save_final_checkpoint(trainer, batches, always=True)
        print_on_rank0(
            f"preempted: step {trainer.step} saved in {time.perf_counter() - start:.2f} s; "
            f"exit code {cfg.trainer.preemption.exit_code}"
        )
        logger.close()
        if held is not None:
            held.close()
        raise stop.exit()
    save_final_checkpoint(trainer, batches)
    export_model(trainer)
    logger.summary(first_loss=host_float(trainer.first_loss))
    logger.close()
    if held is not None:
        held.close()
    return logger.history


__all__ = ["Trainer", "build_trainer", "train"]
