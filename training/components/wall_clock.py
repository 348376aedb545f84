"""The wall-clock budget of a run (``trainer.max_minutes``): how much of it is spent, on rank 0's clock.

``WallClock.spent()`` is the fraction of the budget gone since the clock was made (0 .. 1, capped), read on
rank 0 and broadcast (one scalar collective per call), so every rank stops after the same step and, with
``optim.schedule: minutes``, sets the same learning rate. The loop calls it once per step: after the step
(the stop test) and its value is the next step's schedule position. Without a budget it is always 0.
``minutes()`` is the local elapsed time each validation record carries (curves against wall time).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class WallClock:
    def __init__(self, minutes: float | None, device: torch.device):
        self.seconds = None if minutes is None else minutes * 60.0
        self.device = device
        self.start = time.perf_counter()
        self.fraction = 0.0  # as of the last ``spent()``

    def spent(self) -> float:
        """The budget's fraction used so far (rank 0's clock, capped at 1); 0 without a budget."""
        if self.seconds is None:
            return 0.0
        local = min(1.0, (time.perf_counter() - self.start) / self.seconds)
        value = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.broadcast(value, src=0)
        self.fraction = float(value.item())
        return self.fraction

    def minutes(self) -> float:
        """Wall minutes since the clock was made (this rank's clock: what a curve's x axis reads)."""
        return round((time.perf_counter() - self.start) / 60.0, 3)

    def out_of_time(self) -> bool:
        """Whether the budget is spent (always False without one)."""
        return self.seconds is not None and self.spent() >= 1.0


__all__ = ["WallClock"]
