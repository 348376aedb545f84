"""ruff over the tree with the rules pyproject.toml adopts ([tool.ruff.lint]: pyflakes, statement and syntax
errors, bugbear...): a new unused import, undefined name or mutable default fails here. Cost: ~0.3 s."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_ruff_check_passes():
    proc = ruff("check", "--no-cache", ".")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_check_catches_an_unused_import_and_an_undefined_name(tmp_path):
    """The configured rules are live: a file with both faults fails under the project's settings."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    proc = ruff("check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(bad))
    assert proc.returncode == 1 and "F401" in proc.stdout and "F821" in proc.stdout, proc.stdout


def test_tree_is_formatted():
    """``ruff format --check``: fails until tools/format.sh has formatted the tree once (run by whoever merges,
    after the branches that edit Python files are in); from then on it keeps the tree formatted."""
    proc = ruff("format", "--check", "--no-cache", ".")
    assert proc.returncode == 0, "run `bash tools/format.sh`:\n" + proc.stdout[-4000:]
