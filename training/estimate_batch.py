"""Per-bucket batch sizes for 2D-bucketed SALM training (OOMptimizer-style).

    python -m headrace.training.estimate_batch --config configs/speech_demo.yaml --budget-gib 8 [--out table.yaml]

For each 2D bucket (``data.bucketing.bucket_duration_bins``, or the grid ``estimate_2d_bins`` derives
from the dataset's index), a synthetic batch at the bucket's limits (audio of its longest duration,
transcripts of its most tokens) runs forward + backward through the real model on this device, and the
largest batch size whose memory stays within ``--budget-gib`` is the bucket's:

- on CUDA, "memory" is peak allocated memory (weights, gradients, activations; an out-of-memory error
  counts as not fitting), searched by doubling then bisecting the batch size: about ``2 * log2(largest)``
  forward + backward passes per bucket, each allocating at most the budget;
- on CPU, where there is no memory pressure to measure, it is the bytes of tensors autograd saves for
  backward (``saved_tensors_hooks``), a stand-in that grows with batch size the way activation memory
  does. For a fixed row shape those bytes are affine in the batch size (``a + b * B``: every saved tensor
  is a per-row activation or a weight), so they are measured at batch 1 and 2 only and the largest fitting
  batch is solved for: two passes per bucket, and the process never holds more than the batch-2 step
  (the budget itself is never allocated). Batch 2 is measured only when twice batch 1's bytes fit
  (``a >= 0`` bounds it), else the answer is 1.

Safety: the budget must not exceed this device's free memory (CUDA: ``torch.cuda.mem_get_info``; CPU:
the machine's available memory), else a one-line refusal (exit 2). One progress line per bucket on
stderr. ``--time-limit`` seconds (checked between buckets): past it the table is printed with ``null``
for the buckets not measured (so it cannot be pasted into a config unnoticed) and the exit status is 3.
The single-process model is measured (FSDP2 would hold less of the weights per rank, so the table is
conservative there).

Output: YAML with ``bucket_duration_bins`` and ``bucket_batch_size`` to paste into ``data.bucketing``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import yaml

from headrace.dataio.batching.bucketing import estimate_2d_bins
from headrace.dataio.loader import open_source
from headrace.dataio.usererror import EXIT_USER_ERROR, debug_requested, is_user_error, one_line
from headrace.training.components.data import open_data
from headrace.training.config.load import load_job_config
from headrace.training.config.validate import check_data_paths
from headrace.training.distributed.process_group import pick_device
from headrace.training.model_kinds import model_kind
from headrace.training.speech.job import SALM_INPUTS
from headrace.training.speech.prompt import build_batch


def largest_fitting(fits: Callable[[int], bool], limit: int = 4096) -> int:
    """The largest ``b`` in ``[1, limit]`` with ``fits(b)`` (assumed monotone); 0 if even 1 does not fit."""
    if not fits(1):
        return 0
    good = 1
    while good < limit and fits(min(2 * good, limit)):
        good = min(2 * good, limit)
    bad = min(2 * good, limit + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def saved_activation_bytes(step: Callable[[], torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves while ``step()`` builds its graph (then runs its backward)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return total


def synthetic_step(model, speech_batches, seconds: float, tokens: int, batch_size: int) -> Callable[[], torch.Tensor]:
    """Forward of a batch at a bucket's limits: noise audio of ``seconds``, answers of ``tokens`` tokens."""
    device = next(model.parameters()).device
    samples = int(seconds * model.cfg.sample_rate)
    audio = torch.randn(batch_size, samples, generator=torch.Generator().manual_seed(0)) * 0.1
    lens = torch.full((batch_size,), samples)
    answers = [[speech_batches.template.eos_id] * max(int(tokens) - 1, 0)] * batch_size
    batch = {
        "audio": audio,
        "audio_lens": lens,
        **build_batch(speech_batches.template, model.audio_slots(lens), answers),
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    return lambda: model(**{k: batch[k] for k in SALM_INPUTS})


def fits_budget(
    model, step_at: Callable[[int], Callable[[], torch.Tensor]], budget_bytes: int
) -> Callable[[int], bool]:
    """``fits(batch_size)`` on CUDA: peak allocated memory of forward + backward within the budget."""

    def fits(batch_size: int) -> bool:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            step_at(batch_size)().backward()
        except torch.OutOfMemoryError:
            return False
        finally:
            model.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated() <= budget_bytes

    return fits


def largest_by_saved_bytes(
    model, step_at: Callable[[int], Callable[[], torch.Tensor]], budget_bytes: int, limit: int
) -> int:
    """The CPU answer: saved-for-backward bytes measured at batch 1 and 2, solved for the largest batch
    within the budget (module docstring)."""

    def cost(batch_size: int) -> int:
        try:
            return saved_activation_bytes(step_at(batch_size))
        finally:
            model.zero_grad(set_to_none=True)

    one = cost(1)
    if one > budget_bytes:
        return 0
    if 2 * one > budget_bytes:
        return 1
    per_row = max(cost(2) - one, 1)
    return int(min(limit, 1 + (budget_bytes - one) // per_row))


def estimate_table(
    model,
    speech_batches,
    bins: np.ndarray,
    budget_bytes: int,
    limit: int = 4096,
    *,
    deadline: float = float("inf"),
    progress: Callable[[str], None] = lambda line: None,
) -> list:
    """The largest fitting batch per ``[seconds, tokens]`` bin; ``None`` for the bins not reached before
    ``deadline`` (``time.monotonic()``)."""
    on_cuda = next(model.parameters()).is_cuda
    sizes: list[int | None] = []
    for i, (seconds, tokens) in enumerate(bins.tolist()):
        if time.monotonic() > deadline:
            sizes.append(None)
            continue
        started = time.monotonic()
        step_at = lambda b, s=seconds, t=tokens: synthetic_step(model, speech_batches, s, t, b)  # noqa: E731
        if on_cuda:
            size = largest_fitting(fits_budget(model, step_at, budget_bytes), limit)
        else:
            size = largest_by_saved_bytes(model, step_at, budget_bytes, limit)
        sizes.append(size)
        progress(
            f"bucket {i + 1}/{len(bins)} [{seconds:g} s, {int(tokens)} tokens]: batch size {size} "
            f"({time.monotonic() - started:.1f} s)"
        )
    return sizes


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of the device the estimate runs on: the GPU's, or this machine's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m headrace.training.estimate_batch", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", required=True, help="a model.kind: salm job YAML")
    parser.add_argument("--budget-gib", type=float, required=True, help="memory budget per device (GiB)")
    parser.add_argument("--limit", type=int, default=4096, help="largest batch size tried")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=240.0,
        help="seconds; past it the buckets not measured are printed as null (exit status 3)",
    )
    parser.add_argument("--out", default=None, help="write the YAML table here (default: print it)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the job config")
    args = parser.parse_args(argv)
    try:
        return estimate(args)
    except Exception as e:  # the trainer's rule: the user's errors in one line, exit 2; bugs keep their traceback
        if not is_user_error(e) or debug_requested():
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR


def estimate(args: argparse.Namespace) -> int:
    """``main`` once the arguments are parsed (its exit status)."""
    cfg = load_job_config(args.config, args.overrides)
    kind = model_kind(cfg)
    if kind.batch_probe is None:
        print(
            f"error: headrace.training.estimate_batch sizes bucketed audio batches: model.kind {kind.name} has "
            "none (e.g. model.kind: salm)",
            file=sys.stderr,
        )
        return 2
    cfg = kind.prepare_job(cfg)
    bucketing = cfg.data.bucketing
    if bucketing.bucket_duration_bins:
        bins = np.asarray(bucketing.bucket_duration_bins, dtype=np.float64)
    else:
        check_data_paths(cfg.data)
        source = open_data("data", lambda: open_source(cfg.data.datasets[0]))
        samples = source.index.samples
        bins = estimate_2d_bins(
            np.asarray(samples["duration"], np.float64),
            np.asarray(samples["tokens"], np.float64),
            bucketing.num_buckets,
            max(bucketing.num_token_buckets, 2),
        )
    device = pick_device(cfg.trainer.device)
    budget = int(args.budget_gib * 2**30)
    if budget > (free := free_memory_bytes(device)):
        print(
            f"error: --budget-gib {args.budget_gib:g} exceeds the free memory of {device.type} "
            f"({free / 2**30:.1f} GiB); give at most that",
            file=sys.stderr,
        )
        return 2
    deadline = time.monotonic() + args.time_limit
    model, speech = kind.batch_probe(cfg, device)
    print(
        f"estimating {len(bins)} buckets on {device.type} within {args.budget_gib:g} GiB "
        f"(time limit {args.time_limit:g} s)",
        file=sys.stderr,
        flush=True,
    )
    sizes = estimate_table(
        model,
        speech,
        bins,
        budget,
        args.limit,
        deadline=deadline,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    table = yaml.safe_dump(
        {"bucket_duration_bins": [[round(d, 3), int(t)] for d, t in bins.tolist()], "bucket_batch_size": sizes},
        default_flow_style=None,
        sort_keys=False,
    )
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    print(table, end="")
    if None in sizes:
        print(
            f"estimate_batch: time limit {args.time_limit:g} s reached: {sizes.count(None)} of {len(sizes)} "
            "buckets not measured (null); raise --time-limit for all",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
