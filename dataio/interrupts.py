"""Ctrl-C in the ``dataio`` verbs' worker processes: the exit status and the rule a worker follows.

SIGINT reaches every process of the terminal's group; the parent says "interrupted" once (exit 130), so a worker
ends at once and silently. Its own module, below ``headrace.dataio.usererror`` and the verbs that start workers,
so both import it and neither imports the other for it.
"""

from __future__ import annotations

import os
import signal

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


def leave_interrupt_to_parent() -> None:
    """In a worker process (a pool's initializer): Ctrl-C reaches every process of the terminal's group; the
    parent says "interrupted" once, so a worker ends at once and silently (no traceback of its own). What it
    left half-written is a temp file its command removes or redoes on the next run."""
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(EXIT_INTERRUPTED))


__all__ = ["EXIT_INTERRUPTED", "leave_interrupt_to_parent"]
