"""``checkpoint.keep_last``: which step folders a save may delete.

Only checkpoints this layout wrote and this user's key sealed count (``seal.sealed_by``): a stray
``step-N`` folder, a regular file or a link of that name, a copy cut short before its state file, another
user's or the former pickled layout are never counted and never deleted. The checkpoint just written is never
deleted, nor is any sealed one of a higher step (a previous run's, left by ``checkpoint.resume: false``): pruning
deletes the sealed checkpoints *older* than the one just written beyond the newest ``keep_last - 1`` of them.

Cost: one read of each candidate's ``trainer_state.json`` and an HMAC over it, once per save, on rank 0.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from headrace.training.checkpoint.layout import STEP_DIR
from headrace.training.checkpoint.seal import sealed_by


def prunable(folder: Path, keep_last: int | None, written: Path, key: bytes, state_file: str) -> list[Path]:
    """The step folders of ``folder`` that a save of ``written`` with ``keep_last`` deletes (oldest first)."""
    if not keep_last:
        return []
    step = int(STEP_DIR.match(written.name).group(1))
    older = []
    for path in folder.iterdir():
        match = STEP_DIR.match(path.name)
        if match is None or path.is_symlink() or not path.is_dir() or int(match.group(1)) >= step:
            continue
        if sealed_by(path, key, state_file):
            older.append((int(match.group(1)), path))
    older.sort()
    return [path for _, path in older[: max(0, len(older) - (keep_last - 1))]]


def prune(folder: Path, keep_last: int | None, written: Path, key: bytes, state_file: str) -> None:
    """Delete ``prunable``'s folders."""
    for path in prunable(folder, keep_last, written, key, state_file):
        shutil.rmtree(path)


__all__ = ["prunable", "prune"]
