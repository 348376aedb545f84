"""Validation: loss and perplexity of the model over the whole ``data.val`` stream, on every rank at once.

The val stream is the ``data:`` section with ``data.val``'s keys laid over it (typically
``datasets: [{path: ..., split: val}]``) and ``epochs: 1``: any dataset the loader reads, batched and
packed like the training data (a SALM's audio batches get its prompt + transcript layout, as in training).
The loader's layout (``headrace.dataio.stream.ordering.split``) gives DP rank ``r`` the global positions ``r, r + dp, ...``,
so across DP ranks every val sample is read exactly once; TP/CP/PP peers read the same batches. At the
tail the ranks that ran out run loss-free copies of their last batch (``headrace.dataio.feed.even``: the ranks
agree between batches, in the loop's thread; a rank's padding sample flagged ``__valid__ = False`` has its
labels masked here) so every rank runs the same number of forwards (FSDP2's collectives) and padding adds
nothing.

Per batch, one forward without autograd, by layout:
- plain / TP / FSDP2 / SALM: the step's forward (the model kind's ``step_forward``: the chunked loss of
  ``CausalLMLoss``, so no ``[tokens, vocab]`` logits; a SALM's answer-token loss);
- context parallel: the batch goes through the trainer's ``cp_batch_transform`` (this rank's head-tail
  chunks) and attention runs over the cp group; each rank sums its own tokens' losses;
- pipeline parallel: val rows are regrouped into the training step's row count and run forward-only by
  the training schedule (``schedule.eval``: the same microbatches and stages, no backward); the last
  stage returns each microbatch's summed loss. The rows left at the end are padded with loss-free rows,
  and a dp rank that ran fewer schedule calls adds loss-free ones (one all-reduce of the count).
Then one all-reduce of (loss sum, labelled tokens) over the loss mesh (dp x cp; under PP the loss sum is
also summed over pp, where only the last stage holds it) and one of the document count over dp, so every
rank returns the same figures. ``loss = sum / tokens``, ``ppl = exp(loss)``: a single process's figure
over the same samples. A SALM adds a second pass with each utterance's audio swapped for another's
(``val_mismatched_loss``, ``val_listening_ratio``: ``headrace.training.speech.listening``). Cost: one forward of the
val set per ``eval_every`` steps (two for a SALM).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from headrace.dataio.feed.even import even_batches, loss_free
from headrace.dataio.feed.prefetch import DevicePrefetcher
from headrace.dataio.loader import build_loader
from headrace.kernels.loss import IGNORE_INDEX
from headrace.training.config.job_config import val_data_config
from headrace.training.components.data import open_data
from headrace.training.components.labels import labelled_tokens, mask_invalid_rows
from headrace.training.config.validate import check_data_paths, check_validation
from headrace.training.distributed.context_parallel import rank_batch_transform
from headrace.training.distributed.process_group import new_tail_group
from headrace.training.distributed.pipeline import run_schedule
from headrace.training.model_kinds import model_kind
from headrace.training.step import eval_mode, uses_autocast

PIPELINE_INPUTS = ("input_ids", "labels", "position_ids")


def documents_started(batch: dict) -> int:
    """Documents whose first piece is in ``batch`` (a document split over rows or batches counts once); for a
    batch of whole samples (audio), its valid samples."""
    if "__docs__" in batch:
        return sum(offset == 0 for row in batch["__docs__"] for _, offset, _ in row)
    valid = batch.get("__valid__")
    return len(batch["__key__"]) if valid is None else int(torch.as_tensor(valid).sum())


def reduce_figures(loss_sum: torch.Tensor, tokens: int, docs: int, *, loss_group, dp_group, pp_group=None) -> dict:
    """The val figures from this rank's loss sum (fp64 scalar), labelled tokens and documents (module docstring)."""
    if pp_group is not None:
        dist.all_reduce(loss_sum, group=pp_group)  # only the last stage's ranks hold losses
    sums = torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64, device=loss_sum.device)])
    dist.all_reduce(sums, group=loss_group)
    count = torch.tensor([float(docs)], dtype=torch.float64, device=loss_sum.device)
    dist.all_reduce(count, group=dp_group)
    loss = (sums[0] / sums[1].clamp(min=1)).item()
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": int(sums[1]), "val_docs": int(count)}


def val_batches(
    loader: Iterable[dict], device: torch.device, transform: Callable[[dict], dict] | None = None
) -> DevicePrefetcher:
    """``loader`` read ahead in a thread, as in training (``DevicePrefetcher``). On the host, per batch: its
    documents are counted
    (``__val_docs__``), rows flagged invalid lose their labels, then ``transform`` (CP: this rank's chunks),
    whose labelled tokens are counted (``__val_tokens__``: no device-to-host copy in the loop)."""

    def prepare(batch: dict) -> dict:
        docs = documents_started(batch)
        batch = mask_invalid_rows(batch)
        batch = transform(batch) if transform is not None else batch
        return {**batch, "__val_docs__": docs, "__val_tokens__": labelled_tokens(batch)}

    return DevicePrefetcher(loader, device, transform=prepare)


def padding_batch(last: dict) -> dict:
    """A loss-free copy of ``last`` (``headrace.dataio.feed.even``) that counts no token and no document."""
    return {**loss_free(last), "__val_docs__": 0, "__val_tokens__": 0}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loss_sum: Callable[[nn.Module, dict], torch.Tensor],
    batches: Iterable[dict],
    device: torch.device,
    *,
    loss_group=None,
    dp_group=None,
) -> dict:
    """Mean token loss, perplexity, labelled tokens and documents of ``batches`` (this rank's share of the
    val stream from ``val_batches``), reduced over ``loss_group`` (dp x cp) and ``dp_group``. A collective."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = docs = 0
    with eval_mode(model):
        for batch in batches:
            docs += batch["__val_docs__"]
            tokens += batch["__val_tokens__"]
            total += loss_sum(model, {k: v for k, v in batch.items() if not k.startswith("__")}).double()
    return reduce_figures(total, tokens, docs, loss_group=loss_group, dp_group=dp_group)


def loss_free_rows(like: dict, rows: int) -> dict:
    """``rows`` rows shaped like ``like``'s that add no loss: token 0, labels -100, one segment per row."""
    ids, labels, positions = (like[k] for k in PIPELINE_INPUTS)
    seq_len = ids.shape[1]
    return {
        "input_ids": ids.new_zeros(rows, seq_len),
        "labels": labels.new_full((rows, seq_len), IGNORE_INDEX),
        "position_ids": torch.arange(seq_len, dtype=positions.dtype, device=positions.device).expand(rows, -1),
    }


@torch.no_grad()
def evaluate_pipeline(pipe, batches: Iterable[dict], device: torch.device, *, dp_group) -> dict:
    """``evaluate`` through the training schedule's forward-only path (module docstring). A collective over
    the pp and dp groups."""
    step_rows = pipe.n_microbatches * pipe.microbatch_size
    pending: list[dict] = []  # rows not run yet (input_ids, labels, position_ids)
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = docs = calls = 0
    template = None

    def run(rows: dict) -> None:
        nonlocal total, calls
        pipe.loss.scale = 1.0  # the summed loss itself (the train step sets its scale before every step)
        losses = run_schedule(pipe, rows, train=False)
        if losses:
            total += torch.stack(losses).to(torch.float64).sum()
        calls += 1

    def take(n: int) -> dict:
        rows = {k: torch.cat([b[k] for b in pending]) for k in PIPELINE_INPUTS}
        rest = {k: v[n:] for k, v in rows.items()}
        pending[:] = [rest] if len(rest["labels"]) else []
        return {k: v[:n] for k, v in rows.items()}

    with eval_mode(pipe.part):
        for batch in batches:
            docs += batch["__val_docs__"]
            tokens += batch["__val_tokens__"]
            pending.append({k: batch[k] for k in PIPELINE_INPUTS})
            if template is None:
                template = pending[-1]
            while sum(len(b["labels"]) for b in pending) >= step_rows:
                run(take(step_rows))
        if pending:
            left = sum(len(b["labels"]) for b in pending)
            pending.append(loss_free_rows(template, step_rows - left))
            run(take(step_rows))
        most = torch.tensor([calls], device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=dp_group)  # dp ranks run the same number of calls
        if template is None and int(most) > 0:
            raise RuntimeError("validation: this dp rank got no val batch while others did")
        for _ in range(int(most) - calls):
            run(loss_free_rows(template, step_rows))
    return reduce_figures(
        total, tokens, docs, loss_group=dp_group, dp_group=dp_group, pp_group=pipe.pp_mesh.get_group()
    )


def make_validator(cfg, dims, device: torch.device, model: nn.Module, pipe=None) -> Callable[[], dict]:
    """The hook of the trainer and ``headrace.training.eval``: a function that runs one pass over the val stream with
    a fresh loader for this rank's DP index and returns the figures (a collective on every rank)."""
    check_validation(cfg)
    val_cfg = val_data_config(cfg.data)
    dp = dims.get_mesh("dp")

    transform = rank_batch_transform(dims)
    tail_group = new_tail_group()

    def open_loader():
        return open_data("data.val", lambda: build_loader(val_cfg, dp.get_local_rank(), dp.size()))

    check_data_paths(val_cfg, "data.val")
    open_loader()  # its data errors at start-up, not at the first validation

    kind = model_kind(cfg)

    def batches() -> Iterator[dict]:
        raw = open_loader()
        loader = kind.wrap_loader(raw, model, cfg, dims)
        # a rank whose share of the val set is empty (one document, two ranks) runs padding rows, counting nothing
        empty = (
            None
            if kind.empty_val_batch is None
            else lambda: next(iter(val_batches([kind.empty_val_batch(raw)], device, transform)))
        )
        return even_batches(val_batches(loader, device, transform), tail_group, pad=padding_batch, empty=empty)

    if pipe is not None:
        return lambda: evaluate_pipeline(pipe, batches(), device, dp_group=dp.get_group())
    if kind.own_validation is not None:
        return lambda: kind.own_validation(model, batches(), cfg, device, dp.get_group())
    forward = kind.step_forward(cfg, dims)

    def run(forward: Callable) -> dict:
        return evaluate(
            model,
            functools.partial(forward, autocast=uses_autocast(cfg, model)),
            batches(),
            device,
            loss_group=dims.get_mesh("dp_cp").get_group(),
            dp_group=dp.get_group(),
        )

    return lambda: kind.validate(run, forward)  # a SALM adds its mismatched-audio pass


__all__ = ["documents_started", "evaluate", "evaluate_pipeline", "make_validator", "val_batches"]
