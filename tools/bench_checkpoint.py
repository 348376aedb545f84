"""The step-time stall of a checkpoint save per ``checkpoint.async_mode``, and save / load times against torch's
default DCP layout (pickled ``.metadata`` + ``.distcp``), on one process.

    OMP_NUM_THREADS=2 python -m tools.bench_checkpoint --out /tmp/ckpt_bench --rounds 2

The model is a stack of ``--layers`` square ``nn.Linear(--width)`` (``--layers 72 --width 2048``: 302M
parameters; fp32, AdamW: 3.6 GB of checkpoint). A step is a forward + backward on a ``--batch`` x width
input and an AdamW step. Each run trains ``--steps`` steps, saving with ``headrace.training.checkpoint.saver.Saver``
after steps ``--save-at``; the stall of a save is that step's time (the save call included) minus the median
of the steps with no save in flight. ``after`` is the extra time of the steps that ran while a background write
was in flight (GIL and memory-bandwidth contention), summed. Modes run in turn within each round (A B C A B C)
so a drifting machine load affects them alike. Then the same state is saved and loaded once with headrace's
layout (safetensors + per-file SHA-256; load = hash check + read) and with ``dcp.save`` / ``dcp.load``
defaults. Loads read from the page cache when the machine has memory for it (both layouts alike).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from headrace.training.checkpoint import layout, restore, saver
from headrace.training.checkpoint.seal import verify_hashes
from headrace.training.checkpoint.save_buffers import allocate_save_buffers


def build(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def run_mode(mode: str, model, optimizer, batch, out: Path, steps: int, save_at: set[int]) -> dict:
    folder = out / mode
    shutil.rmtree(folder, ignore_errors=True)
    job_saver = saver.Saver(mode)
    allocate_save_buffers(job_saver, model, optimizer, trainable_only=False)  # as the trainer does, before the steps
    times, in_flight = [], []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        job_saver.raise_if_failed()
        busy = job_saver.busy  # a background write overlaps this step
        train_step(model, optimizer, batch)
        if step in save_at:
            job_saver.save(folder, step, model, optimizer, [{}])
        times.append(time.perf_counter() - start)
        in_flight.append(busy)
    start = time.perf_counter()
    job_saver.wait()
    final_wait = time.perf_counter() - start
    quiet = [t for s, t in enumerate(times, 1) if s not in save_at and not in_flight[s - 1]]
    median = statistics.median(quiet)
    return {
        "mode": mode,
        "median_step_s": median,
        "stall_s": [times[s - 1] - median for s in sorted(save_at)],
        "after_s": sum(t - median for s, t in enumerate(times, 1) if in_flight[s - 1] and s not in save_at),
        "final_wait_s": final_wait,
    }


def save_load_times(model, optimizer, out: Path) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer, options=layout.FLAT_OPTIONS)
    tensors, _ = layout.split_state(model_state, optim_state)
    ours, theirs = out / "layout-ours", out / "layout-dcp"
    for p in (ours, theirs):
        shutil.rmtree(p, ignore_errors=True)
    start = time.perf_counter()
    path = saver.Saver("disabled").save(ours, 1, model, optimizer, [{}])
    ours_save = time.perf_counter() - start
    start = time.perf_counter()
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(theirs))
    dcp_save = time.perf_counter() - start
    state = restore.sealed_state(path)
    start = time.perf_counter()
    assert verify_hashes(path, state, 0, 1) is None
    restore.read_tensors(path, tensors)
    ours_load = time.perf_counter() - start
    start = time.perf_counter()
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=str(theirs))
    dcp_load = time.perf_counter() - start
    size = sum(f.stat().st_size for f in path.iterdir())
    shutil.rmtree(ours.parent / "layout-ours", ignore_errors=True)
    shutil.rmtree(theirs, ignore_errors=True)
    return {
        "gb": size / 1e9,
        "ours_save_s": ours_save,
        "dcp_save_s": dcp_save,
        "ours_load_s": ours_load,
        "dcp_load_s": dcp_load,
    }


def staging_times(model, optimizer, rounds: int) -> list[dict]:
    """What the step pays per save without contention: the host copy of ``async`` (fresh memory each save) and
    of ``async_with_pinned_mem`` (buffers kept from the first save), A B A B."""
    train_step(model, optimizer, torch.randn(2, model[0].in_features))  # AdamW state exists
    tensors, _ = layout.split_state(*get_state_dict(model, optimizer, options=layout.FLAT_OPTIONS))
    kept: dict = {}
    rows = []
    for r in range(rounds):
        for mode, buffers in (("async", None), ("async_with_pinned_mem", kept)):
            start = time.perf_counter()
            staged = saver.stage(tensors, buffers, pin=mode == "async_with_pinned_mem")
            rows.append({"round": r, "mode": mode, "stage_s": time.perf_counter() - start, "load": os.getloadavg()[0]})
            del staged
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=72)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-at", default="3,7")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="disabled,async,async_with_pinned_mem")
    parser.add_argument("--no-layout-times", action="store_true", help="skip the save / load vs dcp defaults")
    parser.add_argument("--staging-only", action="store_true", help="only the host copy per mode, A B A B")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    model, optimizer = build(args.layers, args.width)
    batch = torch.randn(args.batch, args.width)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"params_m": params / 1e6, "load": os.getloadavg()}), flush=True)
    if args.staging_only:
        for row in staging_times(model, optimizer, args.rounds):
            print(json.dumps(row), flush=True)
        dist.destroy_process_group()
        return
    save_at = {int(s) for s in args.save_at.split(",")}
    for r in range(args.rounds):
        for mode in args.modes.split(","):
            print(
                json.dumps(
                    {
                        "round": r,
                        **run_mode(mode, model, optimizer, batch, args.out, args.steps, save_at),
                        "load": os.getloadavg()[0],
                    }
                ),
                flush=True,
            )
        if not args.no_layout_times:
            print(
                json.dumps({"round": r, **save_load_times(model, optimizer, args.out), "load": os.getloadavg()[0]}),
                flush=True,
            )
    shutil.rmtree(args.out, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
