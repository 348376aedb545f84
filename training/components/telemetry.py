"""Per-rank telemetry: every rank's step time, own compute time and data wait, gathered each logging step,
as max / mean and the rank that is worst on each.

A global throughput figure hides one slow node or one rank whose loader starves: the step is a
collective, so every rank's wall step time is the slowest rank's (the others wait inside the collectives),
but the *data wait* (time blocked in the loader) and the *compute* time differ. ``ComputeClock`` measures
each rank's own compute per step: on CUDA the GPU time between two events recorded around the step (at a
log step, the mean over the steps whose events have completed, without waiting for the others: they
count in the next window), on CPU the process's CPU time
(``time.process_time``: a rank blocked in a collective does not add to it, one burning cycles in its
forward does; it also counts the loader's read-ahead thread). One ``all_gather`` of a few float64 per
rank, on host tensors (gloo: the default group's CPU backend on CUDA jobs too, so no device sync), gives
every rank the spread at negligible cost.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist


class ComputeClock:
    """This rank's own compute time per step (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds, self.steps = 0.0, 0
        self.events: list[tuple] = []  # CUDA: (start, end) per step of the window, read at ``window_mean``

    @contextlib.contextmanager
    def step(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
        else:
            start = time.process_time()
            yield
            self.seconds += time.process_time() - start
        self.steps += 1

    def window_mean(self) -> float:
        """Mean compute seconds per step since the last call (CUDA: over the steps already done on the GPU)."""
        if self.cuda:
            finished = 0  # one stream: the steps complete in order, so the done ones are a prefix
            while finished < len(self.events) and self.events[finished][1].query():
                finished += 1
            done, self.events = self.events[:finished], self.events[finished:]
            self.seconds = sum(start.elapsed_time(end) for start, end in done) / 1e3
            self.steps = len(done)
        mean = self.seconds / max(self.steps, 1)
        self.seconds, self.steps = 0.0, 0
        return mean


def rank_spread(step_time: float, data_wait_frac: float, device: torch.device, compute_time: float) -> dict:
    """Max / mean over all ranks of the per-rank step time (s), own compute time per step (s) and data-wait
    fraction, plus which rank is the slowest, which computes longest (the straggler) and which waits most.
    A collective over the default group, on host tensors (``device`` is not used for it)."""
    mine = torch.tensor([step_time, data_wait_frac, compute_time], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    step, wait, compute = zip(*torch.stack(everyone).tolist())  # one read of the host tensor

    def spread(values: tuple[float, ...]) -> tuple[float, float, int]:
        return max(values), sum(values) / len(values), values.index(max(values))

    (step_max, step_mean, slowest), (wait_max, wait_mean, waiting), (compute_max, compute_mean, straggler) = (
        spread(step),
        spread(wait),
        spread(compute),
    )
    return {
        "step_time_max": step_max,
        "step_time_mean": step_mean,
        "slowest_rank": slowest,
        "compute_time_max": compute_max,
        "compute_time_mean": compute_mean,
        "slowest_compute_rank": straggler,
        "data_wait_max": wait_max,
        "data_wait_mean": wait_mean,
        "most_waiting_rank": waiting,
    }


def sum_over_dp(value: float, dp: int) -> float:
    """Sum over the dp ranks of a per-rank figure that every tp / cp / pp peer of a dp rank shares (the same
    batch's): the world's sum divided by the peers per dp rank. A host-tensor collective on the default group."""
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) * dp / dist.get_world_size()


__all__ = ["ComputeClock", "rank_spread", "sum_over_dp"]
