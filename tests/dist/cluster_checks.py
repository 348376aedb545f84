"""torchrun script (2 ranks, FSDP2 on gloo): issue 45's trainer checks in one launch, each through ``train``.

``torchrun ... -m tests.dist.cluster_checks WORK SIGNAL_AT`` with ``WORK/job.yaml`` (real shards, a saved initial
model, async checkpoints every 3 steps); each rank writes ``WORK/result-rank{R}.json``:

1. ``reference``: an uninterrupted run's losses;
2. ``preempted``: rank 1 sends itself SIGTERM when its loader hands out batch ``SIGNAL_AT``, and once more inside
   the save that follows (the second signal); ``train`` raises ``Preempted`` on both ranks: its code, the step;
3. ``resumed``: the same command again: its losses from the saved step on (the test compares them);
4. ``planted``: rank 0's batch 3 holds a token that makes the forward's loss Inf: which steps changed the
   weights on this rank (parameters and AdamW's step count compared around every step) and the keys planted;
5. ``streak``: from batch 5 on every rank-1 batch is planted, ``max_bad_steps`` 3: the one-line error.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import headrace.training.step as step_mod
import headrace.training.train as train_mod
from headrace.dataio import build_loader
from headrace.training.checkpoint import layout
from headrace.training.components.nonfinite import sample_names
from headrace.training.components.preemption import Preempted
from headrace.training.config.load import load_job_config
from headrace.training.errors import JobInputError

POISON = 1000  # a token id the shards never hold (theirs are < 1000); the model's vocabulary has it
SIGNALLED: list[bool] = []  # this process sent itself the preemption signal


class PlantingLoader:
    """The real loader; batches numbered ``plant`` (1-based) on rank ``rank`` get ``POISON`` as their first token,
    and, when ``signal_at``, that batch sends this process SIGTERM."""

    def __init__(self, loader, *, rank_here: bool, plant=(), signal_at: int | None = None):
        self.loader, self.rank_here, self.plant, self.signal_at = loader, rank_here, plant, signal_at
        self.planted_keys: list[list[str]] = []

    def __iter__(self):
        for i, batch in enumerate(self.loader, 1):
            if self.rank_here and i in self.plant:
                batch["input_ids"][0, 0] = POISON
                self.planted_keys.append(sample_names(batch))
            if self.rank_here and i == self.signal_at:
                SIGNALLED.append(True)
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, states):
        self.loader.load_state_dict(states)

    def reseed(self, seed):
        return self.loader.reseed(seed)


def planted_forward(forward):
    """The step's forward, its loss Inf on a micro-batch holding ``POISON`` (decided on the device)."""

    def run(model, batch, autocast, attention_kwargs=None):
        loss = forward(model, batch, autocast, attention_kwargs)
        return loss * torch.where((batch["input_ids"] == POISON).any(), float("inf"), 1.0)

    return run


def local_state(trainer) -> list[torch.Tensor]:
    params = [p.to_local() if isinstance(p, DTensor) else p for p in trainer.model.parameters()]
    steps = [s["step"] for s in trainer.optimizer.state.values()]
    return [t.detach().clone() for t in params + steps]


def run(cfg, loader, changed: dict | None = None, second_signal: bool = False):
    """``train`` on ``loader``; ``changed``: step -> whether this rank's shards or AdamW's step count changed in it;
    ``second_signal``: SIGTERM again inside the preemption save (this rank)."""
    take_step, save = train_mod.take_step, train_mod.save_checkpoint

    def watched_step(trainer, micro, profiler):
        before = local_state(trainer)
        stats = take_step(trainer, micro, profiler)
        changed[trainer.step] = any(not torch.equal(a, b) for a, b in zip(before, local_state(trainer)))
        return stats

    def signalled_save(trainer, batches):
        if SIGNALLED:  # the preemption's save, not an interval's
            os.kill(os.getpid(), signal.SIGTERM)
        save(trainer, batches)

    if changed is not None:
        train_mod.take_step = watched_step
    if second_signal:
        train_mod.save_checkpoint = signalled_save
    try:
        return train_mod.train(cfg, lambda r, n: loader(r, n))
    finally:
        train_mod.take_step, train_mod.save_checkpoint = take_step, save


def losses(history: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in history}


def main() -> int:
    work, signal_at = Path(sys.argv[1]), int(sys.argv[2])
    job = str(work / "job.yaml")
    rank = int(os.environ["RANK"])
    result: dict = {}
    cfg = load_job_config(job, [f"trainer.output_dir={work / 'reference'}"])
    result["reference"] = losses(train_mod.train(cfg))

    out = work / "preempted"
    cfg = load_job_config(job, [f"trainer.output_dir={out}"])
    try:
        run(
            cfg,
            lambda r, n: PlantingLoader(build_loader(cfg.data, r, n), rank_here=rank == 1, signal_at=signal_at),
            second_signal=rank == 1,
        )
        result["preempted"] = None
    except Preempted as e:
        result["preempted"] = {"code": e.code, "latest": str(layout.latest(out / "checkpoints"))}
    result["resumed"] = losses(train_mod.train(cfg))

    cfg = load_job_config(job, [f"trainer.output_dir={work / 'planted'}"])
    step_mod.forward_loss_sum, forward = planted_forward(step_mod.forward_loss_sum), step_mod.forward_loss_sum
    try:
        loaders: list[PlantingLoader] = []

        def planted(r, n):
            loaders.append(PlantingLoader(build_loader(cfg.data, r, n), rank_here=rank == 0, plant={3}))
            return loaders[-1]

        changed: dict[int, bool] = {}
        history = run(cfg, planted, changed)
        result["planted"] = {
            "changed": changed,
            "keys": loaders[0].planted_keys,
            "nonfinite_steps": {r["step"]: r["nonfinite_steps"] for r in history},
        }

        cfg = load_job_config(job, [f"trainer.output_dir={work / 'streak'}", "trainer.max_bad_steps=3"])
        try:
            run(cfg, lambda r, n: PlantingLoader(build_loader(cfg.data, r, n), rank_here=rank == 1, plant=range(5, 99)))
            result["streak"] = None
        except JobInputError as e:
            result["streak"] = str(e)
    finally:
        step_mod.forward_loss_sum = forward
    (work / f"result-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
