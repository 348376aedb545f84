"""torchrun script: ``python -m headrace.training`` whose DP rank ``KILL_RANK`` SIGKILLs itself on its first attempt
when its loader hands out batch ``KILL_AT`` (so mid-run, after a checkpoint; torchrun's
``--max-restarts`` must bring the job back and the trainer resume from the newest checkpoint).

``torchrun ... -m tests.dist.train_killed KILL_RANK KILL_AT X.yaml [overrides]``
"""

from __future__ import annotations

import os
import signal
import sys

import torch.distributed as dist

from headrace.dataio import build_loader
from headrace.training.config.load import load_job_config
from headrace.training.train import train


class KillingLoader:
    """The real loader; on the first attempt, rank ``kill_rank`` dies with SIGKILL at batch ``kill_at``."""

    def __init__(self, loader, armed: bool, kill_at: int):
        self.loader, self.armed, self.kill_at = loader, armed, kill_at

    def __iter__(self):
        for i, batch in enumerate(self.loader, 1):
            if self.armed and i == self.kill_at:
                print(f"rank {dist.get_rank()}: SIGKILL at batch {i}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, states):
        self.loader.load_state_dict(states)

    def reseed(self, seed):
        return self.loader.reseed(seed)


def main() -> int:
    kill_rank, kill_at = int(sys.argv[1]), int(sys.argv[2])
    cfg = load_job_config(sys.argv[3], sys.argv[4:])
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    train(cfg, lambda r, n: KillingLoader(build_loader(cfg.data, r, n), first_attempt and r == kill_rank, kill_at))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
