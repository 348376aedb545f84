"""Whole-process timings of the tools a workflow runs: ``dataio VERB`` of a checkout, ``energon prepare``,
and the disk's sequential write speed (``dd``).

These time what a user waits for, interpreter start-up and imports included. ``time_dataio`` runs the
``dataio`` of any checkout (``repo``; default this one) so that a before/after pair comes from one run
on one machine state. Output is captured (stdout returned; stderr shown in the error on failure).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def time_dataio(argv: list[str], repo: Path = REPO) -> tuple[float, str]:
    """(wall seconds, stdout) of ``python -m headrace.dataio *argv`` run from ``repo`` (its own ``dataio``)."""
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "headrace.dataio", *argv],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    return time.perf_counter() - t, done.stdout


def time_energon_prepare(directory: Path, workers: int) -> float:
    """Seconds of ``energon prepare`` indexing the tars in ``directory`` (all train, CrudeWebdataset)."""
    t = time.perf_counter()
    subprocess.run(
        [
            str(Path(sys.executable).with_name("energon")),
            "prepare",
            str(directory),
            "--non-interactive",
            "--split-ratio",
            "1,0,0",
            "--sample-type",
            "CrudeWebdataset",
            "--num-workers",
            str(workers),
            "--no-progress",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    return time.perf_counter() - t


def dd_write_mb_per_s(directory: Path, mb: int) -> float:
    """MB/s of ``dd if=/dev/zero bs=1M conv=fdatasync`` into ``directory`` (the disk's sequential write)."""
    target = directory / "dd.bin"
    t = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mb}", "conv=fdatasync"],
        check=True,
        capture_output=True,
    )
    elapsed = time.perf_counter() - t
    target.unlink()
    return mb * 1.048576 / elapsed


__all__ = ["REPO", "dd_write_mb_per_s", "time_energon_prepare", "time_dataio"]
