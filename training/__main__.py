"""``torchrun --nproc-per-node N -m training --config configs/X.yaml [a.b=c ...]`` (or ``python -m training``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from configtree import ConfigError


@contextlib.contextmanager
def process_group_closed():
    """Destroy the process group the body joined, also when it raises (torchrun entry points)."""
    try:
        yield
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    parser.add_argument("--config", required=True, help="job YAML (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-3 trainer.max_steps=20")
    args = parser.parse_args(argv)

    from training.config import load_job_config

    try:
        cfg = load_job_config(args.config, args.overrides)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from training.train import train

    with process_group_closed():
        try:
            train(cfg)
        except ConfigError as e:  # a rule that needs the world size or the model config (e.g. training.moe.check_moe)
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
