"""Pipeline schedules side by side: tokens/s and the measured bubble beside the theoretical one.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m tools.bench_pp              # CPU, pp 2
    torchrun --nproc-per-node 4 -m tools.bench_pp --device cuda --hidden 2048 --layers 16 --seq-len 2048

Every schedule (``--schedules``) trains the same fresh tiny Llama (``--hidden``, ``--layers``) with the
trainer's pipeline step (``headrace.training.step.pipeline_train_step``: packed THD rows from ``dataio``'s
packer, chunked loss on the last stage, AdamW) for ``--steps`` steps at pp = world size, once per
microbatch count in ``--microbatches``; the global batch (``--rows`` x ``--seq-len`` tokens) is the same
for every run, so a larger count means smaller microbatches. Reported over the steps after ``--warmup``:
tokens/s, the theoretical bubble (idle over compute with equal F/B/W costs, see ``headrace.training.distributed.pipeline``),
the measured bubble (each rank's time outside its stages' forward/backward over its time inside them,
averaged over ranks) and the idle fraction of the step. On a shared CPU, contention inflates the
measured idle; compare schedules within one run.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.distributed as dist

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble", "v_schedule", "DualPipeV")


def packed_rows(rows: int, seq_len: int, vocab: int, seed: int) -> dict:
    """One global batch of ``rows`` packed rows of random documents (16..seq_len tokens)."""
    from headrace.dataio.batching.packing import Packer
    from headrace.dataio.config import PackingConfig

    rng = np.random.default_rng(seed)
    packer = Packer(PackingConfig(seq_len=seq_len, packing="greedy"), rows_per_batch=rows)
    ref = 0
    while (batch := packer.pop()) is None:
        packer.push(ref, rng.integers(1, vocab, size=int(rng.integers(16, seq_len + 1))))
        ref += 1
    return batch


def run(args, schedule: str, microbatches: int, device: torch.device) -> dict:
    from headrace.training.config.load import load_job_config
    from headrace.training.models.build import build_hf_config
    from headrace.training.components.optim import build_optimizer
    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.distributed.pipeline import build_pipeline, pipeline_metrics
    from headrace.training.step import pipeline_train_step

    model = dict(
        model_type="llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        tie_word_embeddings=False,
        max_position_embeddings=args.seq_len,
    )
    cfg = load_job_config(
        None,
        base=dict(
            model=dict(config=model, attn_implementation="headrace_varlen"),
            data=dict(datasets=[dict(path="unused")], seq_len=args.seq_len, batch_size=args.rows),
            distributed=dict(
                pp_size=dist.get_world_size(),
                pipeline=dict(pp_schedule=schedule, pp_microbatch_size=args.rows // microbatches),
            ),
            trainer=dict(precision=args.precision),
        ),
    )
    dims = ParallelDims.from_config(cfg.distributed, dist.get_world_size())
    dims.build_meshes(device.type)
    torch.manual_seed(0)
    pipe = build_pipeline(cfg, dims, device, build_hf_config(cfg.model))
    optimizer = build_optimizer(pipe.part, cfg.optim)
    batch = {
        k: v.to(device)
        for k, v in packed_rows(args.rows, args.seq_len, args.vocab, seed=0).items()
        if torch.is_tensor(v)
    }
    records = []
    for step in range(args.steps):
        start = time.perf_counter()
        pipeline_train_step(pipe, optimizer, [batch], dims.get_mesh("dp_cp"), max_grad_norm=1.0)
        wall = time.perf_counter() - start
        figures = pipeline_metrics(pipe, 0.0)
        if step >= args.warmup:
            records.append((wall, figures))
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    tokens = args.rows * args.seq_len
    return {
        "schedule": schedule,
        "class": pipe.class_name,
        "microbatches": microbatches,
        "stages_per_rank": len(pipe.stages),
        "tokens_per_s": tokens / mean([w for w, _ in records]),
        "bubble_theory": pipe.bubble_theory,
        "bubble_measured": mean([f["pp_bubble_measured"] for _, f in records]),
        "idle_frac": mean([f["pp_idle_frac"] for _, f in records]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--microbatches", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--rows", type=int, default=8, help="packed rows per step (the global batch)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object per run instead of a table")
    args = parser.parse_args()
    from headrace.training.distributed.process_group import init_distributed, pick_device

    device = pick_device(args.device)
    init_distributed(device.type)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks share the cores
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and not args.json:
        print(
            f"pp {world}, {args.layers} layers x hidden {args.hidden}, {args.rows} rows x {args.seq_len} tokens "
            f"per step, {args.precision}, {device.type}; {args.steps - args.warmup} timed steps per run\n"
            f"{'schedule':>18} {'m':>3} {'v':>2} {'tokens/s':>9} {'bubble theory':>14} {'measured':>9} "
            f"{'idle frac':>9}",
            flush=True,
        )
    for schedule in args.schedules:
        for microbatches in args.microbatches:
            result = run(args, schedule, microbatches, device)
            if rank == 0:
                print(
                    json.dumps(result)
                    if args.json
                    else f"{schedule:>18} {microbatches:>3} {result['stages_per_rank']:>2} {result['tokens_per_s']:>9,.0f} "
                    f"{result['bubble_theory']:>14.3f} {result['bubble_measured']:>9.3f} "
                    f"{result['idle_frac']:>9.1%}",
                    flush=True,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
