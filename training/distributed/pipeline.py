"""Pipeline parallelism: transformers decoders split into stages run by ``torch.distributed.pipelining``.

Split. The decoder blocks are cut into ``num_stages`` contiguous ranges: ``layers_per_stage`` blocks each,
or (default) balanced by parameter count, the embedding counted on the first stage and norm + lm_head on
the last (an exact min-max partition, O(stages x layers^2) on integers). Single-stage schedules (GPipe,
1F1B) run ``pp`` stages, one per rank; multi-stage ones run several per rank ("virtual stages"): looped
placement ``[r, r+pp, ...]`` for Interleaved1F1B / LoopedBFS / InterleavedZeroBubble (2 per rank unless
``layers_per_stage`` says otherwise, ``round_virtual_stages_to_pp_multiple`` rounding a stage count that
is not a multiple of pp), V placement ``[r, 2pp-1-r]`` for ZBVZeroBubble / DualPipeV (exactly 2).

Names. Each rank builds one meta ``CausalLMLoss`` and prunes it to what its stages own (embedding if it
holds stage 0, the blocks of its stages in a ``ModuleDict`` keyed by the original block index, norm and
lm_head if it holds the last stage). That pruned model is the rank's *model part*: its parameter names are
transformers' own (``model.layers.5.mlp...``), so the optimizer, DCP checkpoints (which reshard to any pp,
also pp 1) and the ``hf/`` export see exactly the names of a run without PP. Each pipeline stage is a
``DecoderStage`` that references the part's modules (shared, not copied) and is what TP/SP -> AC ->
compile -> FSDP2 is applied to (``headrace.training.distributed.parallelize``), one FSDP2 root per stage; FSDP2 keeps weights
gathered across microbatches (``pipeline.reshard_after_forward: false``, torchtitan's choice under PP:
resharding would all-gather every weight once per microbatch).

Step. The ``grad_accum`` packed micro-batches of a step are stacked row-wise and the schedule cuts them
into ``rows / pp_microbatch_size`` microbatches. The first stage receives ``input_ids``; every stage
receives ``position_ids`` (each stage derives the microbatch's ``cu_seqlens`` from them for the
``headrace_varlen`` attention: documents restart at position 0 and never span rows, so they equal the
packer's); the last stage receives ``labels`` and returns the summed cross-entropy from the chunked loss
inside its forward (where FSDP2 has unsharded lm_head). The loss scale is the train step's: real tokens
of the global batch counted before the schedule runs, times the dp x cp size (FSDP averages over it).
``scale_grads_in_schedule: true`` lets the schedule divide gradients by the microbatch count and multiplies
each microbatch loss by that count, so both settings train the same model. Gradient clipping sums the
squared norms of every stage over the pp group.

Cost. Bubble (idle over compute, equal F/B/W costs): GPipe / 1F1B ``(pp-1)/m`` for m microbatches,
interleaved / looped ``(pp-1)/(v m)`` with v stages per rank, interleaved zero-bubble ``(pp-1)/(3 v m)``,
ZBV and DualPipeV 0 in that ideal. ``PipelineTimer`` measures each rank's compute time inside the
schedule's forward/backward calls; the rest of the step is measured idle (waits on neighbours).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from headrace.kernels.hf_attention import packed_attention_kwargs
from headrace.training.config.job_config import JobConfig, PipelineConfig
from headrace.training.config.pipeline_schedules import SINGLE_STAGE, V_SHAPED, schedule_class_name
from headrace.training.distributed.parallelize import parallelize
from headrace.training.models.build import build_meta_model, materialize, param_dtype
from headrace.training.models.converters import build_converters
from headrace.training.models.families import LLAMA_LIKE
from headrace.training.models.loss import CausalLMLoss, lm_head_loss_sum

NEEDS_M_GE_STAGES = ("Schedule1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def bubble_theory(class_name: str, pp: int, stages_per_rank: int, n_microbatches: int) -> float:
    """Idle over compute time of the schedule with equal forward / backward-input / backward-weight costs."""
    if class_name in V_SHAPED:
        return 0.0
    ideal = (pp - 1) / (stages_per_rank * n_microbatches)
    return ideal / 3 if class_name == "ScheduleInterleavedZeroBubble" else ideal


def stage_count(cfg: PipelineConfig, class_name: str, pp: int, num_layers: int) -> int:
    """How many stages in all, from the schedule kind and ``layers_per_stage``; ValueError when impossible."""
    if cfg.layers_per_stage is not None:
        if num_layers % cfg.layers_per_stage:
            raise ValueError(
                f"distributed.pipeline.layers_per_stage {cfg.layers_per_stage} does not divide "
                f"num_hidden_layers {num_layers}"
            )
        stages = num_layers // cfg.layers_per_stage
        if stages % pp and class_name not in SINGLE_STAGE + V_SHAPED and cfg.round_virtual_stages_to_pp_multiple:
            up = cfg.round_virtual_stages_to_pp_multiple == "up"
            stages = max(pp, (stages + (pp - 1 if up else 0)) // pp * pp)
    else:
        stages = pp if class_name in SINGLE_STAGE else 2 * pp
    wanted = {
        **dict.fromkeys(SINGLE_STAGE, (pp, "one stage per rank")),
        **dict.fromkeys(V_SHAPED, (2 * pp, "two stages per rank (V)")),
    }.get(class_name)
    if wanted is not None and stages != wanted[0]:
        raise ValueError(
            f"distributed.pipeline: {class_name} runs {wanted[1]}, i.e. {wanted[0]} stages at "
            f"pp_size {pp}, but layers_per_stage {cfg.layers_per_stage} gives {stages}"
        )
    if stages % pp:
        raise ValueError(
            f"distributed.pipeline: {stages} stages ({num_layers} layers / layers_per_stage "
            f"{cfg.layers_per_stage}) is not a multiple of pp_size {pp}; set "
            "round_virtual_stages_to_pp_multiple: up|down or another layers_per_stage"
        )
    if stages > num_layers:
        raise ValueError(
            f"distributed.pipeline: {stages} stages need at least one decoder block each but the "
            f"model has num_hidden_layers {num_layers}"
        )
    return stages


def microbatch_count(rows: int, microbatch_size: int, class_name: str, stages: int) -> int:
    """Microbatches per step (``rows`` = data.batch_size x trainer.grad_accum); ValueError when the schedule
    cannot run them."""
    if rows % microbatch_size:
        raise ValueError(
            f"distributed.pipeline.pp_microbatch_size {microbatch_size} must divide the rows of a "
            f"step, data.batch_size x trainer.grad_accum = {rows}"
        )
    count = rows // microbatch_size
    if class_name in NEEDS_M_GE_STAGES and count < stages:
        raise ValueError(
            f"distributed.pipeline: {class_name} needs at least as many microbatches as stages "
            f"({stages}) but gets {count} (data.batch_size x trainer.grad_accum / pp_microbatch_size "
            f"= {rows} / {microbatch_size}); raise the batch or lower pp_microbatch_size"
        )
    return count


def split_layers(block_params: list[int], head_params: tuple[int, int], stages: int) -> list[range]:
    """Contiguous block ranges, one per stage, minimising the largest stage's parameter count (the first stage
    also carries ``head_params[0]`` (embedding), the last ``head_params[1]`` (norm + lm_head)); among splits
    with that maximum, the one with the smallest sum of squared stage sizes (the most even)."""
    n = len(block_params)
    prefix = [0]
    for p in block_params:
        prefix.append(prefix[-1] + p)

    def weight(stage: int, lo: int, hi: int) -> int:
        return (
            prefix[hi]
            - prefix[lo]
            + (head_params[0] if stage == 0 else 0)
            + (head_params[1] if stage == stages - 1 else 0)
        )

    # best[s][i]: the smallest (max weight, sum of squares) when stages 0..s-1 hold blocks 0..i-1; cut[s][i]
    # the start of stage s-1 in that split
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                w = weight(s - 1, j, i)
                cand = (max(best[s - 1][j][0], w), best[s - 1][j][1] + w * w)
                if cand < best[s][i]:
                    best[s][i], cut[s][i] = cand, j
    bounds, i = [n], n
    for s in range(stages, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def local_stage_ids(class_name: str, pp_rank: int, pp: int, stages: int) -> list[int]:
    """The stages this pp rank runs: V placement for V schedules, looped placement otherwise."""
    if class_name in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, stages, pp))


def prune_to_part(lm: CausalLMLoss, layer_ids: list[int], first: bool, last: bool) -> CausalLMLoss:
    """Drop from ``lm`` (in place) what this rank's stages do not own; block names keep their global index."""
    decoder = lm.model
    decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in layer_ids})
    if not first:
        decoder.embed_tokens = None
    if not last:
        decoder.norm = None
        lm.lm_head = None
    return lm


class DecoderStage(nn.Module):
    """One pipeline stage of a Llama / Qwen2 / Qwen3 decoder, over modules shared with the rank's model part.

    ``forward(x, position_ids=, labels=None)``: ``x`` is ``input_ids`` on the first stage and hidden states
    elsewhere; the last stage returns the summed cross-entropy (``labels`` given) or the logits. Same
    computation as transformers' ``XModel.forward`` (masks from ``create_causal_mask``, RoPE, blocks with
    the packed-attention kwargs), cut at the stage's blocks. Children are named like the HF model's
    (``model.embed_tokens``, ``model.layers.<i>``, ``model.norm``, ``lm_head``) so the TP plan applies as is.
    """

    def __init__(self, part: CausalLMLoss, layer_ids: range, first: bool, last: bool):
        super().__init__()
        decoder = part.model
        self.model = nn.Module()
        self.model.embed_tokens = decoder.embed_tokens if first else None
        self.model.layers = nn.ModuleDict({str(i): decoder.layers[str(i)] for i in layer_ids})
        self.model.norm = decoder.norm if last else None
        self.model.rotary_emb = decoder.rotary_emb
        self.lm_head = part.lm_head if last else None
        self.config = part.config
        self.chunk_size = part.chunk_size
        object.__setattr__(self, "decoder", decoder)  # the HF model: config, sliding-layer flag (not a child)
        object.__setattr__(self, "causal_lm", part.causal_lm)  # for unwrap_causal_lm (HF methods), not a child

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None = None):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        hidden = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        mask_kwargs = dict(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids,
        )
        masks = {"full_attention": create_causal_mask(**mask_kwargs)}
        if getattr(self.decoder, "has_sliding_layers", False):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        layer_types = getattr(self.config, "layer_types", None)
        attn_kwargs = packed_attention_kwargs({"position_ids": position_ids})
        position_embeddings = self.model.rotary_emb(hidden, position_ids=position_ids)
        for name, block in self.model.layers.items():
            kind = layer_types[int(name)] if layer_types else "full_attention"
            hidden = block(
                hidden,
                attention_mask=masks[kind],
                position_embeddings=position_embeddings,
                use_cache=False,
                **attn_kwargs,
            )
        if self.lm_head is None:
            return hidden
        hidden = self.model.norm(hidden)
        return (
            self.lm_head(hidden) if labels is None else lm_head_loss_sum(self.lm_head, hidden, labels, self.chunk_size)
        )


class ScaledLoss:
    """The schedule's ``loss_fn``: the last stage already returns the summed loss (see ``DecoderStage``);
    this returns it times the step's scale, the tensor the schedule backpropagates. (The schedule's first
    step also calls it on a warm-up forward, so the step reads the per-microbatch ``losses`` it returns.)"""

    def __init__(self):
        self.scale = 1.0

    def __call__(self, loss_sum: torch.Tensor, _labels: torch.Tensor) -> torch.Tensor:
        return loss_sum * self.scale


class PipelineTimer:
    """Compute time of this rank's stages inside ``schedule.step``: wraps the stage methods the schedules
    call (forward, backward, backward-weight). On CUDA each timed call synchronizes first, so the figure is
    device time, at the cost of the overlap the sync prevents (only while timing is on)."""

    def __init__(self, stages: list[PipelineStage], device: torch.device):
        self.busy, self.device = 0.0, device
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name)))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, fn):
        def run(*args, **kwargs):
            self._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.busy += time.perf_counter() - start

        return run


@dataclass(kw_only=True)
class Pipeline:
    """This rank's share of the pipeline: the model part (HF names), its stages and the schedule."""

    part: nn.Module
    stages: list[PipelineStage]
    stage_ranges: list[range]  # blocks of every stage (all ranks)
    schedule: object
    class_name: str
    n_microbatches: int
    microbatch_size: int  # rows per microbatch (a step runs n_microbatches x microbatch_size rows)
    scale_grads_in_schedule: bool
    loss: ScaledLoss
    timer: PipelineTimer
    pp_mesh: DeviceMesh
    stats: dict = field(default_factory=dict)

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    @property
    def bubble_theory(self) -> float:
        return bubble_theory(self.class_name, self.pp_mesh.size(), len(self.stages), self.n_microbatches)


def build_pipeline(cfg: JobConfig, dims, device: torch.device, hf_config) -> Pipeline:
    """Split on the meta device, parallelize every stage (TP/SP, AC, compile, FSDP2), materialize this rank's
    part (init or ``model.pretrained_path``), build the schedule."""
    pcfg = cfg.distributed.pipeline
    class_name = schedule_class_name(pcfg.pp_schedule)
    if hf_config.model_type not in LLAMA_LIKE:  # the decoders whose forward DecoderStage reproduces
        raise ValueError(
            f"pp_size > 1: model_type {hf_config.model_type!r} has no pipeline split rule "
            f"(supported: {', '.join(LLAMA_LIKE)})"
        )
    if getattr(hf_config, "tie_word_embeddings", False):
        raise ValueError(
            "pp_size > 1 with tie_word_embeddings=true is not supported (embedding and lm_head live "
            "on different stages); set model.config.tie_word_embeddings=false"
        )
    pp, pp_rank = dims.pp, dims.get_mesh("pp").get_local_rank()
    num_layers = hf_config.num_hidden_layers
    total = stage_count(pcfg, class_name, pp, num_layers)
    n_micro = microbatch_count(cfg.data.batch_size * cfg.trainer.grad_accum, pcfg.pp_microbatch_size, class_name, total)

    full = CausalLMLoss(build_meta_model(hf_config))
    converters = build_converters(cfg)
    converters.convert(full, device)
    blocks = [sum(p.numel() for p in block.parameters()) for block in full.model.layers]
    heads = (
        full.model.embed_tokens.weight.numel(),
        sum(p.numel() for p in full.model.norm.parameters()) + full.lm_head.weight.numel(),
    )
    ranges = (
        [range(s * pcfg.layers_per_stage, (s + 1) * pcfg.layers_per_stage) for s in range(total)]
        if pcfg.layers_per_stage is not None and total * pcfg.layers_per_stage == num_layers
        else split_layers(blocks, heads, total)
    )
    mine = local_stage_ids(class_name, pp_rank, pp, total)
    part = prune_to_part(full, [i for s in sorted(mine) for i in ranges[s]], 0 in mine, total - 1 in mine)
    stage_cfg = replace(cfg.distributed, reshard_after_forward=pcfg.reshard_after_forward)
    modules = [
        parallelize(
            DecoderStage(part, ranges[s], s == 0, s == total - 1),
            dims,
            stage_cfg,
            param_dtype(cfg.trainer.precision),
            after_tp=converters.after_tp(lambda m: {"llm": m}),
        )
        for s in mine
    ]
    materialize(part, device, cfg.model.pretrained_path, offload=cfg.distributed.offload_policy == "cpu")
    converters.after_materialize({"llm": part})
    group = dims.get_mesh("pp").get_group()
    stages = [PipelineStage(module, s, total, device, group=group) for s, module in zip(mine, modules)]
    loss = ScaledLoss()
    cls = getattr(torch_schedules, class_name)
    schedule = cls(
        stages[0] if class_name in SINGLE_STAGE else stages,
        n_microbatches=n_micro,
        loss_fn=loss,
        scale_grads=pcfg.scale_grads_in_schedule,
    )
    if dist.get_rank() == 0:
        blocks_text = ", ".join(f"{r.start}-{r.stop - 1}" for r in ranges)
        print(
            f"pipeline {class_name}: {total} stages over pp {pp} (blocks {blocks_text}), {n_micro} microbatches "
            f"of {pcfg.pp_microbatch_size} rows, theoretical bubble "
            f"{bubble_theory(class_name, pp, len(mine), n_micro):.3f}",
            flush=True,
        )
    return Pipeline(
        part=part,
        stages=stages,
        stage_ranges=ranges,
        schedule=schedule,
        class_name=class_name,
        n_microbatches=n_micro,
        microbatch_size=pcfg.pp_microbatch_size,
        scale_grads_in_schedule=pcfg.scale_grads_in_schedule,
        loss=loss,
        timer=PipelineTimer(stages, device),
        pp_mesh=dims.get_mesh("pp"),
    )


def run_schedule(pipe: Pipeline, rows: dict, *, train: bool) -> list[torch.Tensor]:
    """One call of ``pipe``'s schedule over ``rows`` (``input_ids``, ``labels``, ``position_ids``): with backward
    (``train``, the step) or forward only (validation). The first stage takes the ids, the last the labels;
    returns the last stage's per-microbatch losses ([] on other ranks)."""
    args = (rows["input_ids"],) if pipe.has_first else ()
    kwargs = {"position_ids": rows["position_ids"]}
    target, losses = None, []
    if pipe.has_last:
        kwargs["labels"] = target = rows["labels"]
    run = pipe.schedule.step if train else pipe.schedule.eval
    run(*args, target=target, losses=losses, return_outputs=False, **kwargs)
    return losses


def pipeline_metrics(pipe: Pipeline, max_mem_gib: float) -> dict:
    """Per-stage figures of the last step, gathered over the pp group (a collective on it): compute seconds,
    measured bubble (idle / compute, comparable with ``pp_bubble_theory``), idle fraction, peak memory."""
    mine = dict(pipe.stats, mem=max_mem_gib)
    everyone: list = [None] * pipe.pp_mesh.size()
    dist.all_gather_object(everyone, mine, group=pipe.pp_mesh.get_group())
    idle = [max(0.0, r["step_s"] - r["busy_s"]) for r in everyone]
    return {
        "pp_bubble_theory": pipe.bubble_theory,
        "pp_bubble_measured": sum(i / max(r["busy_s"], 1e-9) for i, r in zip(idle, everyone)) / len(everyone),
        "pp_idle_frac": sum(i / r["step_s"] for i, r in zip(idle, everyone)) / len(everyone),
        "pp_stage_compute_s": [r["busy_s"] for r in everyone],
        "pp_stage_max_mem": [r["mem"] for r in everyone],
    }


__all__ = [
    "DecoderStage",
    "Pipeline",
    "bubble_theory",
    "build_pipeline",
    "local_stage_ids",
    "microbatch_count",
    "pipeline_metrics",
    "run_schedule",
    "split_layers",
    "stage_count",
]
