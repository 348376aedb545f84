"""torchrun script and shared pieces of the LoRA tests (tests/test_lora.py, tests/test_lora_dist.py).

``torchrun --nproc-per-node 2 -m tests.dist.lora_checks WORKDIR`` (WORKDIR holds ``pretrained/`` and the peft
``adapter/`` of ``make_base_and_adapter``): FSDP2 dp=2 with activation checkpointing, DDP dp=2, TP=2 with sequence parallelism and PP=2 each
train ``STEPS`` steps of LoRA on the same global batches from the same base and adapter, writing their
``metrics.jsonl`` and ``lora/`` export under ``WORKDIR/<layout>``; the test compares them with the same job run
by one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.dist.train_common import TINY_LLAMA, ListLoader, packed_batches, save_pretrained_tiny

from headrace.training.config.load import load_job_config  # noqa: E402

TARGETS = ["q_proj", "v_proj", "down_proj"]  # column-wise and row-wise layers under TP
STEPS, GLOBAL_MICRO = 3, 2  # per step: 2 micro-batches of 2 x 32 tokens
LAYOUTS = {  # name -> distributed section (2 ranks)
    "fsdp_dp2_ac": {"activation_checkpointing": True},
    "ddp_dp2": {"strategy": "ddp"},
    "tp2_sp": {"tp_size": 2, "sequence_parallel": True},
    "pp2": {"pp_size": 2},
}


def make_base_and_adapter(workdir: Path, fields: dict = TINY_LLAMA) -> None:
    """A seeded base checkpoint and a peft adapter on it with non-zero B (peft's ``init_lora_weights=False``), so
    the adapter changes the output from step 0."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    save_pretrained_tiny(workdir / "pretrained", fields)
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(workdir / "pretrained")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(workdir / "adapter")


def lora_job(workdir: Path, name: str, max_steps: int, distributed: dict | None = None, grad_accum: int = 1,
             **peft):
    """The tiny LoRA job on ``workdir``'s base and peft adapter; ``peft`` overrides the block (None drops a key)."""
    block = dict(r=4, lora_alpha=8, target_modules=TARGETS, pretrained_path=str(workdir / "adapter")) | peft
    return load_job_config(None, base=dict(
        model=dict(pretrained_path=str(workdir / "pretrained"), attn_implementation="headrace_varlen"),
        data=dict(datasets=[dict(path="unused")], seq_len=32, batch_size=2, packing="greedy"),
        distributed=distributed or {}, optim=dict(lr=1e-2, warmup_steps=0, decay_steps=4),
        trainer=dict(max_steps=max_steps, grad_accum=grad_accum, output_dir=str(workdir / name)),
        checkpoint=dict(interval=2), logging=dict(console=False, tensorboard=False),
        peft={k: v for k, v in block.items() if v is not None}))


def loaders(batches: list[dict], grad_accum: int):
    return lambda dp_rank, dp_size: ListLoader(batches, dp_rank, dp_size, grad_accum)


def main(workdir: Path) -> None:
    from headrace.training.train import train

    batches = packed_batches(STEPS * GLOBAL_MICRO)
    for name, distributed in LAYOUTS.items():
        dp = 2 if not {"tp_size", "pp_size"} & distributed.keys() else 1
        grad_accum = GLOBAL_MICRO // dp
        train(lora_job(workdir, name, STEPS, distributed, grad_accum), loaders(batches, grad_accum))
        print(f"OK {name}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
