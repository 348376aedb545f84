"""``torchrun --nproc-per-node N -m headrace.training --config configs/X.yaml [a.b=c ...]`` (or ``python -m headrace.training``).

Errors of the user's making (``headrace.dataio.usererror``: config, data, paths) are one line and exit status 2
on every rank; a config error is the same on every rank, so only rank 0 prints it, while a data error
(one rank's shard) is printed by the rank that met it. ``--debug`` / ``HEADRACE_DEBUG=1`` show the
traceback; bugs always do.
"""

from __future__ import annotations

import argparse
import os
import sys

from headrace.config import ConfigError
from headrace.dataio.usererror import EXIT_INTERRUPTED, EXIT_USER_ERROR, debug_requested, is_user_error, one_line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m headrace.training", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="job YAML (see configs/)")
    parser.add_argument("--debug", action="store_true", help="tracebacks for input errors too (HEADRACE_DEBUG=1)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-3 trainer.max_steps=20")
    args = parser.parse_args(argv)
    # deferred, these three: the CLI's --help and argument errors load no torch
    from headrace.training.config.load import load_job_config
    from headrace.training.distributed.process_group import process_group_closed
    from headrace.training.train import train

    rank = int(os.environ.get("RANK", 0))
    with process_group_closed():
        try:
            train(load_job_config(args.config, args.overrides))
        except KeyboardInterrupt:  # Ctrl-C reaches every rank: one line; the next run resumes from the last checkpoint
            if rank == 0:
                print("interrupted", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        except Exception as e:
            if not is_user_error(e) or debug_requested(args.debug):
                raise
            if isinstance(e, ConfigError):  # the same on every rank
                if rank == 0:
                    print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
            else:
                print(f"error (rank {rank}): {one_line(e)}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
