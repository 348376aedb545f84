"""Preemption: a scheduler's warning signal becomes a checkpoint and a stated exit code.

SLURM (``--signal=USR1@120``, asked for by ``headrace.training.launch``) and cloud schedulers (SIGTERM) warn a job
a while before killing it. ``Preemption.install`` sets a handler for each of ``trainer.preemption.signals`` that
only records the signal: nothing else runs inside the handler, so a signal that lands in the middle of a save (the
second one: SLURM signals every process of the step, torchrun forwards it once more) interrupts nothing and only
adds to the count. Installed before the loader starts its worker processes, which fork with the handler and so
outlive a signal sent to the whole process group (torchrun's ``killpg``), leaving the shutdown to the trainer.

At every step boundary ``agreed()`` all-reduces (MAX) the flag over every rank, so all ranks stop after the same
step even when only one was signalled; the trainer then saves a checkpoint (waiting for a background save still
being written first) and raises ``Preempted``, a ``SystemExit`` with ``trainer.preemption.exit_code`` (default 75,
EX_TEMPFAIL: run again to continue; the SLURM chain's next job resumes from that checkpoint). The flag lives in
host memory (a numpy array the collective writes through a tensor view): on a CUDA job the default group's CPU
backend (gloo) carries it, so the step boundary never waits for the device. Cost: one 8-byte all-reduce per step.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import torch
import torch.distributed as dist

from headrace.training.config.job_config import PreemptionConfig


class Preempted(SystemExit):
    """The job stopped on a scheduler's signal after saving; ``code`` is ``trainer.preemption.exit_code``."""


class Preemption:
    """The signals' flag and its agreement over the ranks (module docstring)."""

    def __init__(self, cfg: PreemptionConfig):
        self.cfg = cfg
        self.received: list[str] = []  # signal names, in arrival order (host; set by the handler)
        self.previous: dict[signal.Signals, object] = {}
        self.flag = np.zeros(1, dtype=np.float64)  # the all-reduced flag, read without a tensor read
        self.stopped_at: int | None = None  # the step every rank stopped after
        self.since: float | None = None  # when the first signal arrived (perf_counter)

    def install(self) -> Preemption:
        """Handle ``cfg.signals`` from now on (the main thread only: Python's rule for signal handlers)."""
        for name in self.cfg.signals:
            sig = signal.Signals[name]
            self.previous[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame) -> None:
        if not self.received:
            self.since = time.perf_counter()
        self.received.append(signal.Signals(signum).name)

    def release(self) -> None:
        """Give the signals back their previous handlers."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def agreed(self, step: int) -> bool:
        """Whether any rank was signalled; the same answer on every rank (one host all-reduce). A collective."""
        self.flag[0] = float(bool(self.received))
        dist.all_reduce(torch.from_numpy(self.flag), op=dist.ReduceOp.MAX)
        if self.flag[0] and self.stopped_at is None:
            self.stopped_at = step
        return bool(self.flag[0])

    def reason(self) -> str:
        """What stopped the run, for the log."""
        said = self.received[0] if self.received else "another rank's signal"
        return f"{said} (x{len(self.received)})" if len(self.received) > 1 else said

    def exit(self) -> Preempted:
        """The exception that ends the process with the stated code."""
        return Preempted(self.cfg.exit_code)


__all__ = ["Preempted", "Preemption"]
