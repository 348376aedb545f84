"""Errors of the user's making are one line; bugs keep their traceback.

One rule for both entry points (``dataio`` and ``python -m headrace.training``): an exception is the user's
(a config value, a data file, a file-system path) when it is one of the project's input-error types
(``ConfigError``, ``CommandError``, ``PrepareError``, ``OutputLocked``, the shard/sample/tar format
errors, ``SampleError``, a loader ``StateError``, a loader worker killed or hung: ``WorkerDied``) or an
``OSError`` that names a file (missing, not a directory, permission denied, disk full). Such an error
is printed as one line and the process exits with status 2; everything else is a bug and is re-raised
with its traceback. ``--debug`` or ``HEADRACE_DEBUG=1`` re-raises user errors too.
"""

from __future__ import annotations

import os

from headrace.dataio.interrupts import EXIT_INTERRUPTED

DEBUG_ENV = "HEADRACE_DEBUG"
EXIT_USER_ERROR = 2


class CommandError(Exception):
    """A user-facing failure of a ``dataio`` verb: printed as one line, exit status 2 (or ``exit_code``)."""

    def __init__(self, message: str, exit_code: int = EXIT_USER_ERROR):
        super().__init__(message)
        self.exit_code = exit_code


def _user_error_types() -> tuple[type, ...]:
    # imported on the first error, not at start-up: these modules pull in numpy, soundfile and torch
    from headrace.config import ConfigError
    from headrace.dataio.loader_state import StateError
    from headrace.dataio.prepare.job import PrepareError
    from headrace.dataio.prepare.readers import SampleError
    from headrace.dataio.shards.outdir import OutputLocked
    from headrace.dataio.shards.tarscan import TarFormatError
    from headrace.dataio.stream.reading.decode import SampleDecodeError
    from headrace.dataio.stream.reading.pool import WorkerDied

    return (
        ConfigError,
        CommandError,
        OutputLocked,
        PrepareError,
        SampleDecodeError,
        SampleError,
        StateError,
        TarFormatError,
        WorkerDied,
    )


def is_user_error(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.filename is not None
    return isinstance(e, _user_error_types())


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(e: BaseException) -> str:
    """The message of ``e`` as one line (an error re-raised from a loader worker is the worker's own
    exception, its traceback in a note, not in the text)."""
    text = str(e).strip()
    if isinstance(e, OSError) and e.filename is not None:
        text = f"{e.filename}: {e.strerror or text}"
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return lines[0]


__all__ = [
    "DEBUG_ENV",
    "EXIT_INTERRUPTED",
    "EXIT_USER_ERROR",
    "CommandError",
    "debug_requested",
    "is_user_error",
    "one_line",
]
