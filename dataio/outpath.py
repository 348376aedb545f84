"""One rule for every command that writes a path the user names: an output must not be one of its inputs.

``refuse_input(out, inputs, option)`` raises a one-line ``CommandError`` (exit 2) when ``out`` is an input (the
same path once links are resolved, or the same file under another name: a hard link), or lies inside an input
folder (a dataset directory: writing there would change the data being read). ``write_file`` writes bytes to such a path with the file system's refusals (a full disk,
``/dev/full``, a permission) as one line naming it. Used by ``dataio get --out``, ``dataio shard --output`` and the
speech recipe's ``--out``. Cost: one ``realpath`` and ``stat`` per input named.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from headrace.dataio.usererror import CommandError


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(path))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): not the same file
        return False


def refuse_input(out: str | os.PathLike, inputs: Iterable[str | os.PathLike], option: str) -> None:
    """``CommandError`` when ``out`` (given as ``option``) is, or is inside, one of ``inputs``."""
    real_out = _real(out)
    for given in inputs:
        real_in = _real(given)
        if real_out == real_in or _same_file(Path(out), Path(given)):
            raise CommandError(f"{option} {out}: is the input {given}; write somewhere else")
        if real_in.is_dir() and real_out.is_relative_to(real_in):
            raise CommandError(f"{option} {out}: is inside the input {given}, which it would change; write elsewhere")


def write_file(out: str | os.PathLike, data: bytes, option: str) -> None:
    """``data`` into ``out``; an ``OSError`` (``/dev/full``, a full disk, a folder, a permission) as one line."""
    try:
        with open(out, "wb") as f:
            f.write(data)
    except OSError as e:
        raise CommandError(f"{option} {out}: cannot write: {e.strerror or e}") from None


__all__ = ["refuse_input", "write_file"]
