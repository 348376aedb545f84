"""Errors of the user's making are one line; bugs keep their traceback. The bottom of the data layers: every
layer raises these errors, so this module imports nothing of ``headrace.dataio`` but ``interrupts``.

One rule for both entry points (``dataio`` and ``python -m headrace.training``): an exception is the user's
(a config value, a data file, a file-system path) when it is a ``ConfigError`` (``headrace.config``, below
``dataio``), a ``UserError`` or an ``OSError`` that names a file (missing, not a directory, permission denied,
disk full). Each input-error type of the layers above says it is the user's by deriving from ``UserError``:
``CommandError`` and ``SampleDecodeError`` (here), ``PrepareError``, ``SampleError``, ``OutputLocked``,
``TarFormatError``, a loader ``StateError``, a loader worker killed or hung (``WorkerDied``). Such an error is
printed as one line and the process exits with status 2; everything else is a bug and is re-raised with its
traceback. ``--debug`` or ``HEADRACE_DEBUG=1`` re-raises user errors too.
"""

from __future__ import annotations

import os

from headrace.config import ConfigError
from headrace.dataio.interrupts import EXIT_INTERRUPTED

DEBUG_ENV = "HEADRACE_DEBUG"
EXIT_USER_ERROR = 2


class UserError(Exception):
    """The base that makes an input-error type the user's (one line, exit status 2): a second base beside the
    type's own (``ValueError``, ``RuntimeError``, ...)."""


class CommandError(UserError):
    """A user-facing failure of a ``dataio`` verb: printed as one line, exit status 2 (or ``exit_code``)."""

    def __init__(self, message: str, exit_code: int = EXIT_USER_ERROR):
        super().__init__(message)
        self.exit_code = exit_code


class SampleDecodeError(ValueError, UserError):
    """A sample or its shard could not be read or decoded (every stage of the stream raises it, and counts it
    against ``data.max_bad_samples``); names the shard, sample key and member."""

    def __init__(self, reason: str, *, shard: str | None = None, key: str | None = None, member: str | None = None):
        self.reason, self.shard, self.key, self.member = reason, shard, key, member
        where = ", ".join(f"{k} {v!r}" for k, v in (("shard", shard), ("key", key), ("member", member)) if v)
        super().__init__(f"{where}: {reason}" if where else reason)


def is_user_error(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.filename is not None
    return isinstance(e, (ConfigError, UserError))


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
    "SampleDecodeError",
    "UserError",
    "debug_requested",
    "is_user_error",
    "one_line",
]
