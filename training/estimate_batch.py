"""Per-bucket batch sizes for 2D-bucketed SALM training (OOMptimizer-style).

    python -m training.estimate_batch --config configs/speech_demo.yaml --budget-gib 60 [--out table.yaml]

For each 2D bucket (``data.bucketing.bucket_duration_bins``, or the grid ``estimate_2d_bins`` derives
from the dataset's index), a synthetic batch at the bucket's limits (audio of its longest duration,
transcripts of its most tokens) runs forward + backward through the real model on this device at
growing batch sizes -- doubling until it no longer fits, then bisecting -- and the largest size that
fits is the bucket's. "Fits" is: on CUDA, peak allocated memory (weights, gradients, activations;
an out-of-memory error counts as not fitting) within ``--budget-gib``; on CPU, where there is no memory
pressure to measure, the bytes of tensors autograd saves for backward (``saved_tensors_hooks``) within
the budget, a stand-in that grows with batch size the way activation memory does. The single-process
model is measured (FSDP2 would hold less of the weights per rank, so the table is conservative there).

Output: YAML with ``bucket_duration_bins`` and ``bucket_batch_size`` to paste into ``data.bucketing``.
Cost: about ``2 * log2(largest batch)`` forward + backward passes per bucket.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import numpy as np
import torch


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
    from training.speech.job import SALM_INPUTS
    from training.speech.prompt import build_batch

    device = next(model.parameters()).device
    samples = int(seconds * model.cfg.sample_rate)
    audio = torch.randn(batch_size, samples, generator=torch.Generator().manual_seed(0)) * 0.1
    lens = torch.full((batch_size,), samples)
    answers = [[speech_batches.template.eos_id] * max(int(tokens) - 1, 0)] * batch_size
    batch = {"audio": audio, "audio_lens": lens,
             **build_batch(speech_batches.template, model.audio_slots(lens), answers)}
    batch = {k: v.to(device) for k, v in batch.items()}
    return lambda: model(**{k: batch[k] for k in SALM_INPUTS})


def fits_budget(model, step_at: Callable[[int], Callable[[], torch.Tensor]], budget_bytes: int) -> Callable[[int], bool]:
    """``fits(batch_size)`` for this device (see the module docstring)."""
    def fits(batch_size: int) -> bool:
        model.zero_grad(set_to_none=True)
        if torch.cuda.is_available() and next(model.parameters()).is_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                step_at(batch_size)().backward()
            except torch.OutOfMemoryError:
                return False
            finally:
                model.zero_grad(set_to_none=True)
            return torch.cuda.max_memory_allocated() <= budget_bytes
        return saved_activation_bytes(step_at(batch_size)) <= budget_bytes

    return fits


def estimate_table(model, speech_batches, bins: np.ndarray, budget_bytes: int, limit: int = 4096) -> list[int]:
    """The largest fitting batch per ``[seconds, tokens]`` bin."""
    sizes = []
    for seconds, tokens in bins.tolist():
        fits = fits_budget(model, lambda b: synthetic_step(model, speech_batches, seconds, tokens, b), budget_bytes)
        sizes.append(largest_fitting(fits, limit))
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.estimate_batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a model.kind: salm job YAML")
    parser.add_argument("--budget-gib", type=float, required=True, help="memory budget per device (GiB)")
    parser.add_argument("--limit", type=int, default=4096, help="largest batch size tried")
    parser.add_argument("--out", default=None, help="write the YAML table here (default: print it)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the job config")
    args = parser.parse_args(argv)
    import yaml

    from dataio.batching.bucketing import estimate_2d_bins
    from dataio.loader import open_source
    from training.config.load import load_job_config
    from training.models.build import build_hf_config
    from training.speech.job import SpeechBatches
    from training.speech.model import build_meta_salm, materialize_salm
    from training.distributed.process_group import pick_device

    cfg = load_job_config(args.config, args.overrides)
    if cfg.model.kind != "salm":
        print("error: training.estimate_batch needs a model.kind: salm job", file=sys.stderr)
        return 2
    bucketing = cfg.data.bucketing
    if bucketing.bucket_duration_bins:
        bins = np.asarray(bucketing.bucket_duration_bins, dtype=np.float64)
    else:
        source = open_source(cfg.data.datasets[0])
        samples = source.index.samples
        bins = estimate_2d_bins(np.asarray(samples["duration"], np.float64), np.asarray(samples["tokens"], np.float64),
                                bucketing.num_buckets, max(bucketing.num_token_buckets, 2))
    device = pick_device(cfg.trainer.device)
    model = build_meta_salm(build_hf_config(cfg.model), cfg.model.speech)
    materialize_salm(model, device, cfg.model.pretrained_path)
    speech = SpeechBatches([], model, cfg.model.speech, cfg.model.tokenizer)
    sizes = estimate_table(model, speech, bins, int(args.budget_gib * 2**30), args.limit)
    table = yaml.safe_dump({"bucket_duration_bins": [[round(d, 3), int(t)] for d, t in bins.tolist()],
                            "bucket_batch_size": sizes}, default_flow_style=None, sort_keys=False)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
