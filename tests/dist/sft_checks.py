"""torchrun script: conversations with uneven assistant lengths train on dp=2 like one process.

``torchrun --nproc-per-node 2 -m tests.dist.sft_checks WORKDIR`` (WORKDIR holds ``pretrained/`` and
``batches.pt``: packed conversation micro-batches alternating long answers and short ones, made by
tests/test_sft_train.py from ``dataio shard`` + the loader). Rank 0 gets the long answers' rows, rank 1 the
short ones', so the ranks' trained-token counts differ several-fold. FSDP2 (dp=2, one micro-batch) and DDP
(dp=2, two micro-batches of grad accumulation) each train on the same global batches as an independent
single-process reference computed on every rank (transformers model, summed cross-entropy over all trained
tokens of the step / their count, clip, AdamW): losses, gradient norms and exported weights must match. The
mean of per-rank means is checked to differ from the reference by far more than the tolerance (the check can
fail). Prints ``OK <check>`` per passed check; any mismatch raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from headrace.training.components.optim import build_optimizer, lr_at, set_lr
from headrace.training.config.job_config import OptimConfig
from headrace.training.config.load import load_job_config
from headrace.training.train import train
from tests.dist.train_common import ListLoader, full_logits_loss_sum
from tests.dist.train_layouts import OPTIM, check_close, check_matches_reference, pretrained_hf_model


def job(workdir: Path, name: str, distributed: dict, grad_accum: int, steps: int):
    return load_job_config(None, base=dict(
        model=dict(pretrained_path=str(workdir / "pretrained"), attn_implementation="headrace_varlen"),
        data=dict(datasets=[dict(path="unused")], seq_len=256, batch_size=2, packing="best_fit"),
        distributed=distributed, optim=dict(OPTIM, decay_steps=steps),
        trainer=dict(max_steps=steps, grad_accum=grad_accum, output_dir=str(workdir / name)),
        checkpoint=dict(interval=steps, export_hf=True), logging=dict(console=False, tensorboard=False)))  # fmt: skip


def reference(workdir: Path, steps: list[list[dict]]):
    """Plain single-process training over ``steps`` (each the global batch's micro-batches)."""
    model = pretrained_hf_model(workdir)
    cfg = OptimConfig(**dict(OPTIM, decay_steps=len(steps)))
    opt = build_optimizer(model, cfg)
    losses, norms = [], []
    for step, micro in enumerate(steps, 1):
        tokens = sum(int((mb["labels"] != -100).sum()) for mb in micro)
        total = sum(full_logits_loss_sum(model, mb) for mb in micro) / tokens
        total.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)))
        set_lr(opt, lr_at(step, cfg, len(steps)))
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(workdir: Path) -> None:
    batches = torch.load(workdir / "batches.pt", weights_only=True)
    long, short = batches[0::2], batches[1::2]
    layouts = {  # name: (distributed, grad_accum, steps as [rank 0's micro-batches + rank 1's])
        "fsdp2 dp=2": (dict(strategy="fsdp2"), 1, [[a, b] for a, b in zip(long, short)]),
        "ddp dp=2 grad_accum=2": (
            dict(strategy="ddp"),
            2,
            [long[i : i + 2] + short[i : i + 2] for i in range(0, len(long), 2)],
        ),
    }
    for name, (distributed, k, steps) in layouts.items():
        want = reference(workdir, steps)
        flat = [mb for step in steps for mb in step]
        run = name.replace(" ", "_").replace("=", "")
        history = train(job(workdir, run, distributed, k, len(steps)), lambda r, n: ListLoader(flat, r, n, k))
        check_matches_reference(workdir, run, history, want)
        print(f"OK {name} matches the single-process reference", flush=True)
        if k == 1:  # the first step's mean of per-rank means is another number
            model = pretrained_hf_model(workdir)
            with torch.no_grad():
                means = [float(full_logits_loss_sum(model, mb)) / int((mb["labels"] != -100).sum()) for mb in steps[0]]
            gap = abs(sum(means) / len(means) - want[0][0])
            assert gap > 100 * 2e-5, f"mean of per-rank means {sum(means) / len(means)} vs {want[0][0]}"
            check_close("first loss", history[0]["loss"], want[0][0], 2e-5)
            print(f"OK mean of per-rank means differs from the global mean by {gap:.3g}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
