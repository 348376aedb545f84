"""Compute stragglers show in the per-rank telemetry: 2 gloo ranks, one made slower in its forward, named by
every rank's record (tests/dist/straggler.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_slow_rank_is_named_the_compute_straggler(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for slow_rank in (1,):  # not rank 0, which writes the logs
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               str(REPO / "tests" / "dist" / "straggler.py"), str(tmp_path / str(slow_rank)),
                               str(slow_rank)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        assert proc.stdout.count("OK straggler named") == 2, proc.stdout[-3000:]
