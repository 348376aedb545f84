"""Write errors that name what they were writing: a full disk (``ENOSPC``) or a failing device shows up
in the middle of a ``write``, ``flush`` or ``fsync`` -- an ``OSError`` with no file name, which reads as a
bug -- or as sqlite's ``OperationalError: database or disk is full``. ``writing(path, what)`` turns
either into one ``OSError`` naming the path and what was being written (``headrace.dataio.usererror`` prints it
as one line, exit 2): "out/shard-000003.tar: No space left on device (writing the shard)"."""

from __future__ import annotations

import errno
import os
import sqlite3
from contextlib import contextmanager
from typing import Iterator

_MARK = " (writing "


@contextmanager
def writing(path: str | os.PathLike, what: str) -> Iterator[None]:
    try:
        yield
    except sqlite3.OperationalError as e:  # sqlite reports a full disk as its own error, naming nothing
        code = errno.ENOSPC if "full" in str(e) else errno.EIO
        raise OSError(code, f"{e}{_MARK}{what})", os.fspath(path)) from e
    except OSError as e:
        if _MARK in str(e.strerror):  # named already, by an inner write
            raise
        raise OSError(e.errno, f"{e.strerror or e}{_MARK}{what})", os.fspath(path)) from e


__all__ = ["writing"]
