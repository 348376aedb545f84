"""The fuzz harness's fixed seed set (tests/fuzz.py) in CI: every target, derandomized cases, in a
process of its own (the memory ceiling is a process limit). ``python -m tests.fuzz --long`` is the
hours-long mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import child_env

REPO = Path(__file__).resolve().parent.parent


def test_fuzz_seed_set():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fuzz"], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "derandomized cases per target passed" in proc.stdout
