"""Which checkpoints a job may load: a seal written at save, checked before DCP reads anything.

torch DCP unpickles a checkpoint's ``.metadata`` (and the small non-tensor items inside the ``.distcp``
files), so loading a checkpoint directory someone else wrote can run their code. At save, rank 0 records in
``trainer_state.json`` the size of every file of the step directory and an HMAC-SHA256 of ``.metadata`` plus
the state itself, keyed by ``checkpoints/.seal-key`` (32 random bytes made by the first save of the run,
mode 0600, never inside a step directory). Before loading, ``check`` re-reads that state and:

- a file missing or of another size, a state file that does not parse: the checkpoint is *incomplete*
  (a crash or a full disk during the save, a copy cut short): the trainer falls back to the previous one;
- sizes right but the HMAC differs, or no seal at all: the directory was not written by this run's
  saves: *refused*, one line, nothing unpickled.

Cost: hashing ``.metadata`` (kilobytes to a few MB) and the state JSON, and one ``stat`` per file; the
``.distcp`` data files (gigabytes) are checked by size only, so a same-size edit of their bytes is not
caught (README, security notes).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

KEY_FILE = ".seal-key"
METADATA = ".metadata"


class Incomplete(Exception):
    """The checkpoint was cut short (a file missing, truncated, or a state file that does not parse)."""


class NotSealed(Exception):
    """The checkpoint was not written by this run's saves (no seal, or a seal that does not match)."""


def seal_key(folder: Path, *, create: bool) -> bytes | None:
    """The run's key in ``folder`` (the ``checkpoints/`` directory); made once when ``create``."""
    path = folder / KEY_FILE
    if not path.is_file():
        if not create:
            return None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
            f.flush()
            os.fsync(f.fileno())
    return path.read_bytes()


def file_sizes(step_dir: Path, state_file: str) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(step_dir.iterdir()) if p.is_file() and p.name != state_file}


def _digest(key: bytes, step_dir: Path, state: dict) -> str:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update((step_dir / METADATA).read_bytes())
    mac.update(json.dumps({k: v for k, v in state.items() if k != "seal"}, sort_keys=True).encode())
    return mac.hexdigest()


def seal(state: dict, step_dir: Path, key: bytes, state_file: str) -> dict:
    """``state`` with its ``files`` (sizes) and ``seal`` (HMAC) for the DCP files already in ``step_dir``."""
    state = {**state, "files": file_sizes(step_dir, state_file)}
    return {**state, "seal": _digest(key, step_dir, state)}


def check(step_dir: Path, key: bytes | None, state_file: str) -> dict:
    """The trainer state of ``step_dir`` once its seal holds; ``Incomplete`` / ``NotSealed`` (module docstring)."""
    try:
        state = json.loads((step_dir / state_file).read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested past Python's recursion limit
        raise Incomplete(f"{state_file} does not read ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
    if not isinstance(state, dict) or "seal" not in state or not isinstance(state["files"] if "files" in state else None,
                                                                            dict):
        raise NotSealed(f"{state_file} holds no seal (written by another job or an older headrace)")
    for name, size in state["files"].items():
        path = step_dir / name
        if not path.is_file():
            raise Incomplete(f"{name} is missing")
        if path.stat().st_size != size:
            raise Incomplete(f"{name} has {path.stat().st_size} bytes, {size} were written")
    if key is None:
        raise NotSealed(f"no {KEY_FILE} beside it (copy the writing run's checkpoints/{KEY_FILE} along with it)")
    if not hmac.compare_digest(_digest(key, step_dir, state), state["seal"]):
        raise NotSealed(f"its seal does not match this run's {KEY_FILE} ({METADATA} or {state_file} changed since "
                        "the save, or another run wrote it)")
    return state


__all__ = ["KEY_FILE", "Incomplete", "NotSealed", "check", "seal", "seal_key"]
