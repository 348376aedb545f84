"""``dataio bench --trainer``: the data wait a trainer sees, on the trainer's own data path.

The same objects ``training/train.py`` uses: ``build_loader`` (with the section's packing; a text
section with ``packing: none`` is benchmarked with ``best_fit``, the trainer's usual choice) wrapped in
``headrace.dataio.feed.prefetch.DevicePrefetcher`` on CUDA when there is one (pinned staging, side-stream copies),
else on the CPU. After each batch the "step" sleeps ``step_s`` (a stand-in for forward/backward that
leaves the CPU to the loader, as a GPU step would); the prefetcher's own ``stats()`` give the data
wait: the time spent inside ``next()`` over the wall time since the first request. The first batch
(worker start-up) is reported separately and excluded, as a trainer amortises it over the run.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from headrace.dataio.feed.prefetch import DevicePrefetcher
from headrace.dataio.bench.data import BenchData
from headrace.dataio.bench.measure import ProcessSampler
from headrace.dataio.loader import build_loader


def trainer_run(
    data: BenchData, *, workers: int, step_s: float, max_batches: int | None, max_seconds: float | None
) -> dict:
    cfg = dataclasses.replace(data.cfg, num_workers=workers, epochs=None)
    if data.kind == "text" and cfg.packing == "none":
        cfg = dataclasses.replace(cfg, packing="best_fit")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with ProcessSampler() as sampler:
        start = time.perf_counter()
        batches = DevicePrefetcher(build_loader(cfg, dp_rank=0, dp_size=1), device)
        next(batches)
        first = time.perf_counter() - start
        steady_from, tokens, n = time.perf_counter(), 0, 0
        for batch in batches:  # endless stream: stop on the limits
            n += 1
            ids = batch.get("input_ids")
            tokens += int(ids.numel()) if isinstance(ids, torch.Tensor) else 0
            del batch
            time.sleep(step_s)  # the simulated step
            elapsed = time.perf_counter() - steady_from
            if (max_batches is not None and n >= max_batches) or (max_seconds is not None and elapsed >= max_seconds):
                break
        stats_wait = sum(batches.waits[1:])  # the first batch's wait is start-up, reported above
        elapsed = time.perf_counter() - steady_from
        batches.close()
    return {
        "loader": "headrace (trainer path)",
        "workers": workers,
        "device": device,
        "packing": cfg.packing,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "step_ms": step_s * 1e3,
        "batches": n,
        "first_batch_s": first,
        "data_wait_fraction": stats_wait / elapsed if elapsed > 0 else None,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "peak_rss_mb": sampler.peak_rss / 2**20,
        "cpu_util": sampler.cpu_seconds() / (time.perf_counter() - start),
    }
