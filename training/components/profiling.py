"""``trainer.profile: {start, steps}``: a torch.profiler trace of a few training steps, one file per rank.

The profiler runs only around the chosen steps (CPU activities, plus CUDA when the device is a GPU), so
the other steps pay nothing; each step is a ``train_step N`` range in the trace. At the end of the window
every rank writes ``profile/rank{R}.pt.trace.json``: Chrome's ``chrome://tracing`` / Perfetto open it, and
TensorBoard's profiler plugin reads the folder (the ``.pt.trace.json`` suffix is what it looks for).
A window that starts before a resumed run's first step is skipped (those steps already ran).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from headrace.training.config.job_config import ProfileConfig


class StepProfiler:
    """Wrap each step in ``with profiler.step(n):``; traces steps ``start .. start + steps - 1``."""

    def __init__(self, cfg: ProfileConfig | None, out_dir: Path, rank: int, device: torch.device):
        self.cfg, self.rank = cfg, rank
        self.path = Path(out_dir) / "profile" / f"rank{rank}.pt.trace.json"
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.active: profile | None = None

    @contextlib.contextmanager
    def step(self, step: int):
        cfg = self.cfg
        if cfg is None or not cfg.start <= step < cfg.start + cfg.steps:
            yield
            return
        if self.active is None and step == cfg.start:
            self.active = profile(activities=self.activities, record_shapes=True)
            self.active.start()
        if self.active is None:  # resumed inside the window: its first steps are gone, skip it
            yield
            return
        with record_function(f"train_step {step}"):
            yield
        if step == cfg.start + cfg.steps - 1:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when the run ends inside the window)."""
        if self.active is not None:
            self.active.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.active.export_chrome_trace(str(self.path))
            self.active = None


__all__ = ["StepProfiler"]
