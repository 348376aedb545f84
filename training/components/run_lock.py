"""One training job per ``trainer.output_dir``: rank 0 holds a lock on ``OUTPUT_DIR/.headrace-train.lock``.

Two jobs on one directory would interleave ``metrics.jsonl``, rename each other's ``step-N`` checkpoints and
delete each other's in-progress saves, and both would finish. The lock is ``dataio``'s (``try_lock``: a POSIX
record lock, dropped by the kernel however the holder dies, carried by NFS's lock manager); the holder
writes who it is (host, pid, start time) into the file, so the refusal names it. Rank 0 takes it and every
rank learns the outcome (one broadcast), so a refused job fails on every rank with the same one line.
Cost: one open, one ``fcntl`` call and one small broadcast per job.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from headrace.dataio.shards.outdir import try_lock
from headrace.training.errors import JobInputError

LOCK_FILE = ".headrace-train.lock"


class OutputDirInUse(JobInputError):
    """``trainer.output_dir`` is held by another training job, or holds a symbolic link (the same on every rank:
    printed once)."""


def first_symlink(out_dir: Path) -> Path | None:
    """The first symbolic link inside ``out_dir`` (not following any) that leads out of it, else None. Every file
    the job writes lives under ``out_dir`` (lock, config.yaml, metrics, checkpoints, hf/, profile/); a link planted
    there would make the job truncate or overwrite the file it points to, wherever that is. A link whose target
    stays inside ``out_dir`` (wandb's ``latest-run``) writes nowhere else, and is left alone."""
    inside = os.path.realpath(out_dir)
    for parent, dirs, files in os.walk(out_dir):  # os.walk does not descend into linked directories
        for name in sorted(dirs + files):
            path = os.path.join(parent, name)
            if os.path.islink(path) and os.path.commonpath([inside, os.path.realpath(path)]) != inside:
                return Path(path)
    return None


def lock_output_dir(out_dir: Path):
    """Rank 0: the open, locked lock file (keep it open for the job); other ranks: None. Collective: every rank
    raises ``OutputDirInUse`` when another job holds the directory, or when a file or folder
    inside it is a symbolic link leading out of it (``out_dir`` itself may be one)."""
    held, refusal = None, None
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / LOCK_FILE
        if (link := first_symlink(out_dir)) is not None:
            refusal = (
                f"trainer.output_dir: {link} is a symbolic link out of it (to {os.readlink(link)}); the job "
                "writes only under its output_dir: remove the link, or point output_dir at the storage itself"
            )
        elif (held := try_lock(path)) is None:
            holder = path.read_text(errors="replace").strip() or "a process that wrote no name"
            refusal = (
                f"trainer.output_dir: {out_dir} is in use by another training job ({holder}); wait for it to "
                "finish or choose another output_dir"
            )
        else:
            try:
                held.truncate(0)
                held.write(
                    f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode()
                )
                held.flush()
            except OSError as e:  # a full disk: every rank learns it below (a raise here would leave them waiting)
                with contextlib.suppress(OSError):  # its buffer flushed again: the file closes all the same
                    held.close()
                held, refusal = None, f"trainer.output_dir: cannot write {path}: {e.strerror or e}"
    box = [refusal]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise OutputDirInUse(box[0])
    return held


__all__ = ["LOCK_FILE", "OutputDirInUse", "lock_output_dir"]
