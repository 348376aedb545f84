"""torchrun script (4 ranks): validation under pipeline and context parallelism equals one process's.

``torchrun --nproc-per-node 4 -m tests.dist.val_checks WORKDIR``: rank 0 writes a 4-block tiny Llama and a
val dataset of VAL_DOCS token documents (1..39 tokens, packed greedily into 32-token rows, 3 rows per val
batch, so the pipeline regroups val rows into its 4-row steps). The reference is computed on every rank
alone: a plain transformers model, full logits, over the whole val stream read as one dp rank.

1. ``headrace.training.eval``'s ``evaluate_checkpoint`` on the starting weights (``hf`` kind) at pp 4 (1F1B), pp 2 x
   dp 2 (1F1B, Interleaved1F1B), pp 2 x tp 2, cp 4 (allgather), cp 2 x dp 2 (ring) and dp 4:
   val loss, perplexity, tokens and documents equal the reference;
2. training with ``trainer.eval_every: 1`` at pp 2 x dp 2 and at cp 2 x dp 2 (2 steps): the losses equal the
   single-process reference of tests/dist/train_layouts.py (training goes on right after validation), and
   the val figures logged at step 2 equal ``evaluate_checkpoint`` of the run's step-2 DCP checkpoint at other
   layouts (dp 4, and the pp checkpoint also at cp 2 x dp 2): a pp or cp checkpoint evaluates at any layout.
Prints ``OK <check>`` per passed check; any mismatch raises.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.loader_util import make_text_dataset
from tests.dist.train_common import TINY_LLAMA, full_logits_loss_sum, packed_batches, save_pretrained_tiny
from tests.dist.train_layouts import GLOBAL_MICRO, STEPS, check_close, job, loaders
from tests.dist.train_layouts import reference as train_reference

from headrace.dataio import build_loader  # noqa: E402
from headrace.training.eval import evaluate_checkpoint  # noqa: E402
from headrace.training.train import train  # noqa: E402
from headrace.training.validation import documents_started  # noqa: E402
from headrace.training.config.job_config import val_data_config  # noqa: E402

VAL_DOCS = 30
VAL = dict(batch_size=3)


def val_job(workdir: Path, name: str, distributed: dict, grad_accum: int = 2, eval_every: int = 0):
    """``train_layouts.job`` with the val stream; pp runs use microbatches of one row."""
    cfg = job(workdir, name, dict(strategy="fsdp2", **distributed), grad_accum, max_steps=2)
    cfg.data.val = dict(datasets=[dict(path=str(workdir / "val"))], **VAL)
    cfg.trainer.eval_every = eval_every
    cfg.distributed.pipeline.pp_microbatch_size = 1
    cfg.checkpoint.export_hf = False
    return cfg


def reference(workdir: Path) -> dict:
    """One process: the plain HF model over the val stream of one dp rank."""
    from tests.dist.train_layouts import pretrained_hf_model

    model = pretrained_hf_model(workdir).eval()
    total, tokens, docs = 0.0, 0, 0
    with torch.no_grad():
        for batch in build_loader(val_data_config(val_job(workdir, "ref", {}).data), 0, 1):
            total += float(full_logits_loss_sum(model, batch))
            tokens += int((batch["labels"] != -100).sum())
            docs += documents_started(batch)
    assert docs == VAL_DOCS, docs
    return {"val_loss": total / tokens, "val_ppl": math.exp(total / tokens), "val_tokens": tokens, "val_docs": docs}


def check_figures(name: str, got: dict, want: dict, tol: float = 2e-5) -> None:
    assert got["val_tokens"] == want["val_tokens"] and got["val_docs"] == want["val_docs"], (name, got, want)
    check_close(f"{name} val_loss", torch.tensor(got["val_loss"]), torch.tensor(want["val_loss"]), tol)
    check_close(f"{name} val_ppl", torch.tensor(got["val_ppl"] / want["val_ppl"]), torch.tensor(1.0), tol)


LAYOUTS = {
    "pp4_1f1b": dict(pp_size=4, pipeline=dict(pp_schedule="1f1b")),
    "pp2_dp2_1f1b": dict(pp_size=2, pipeline=dict(pp_schedule="1f1b")),
    "pp2_dp2_interleaved": dict(pp_size=2, pipeline=dict(pp_schedule="interleaved_1f1b")),
    "pp2_tp2": dict(pp_size=2, tp_size=2, pipeline=dict(pp_schedule="1f1b")),
    "cp4_allgather": dict(cp_size=4, cp_comm="allgather"),
    "cp2_dp2_ring": dict(cp_size=2, cp_comm="ring"),
    "dp4": dict(),
}


def evaluate_at(workdir: Path, checkpoint: Path, layout: str) -> dict:
    return evaluate_checkpoint(val_job(workdir, f"eval_{layout}", LAYOUTS[layout]), str(checkpoint))


def main() -> None:
    workdir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        # initializer_range 0.3: far from uniform logits (val loss ~9.6, not ln 1024), so a wrong attention
        # span or a token counted twice moves the loss well past the tolerance
        save_pretrained_tiny(workdir / "pretrained", dict(TINY_LLAMA, num_hidden_layers=4, vocab_size=1024,
                                                          initializer_range=0.3))
        make_text_dataset(workdir / "val", [17, VAL_DOCS - 17], prefix="val", seed=1)
    dist.barrier()
    want = reference(workdir)
    for layout in LAYOUTS:
        got = evaluate_at(workdir, workdir / "pretrained", layout)
        check_figures(layout, got, want)
        print(f"OK {layout} validation equals one process's", flush=True)

    # training with eval_every=1: the pipeline schedule trains on after each forward-only pass (losses as
    # one process's), and the logged val figures equal the checkpoint's evaluated at other layouts
    batches = packed_batches(STEPS * GLOBAL_MICRO)
    ref_losses = train_reference(workdir, batches)[0]
    for name, distributed, others in (("train_pp2_dp2", LAYOUTS["pp2_dp2_1f1b"], ("dp4", "cp2_dp2_ring")),
                                      ("train_cp2_dp2", LAYOUTS["cp2_dp2_ring"], ("dp4",))):
        history = train(val_job(workdir, name, distributed, eval_every=1), loaders(batches, 2))
        check_close(f"{name} losses", [r["loss"] for r in history], ref_losses[:2], 2e-5)
        dist.barrier()  # rank 0 has closed metrics.jsonl
        val = [r for r in map(json.loads, open(workdir / name / "metrics.jsonl")) if "val_loss" in r]
        assert [r["step"] for r in val] == [1, 2], val
        for other in others:
            got = evaluate_at(workdir, workdir / name / "checkpoints" / "step-00000002", other)
            check_figures(f"{name} as {other}", got, val[1])
        print(f"OK {name} validation in training equals its checkpoint evaluated at {', '.join(others)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
