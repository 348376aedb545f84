"""``JobInputError``: an input of the job (a data directory, a checkpoint, the output directory, a pretrained
folder) that the job refuses, found alike on every rank. It is a ``ConfigError``, so ``python -m headrace.training``
prints it once (rank 0), as one line, and exits 2 (``headrace.dataio.usererror``)."""

from __future__ import annotations

import contextlib

from headrace.config import ConfigError


class JobInputError(ConfigError):
    """An input of the job refused identically on every rank; the message names the key or file."""


@contextlib.contextmanager
def refused_as(where: str):
    """What transformers and torch raise for a value the user gave, while building what ``where`` names from it
    (a wrong type, a value out of range, a zero size: ``TypeError``, ``ValueError``, ``ArithmeticError``), as one
    ``JobInputError`` line naming ``where``: the same line, exit 2, before and after the process group starts. Wrap
    only a build from the user's values, so a bug elsewhere keeps its traceback."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        yield
    except (StrictDataclassError, TypeError, ValueError, ArithmeticError) as e:
        if isinstance(e, ConfigError):
            raise
        raise JobInputError(f"{where}: {' '.join(str(e).split()) or type(e).__name__}") from None


@contextlib.contextmanager
def named_write(path):
    """A write's ``OSError`` without a file name (a full disk, a file-size limit: raised by ``write``/``flush``) with
    ``path`` as its file name: a user's error, one line naming the file (``headrace.dataio.usererror``)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


__all__ = ["JobInputError", "named_write", "refused_as"]
