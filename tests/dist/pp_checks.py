"""torchrun script: pipeline-parallel training equals one process, for every schedule and composition.

``torchrun --nproc-per-node 2 -m tests.dist.pp_checks WORKDIR pp2`` (WORKDIR holds ``pretrained/``, an
8-block tiny Llama): every schedule at pp 2 (one stage per rank for GPipe / 1F1B, two per rank for the
interleaved, looped, zero-bubble and V schedules) trains STEPS steps on the same global batches as the
single-process reference; losses, gradient norms and the weights read back from the ``hf/`` export must
match, and the exported model's logits must equal the reference model's. ``scale_grads_in_schedule: true``
trains the same model; bf16 with activation checkpointing stays within bf16 rounding of it. The pp 2
checkpoint of step 2 then resumes at pp 1 (FSDP2 over 2 ranks) with the reference's losses.

``torchrun --nproc-per-node 4 -m tests.dist.pp_checks WORKDIR pp4``: pp 4 with 1F1B and Interleaved1F1B,
pp 2 x dp 2 (FSDP2), pp 2 x tp 2 (+SP) against the same reference, and the pp 2 checkpoint resumed at pp 4.
Prints ``OK <check>`` per passed check; any mismatch raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist.train_common import copy_checkpoint, packed_batches
from tests.dist.train_layouts import (
    GLOBAL_MICRO,
    STEPS,
    check_close,
    check_matches_reference,
    job,
    loaders,
    pretrained_hf_model,
    reference,
)

from headrace.training.train import train  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble", "v_schedule", "DualPipeV")


def pp_job(workdir: Path, name: str, pp: int, schedule: str, grad_accum: int, *, checkpoints: bool = False,
           **extra):
    """A pipeline run of ``job``; DCP checkpoints only where a later check resumes from them (CI time)."""
    pipeline = dict(pp_schedule=schedule, pp_microbatch_size=1, **extra.pop("pipeline", {}))
    cfg = job(workdir, name, dict(strategy="fsdp2", pp_size=pp, pipeline=pipeline, **extra), grad_accum)
    if not checkpoints:
        cfg.checkpoint.interval, cfg.checkpoint.save_final = 0, False
    return cfg


def check_run(workdir: Path, name: str, history: list[dict], want) -> None:
    check_matches_reference(workdir, name, history, want)
    record = history[-1]
    assert 0.0 <= record["pp_bubble_theory"] < 1 and record["pp_bubble_measured"] >= 0, record
    assert len(record["pp_stage_compute_s"]) == len(record["pp_stage_max_mem"]), record


def resume_from_pp2(workdir: Path, name: str, cfg, grad_accum: int, ref_losses) -> None:
    """Copy the pp 2 run's step-2 checkpoint under ``name``; train to STEPS; losses 3..STEPS as the reference."""
    if dist.get_rank() == 0:
        copy_checkpoint(workdir / "pp2_1f1b" / "checkpoints" / "step-00000002", workdir / name / "checkpoints" /
                        "step-00000002")
    dist.barrier()
    history = train(cfg, loaders(BATCHES, grad_accum))
    assert [r["step"] for r in history] == [3, 4], history
    check_close(f"{name} losses", [r["loss"] for r in history], ref_losses[2:], 2e-5)
    print(f"OK pp2 checkpoint resumes as {name}", flush=True)


def run_pp2(workdir: Path) -> None:
    want = reference(workdir, BATCHES)
    for schedule in SCHEDULES:
        name = f"pp2_{schedule.lower()}"
        cfg = pp_job(workdir, name, 2, schedule, GLOBAL_MICRO, checkpoints=schedule == "1f1b")
        history = train(cfg, loaders(BATCHES, GLOBAL_MICRO))
        check_run(workdir, name, history, want)
        print(f"OK pp2 {schedule} matches the single-process reference (bubble theory "
              f"{history[-1]['pp_bubble_theory']:.3f}, measured {history[-1]['pp_bubble_measured']:.3f})", flush=True)
    name = "pp2_scaled_in_schedule"
    cfg = pp_job(workdir, name, 2, "1f1b", GLOBAL_MICRO, pipeline=dict(scale_grads_in_schedule=True))
    check_run(workdir, name, train(cfg, loaders(BATCHES, GLOBAL_MICRO)), want)
    print("OK pp2 scale_grads_in_schedule trains the same model", flush=True)
    # bf16 (FSDP2 MixedPrecisionPolicy per stage, bf16 activations between stages) with activation
    # checkpointing: losses within half a bf16 unit roundoff of the fp32 reference, as in train_layouts.
    cfg = pp_job(workdir, "pp2_bf16_ac", 2, "interleaved_1f1b", GLOBAL_MICRO, activation_checkpointing=True)
    cfg.trainer.precision = "bf16"
    history = train(cfg, loaders(BATCHES, GLOBAL_MICRO))
    relative = [r["loss"] / ref - 1 for r, ref in zip(history, want[0])]
    check_close("pp2 bf16 relative losses", relative, [0.0] * len(relative), 1e-3)
    print(f"OK pp2 bf16 with activation checkpointing within {max(map(abs, relative)):.1e} of fp32", flush=True)

    if dist.get_rank() == 0:  # the export loads in plain transformers and gives the reference's logits
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(workdir / "pp2_1f1b" / "hf")
        trained = pretrained_hf_model(workdir)
        trained.load_state_dict(want[2])
        batch = BATCHES[0]
        with torch.no_grad():
            got = exported(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            ref = trained(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        check_close("exported logits", got, ref, 1e-4)
    print("OK pp2 hf export logits equal the reference model's", flush=True)
    resume_from_pp2(workdir, "resume_pp1", job(workdir, "resume_pp1", dict(strategy="fsdp2"), GLOBAL_MICRO // 2),
                    GLOBAL_MICRO // 2, want[0])


def run_pp4(workdir: Path) -> None:
    want = reference(workdir, BATCHES)
    runs = {
        "pp4_1f1b": (pp_job(workdir, "pp4_1f1b", 4, "1f1b", GLOBAL_MICRO), GLOBAL_MICRO),
        "pp4_interleaved": (pp_job(workdir, "pp4_interleaved", 4, "Interleaved1F1B", GLOBAL_MICRO), GLOBAL_MICRO),
        "pp2_dp2_fsdp2": (pp_job(workdir, "pp2_dp2_fsdp2", 2, "1f1b", GLOBAL_MICRO // 2), GLOBAL_MICRO // 2),
        "pp2_tp2_sp": (pp_job(workdir, "pp2_tp2_sp", 2, "interleaved_1f1b", GLOBAL_MICRO, tp_size=2,
                              sequence_parallel=True), GLOBAL_MICRO),
    }
    for name, (cfg, k) in runs.items():
        check_run(workdir, name, train(cfg, loaders(BATCHES, k)), want)
        print(f"OK {name} matches the single-process reference", flush=True)
    resume_from_pp2(workdir, "resume_pp4", pp_job(workdir, "resume_pp4", 4, "1f1b", GLOBAL_MICRO), GLOBAL_MICRO,
                    want[0])


BATCHES = packed_batches(STEPS * GLOBAL_MICRO)


def main() -> None:
    workdir, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    {"pp2": run_pp2, "pp4": run_pp4}[mode](workdir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
