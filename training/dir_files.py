"""Files read from a directory someone else wrote: a pretrained model, a speech-LLM checkpoint, a tokenizer.

Such a directory may hold symbolic links. A link is followed only when its real target stays inside the
directory, or inside the Hugging Face cache entry the directory is a snapshot of (``models--ORG--NAME/
snapshots/REV/x -> ../../blobs/SHA``, the hub's own layout); any other link is a ``JobInputError`` (a
``ValueError``: one line from every entry point) naming it, so a crafted ``merges.txt -> /etc/hostname`` is never
read, copied into an export, or shared on from there. JSON files are read as one object each, the error naming the
file. Cost: one ``realpath`` per file read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from headrace.training.errors import JobInputError


def _allowed_roots(root: Path) -> list[Path]:
    real = Path(os.path.realpath(root))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        return [real, real.parent.parent]
    return [real]


def file_inside(root: str | os.PathLike, name: str) -> Path | None:
    """``root/name`` when it is a file whose real path stays inside ``root`` (module docstring), None when there is
    no such file; JobInputError naming it for a link that leads out, or for something that is not a regular file."""
    path = Path(root) / name
    if not os.path.lexists(path):
        return None
    real = Path(os.path.realpath(path))
    if not any(real.is_relative_to(r) for r in _allowed_roots(Path(root))):
        raise JobInputError(
            f"{path}: a symbolic link to {real}, outside {root}; a model directory's files must be "
            "inside it (copy the file in, do not link it)"
        )
    if not real.is_file():
        raise JobInputError(f"{path}: not a regular file")
    return path


def files_inside(root: str | os.PathLike, pattern: str) -> list[Path]:
    """The files of ``root`` matching ``pattern`` (sorted), each checked by ``file_inside``."""
    return [file_inside(root, p.name) for p in sorted(Path(root).glob(pattern))]


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object in ``path``; JobInputError naming the file when it is not JSON or not an object (an
    ``OSError`` naming it when it cannot be read)."""
    try:
        value = json.loads(Path(path).read_bytes())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise JobInputError(f"{path}: not a JSON file ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(value, dict):
        raise JobInputError(f"{path}: holds a JSON {type(value).__name__}, not an object of settings")
    return value


__all__ = ["file_inside", "files_inside", "read_json_object"]
