"""Per-rank telemetry: every rank's step time and data wait, gathered each logging step, as max / mean.

A global throughput figure hides one slow node or one rank whose loader starves: the step is a
collective, so every rank's step time is the slowest rank's, but the *data wait* (time blocked in the
loader) and the *compute-side* time differ. Each rank contributes its mean step time and data-wait
fraction over the logging window; one ``all_gather_single`` of 2 floats per rank (a flat output,
which gloo needs) gives rank 0 the spread and the rank that is worst on each, at negligible cost.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank_spread(step_time: float, data_wait_frac: float, device: torch.device) -> dict:
    """Max / mean over all ranks of the per-rank step time (s) and data-wait fraction, plus which rank is
    the slowest and which waits most. A collective over the default group."""
    mine = torch.tensor([step_time, data_wait_frac], dtype=torch.float64, device=device)
    everyone = torch.empty(2 * dist.get_world_size(), dtype=torch.float64, device=device)
    dist.all_gather_single(everyone, mine)
    per_rank = everyone.view(-1, 2).cpu()
    step, wait = per_rank[:, 0], per_rank[:, 1]
    return {"step_time_max": float(step.max()), "step_time_mean": float(step.mean()),
            "slowest_rank": int(step.argmax()), "data_wait_max": float(wait.max()),
            "data_wait_mean": float(wait.mean()), "most_waiting_rank": int(wait.argmax())}


__all__ = ["rank_spread"]
