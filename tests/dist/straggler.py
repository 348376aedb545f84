"""torchrun script: a rank whose forward burns CPU is named the compute straggler by the per-rank telemetry.

``torchrun --nproc-per-node 2 -m tests.dist.straggler WORKDIR SLOW_RANK``: FSDP2 over 2 gloo ranks, debug
Llama, packed rows; on SLOW_RANK every forward first spins for 0.15 s of CPU (a busy loop, no sleep). The
step is a collective, so both ranks' wall step times come out about equal; the own compute time per step
(``telemetry.ComputeClock``: process CPU time on CPU) differs, and every rank's record must name SLOW_RANK
as ``slowest_compute_rank`` with ``compute_time_max`` above ``compute_time_mean`` by at least a third of the
burn. Prints ``OK straggler named`` and the figures.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch.distributed as dist

import headrace.training.step as step_mod
import headrace.training.train as train_mod
from tests.dist.train_common import TINY_LLAMA, ListLoader, packed_batches
from headrace.training.config.load import load_job_config

BURN_S = 0.15


def burn_cpu(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def main(workdir: Path, slow_rank: int) -> None:
    steps = 4
    cfg = load_job_config(None, base=dict(
        model=dict(config=dict(TINY_LLAMA), attn_implementation="headrace_varlen"),
        data=dict(datasets=[dict(path="unused")], seq_len=32, batch_size=2, packing="greedy"),
        trainer=dict(max_steps=steps, log_every=2, output_dir=str(workdir / "straggler")),
        checkpoint=dict(interval=0, save_final=False, export_hf=False, resume=False),
        logging=dict(console=False, tensorboard=False)))
    train_mod.init_distributed("cpu")
    forward = step_mod.forward_loss_sum

    def slow_forward(model, batch, autocast, attention_kwargs=None):
        burn_cpu(BURN_S)
        return forward(model, batch, autocast, attention_kwargs)

    if dist.get_rank() == slow_rank:
        step_mod.forward_loss_sum = slow_forward
    batches = packed_batches(2 * (steps + 2))
    history = train_mod.train(cfg, lambda rank, size: ListLoader(batches, rank, size, 1))
    for record in history:
        print(f"rank {dist.get_rank()} step {record['step']}: step_time max {record['step_time_max']:.3f} "
              f"mean {record['step_time_mean']:.3f}; compute max {record['compute_time_max']:.3f} "
              f"mean {record['compute_time_mean']:.3f} rank {record['slowest_compute_rank']}", flush=True)
        assert record["slowest_compute_rank"] == slow_rank, record
        assert record["compute_time_max"] - record["compute_time_mean"] > BURN_S / 6, record
    print("OK straggler named", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
