"""SALM training throughput, one process: 1D (duration) vs 2D (duration x transcript tokens) bucketing.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench_speech.py --config configs/speech_demo.yaml --steps 20

Both runs train the same model (the config's SALM, same seed, one process, fp32) on the same shards for
the same number of steps; only ``data.bucketing`` differs: ``1d`` = ``num_buckets`` duration bins cut by
``max_duration``; ``2d`` = the config's 2D grid cut by ``max_duration`` and ``max_tokens``. For each it
prints utterances/s and audio-seconds/s of training (steady state: the first ``--warmup`` steps are
excluded), the data-wait fraction (time spent in ``next()`` on the prefetcher), and the padding
fractions of the batches trained on: audio samples (``1 - sum(lengths) / (B * longest)``) and LLM
tokens (positions without a real prompt/audio/answer token over the padded ``[B, L]``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def run(cfg, steps: int, warmup: int) -> dict:
    from headrace.dataio import build_loader
    from headrace.dataio.feed.prefetch import DevicePrefetcher
    from headrace.training.components.optim import build_optimizer
    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.speech.job import build_salm, salm_loss_sum, wrap_loader
    from headrace.training.distributed.process_group import init_distributed
    from headrace.training.step import train_step

    init_distributed("cpu")
    dims = ParallelDims.from_config(cfg.distributed, 1)
    dims.build_meshes("cpu")
    torch.manual_seed(cfg.trainer.seed)
    model, _ = build_salm(cfg, dims, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg.optim)
    batches = DevicePrefetcher(wrap_loader(build_loader(cfg.data, 0, 1), model, cfg, dims), "cpu")
    utts = seconds = wait = 0.0
    audio_pad, token_pad = [], []
    for step in range(steps + warmup):
        if step == warmup:
            start, utts, seconds, wait = time.perf_counter(), 0, 0.0, 0.0
        t = time.perf_counter()
        batch = next(batches)
        wait += time.perf_counter() - t
        train_step(
            model,
            optimizer,
            [batch],
            dims.get_mesh("dp_cp"),
            max_grad_norm=cfg.optim.max_grad_norm,
            defer_grad_sync=True,
            autocast=False,
            forward=salm_loss_sum,
        )
        lens = batch["audio_lens"]
        utts += len(lens)
        seconds += float(lens.sum()) / cfg.model.speech.sample_rate
        audio_pad.append(1 - float(lens.sum()) / (len(lens) * float(lens.max())))
        ends = (batch["labels"] != -100).int().cumsum(1).argmax(1) + 2  # last answer label + 1 -> row length
        real = torch.arange(batch["labels"].shape[1])[None, :] < ends[:, None]
        token_pad.append(1 - float(real.sum()) / real.numel())
    elapsed = time.perf_counter() - start
    batches.close()
    return {
        "utterances_per_s": utts / elapsed,
        "audio_s_per_s": seconds / elapsed,
        "data_wait_frac": wait / elapsed,
        "audio_padding": sum(audio_pad) / len(audio_pad),
        "token_padding": sum(token_pad) / len(token_pad),
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/bench_speech.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/speech_demo.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    from headrace.training.config.load import load_job_config

    results = {}
    for name, extra in (("1d", ["data.bucketing.num_token_buckets=1", "data.bucketing.max_tokens=null"]), ("2d", [])):
        cfg = load_job_config(args.config, [*args.overrides, *extra])
        results[name] = run(cfg, args.steps, args.warmup)
        r = results[name]
        print(
            f"{name}: {r['utterances_per_s']:.2f} utt/s, {r['audio_s_per_s']:.1f} audio-s/s, data wait "
            f"{r['data_wait_frac']:.1%}, padding: audio {r['audio_padding']:.1%}, LLM tokens {r['token_padding']:.1%}",
            flush=True,
        )
    print(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
