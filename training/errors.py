"""``JobInputError``: an input of the job (a data directory, a checkpoint, the output directory, a pretrained
folder) that the job refuses, found alike on every rank. It is a ``ConfigError``, so ``python -m headrace.training``
prints it once (rank 0), as one line, and exits 2 (``headrace.dataio.usererror``)."""

from __future__ import annotations

from headrace.config import ConfigError


class JobInputError(ConfigError):
    """An input of the job refused identically on every rank; the message names the key or file."""


__all__ = ["JobInputError"]
