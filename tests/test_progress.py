"""`headrace.dataio.commands.progress`: a bar on a terminal's stderr, nothing (and no rich import) otherwise."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from headrace.dataio.commands.progress import progress_bar, shown, track

REPO = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quiet_or_not_a_terminal_yields_items_and_draws_nothing(monkeypatch, capsys):
    assert list(track(range(5), total=5, description="x")) == [0, 1, 2, 3, 4]  # pytest's stderr is no TTY
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert shown() and not shown(quiet=True)
    with progress_bar("x", total=3, quiet=True) as advance:
        advance(3)
    assert list(track("ab", total=2, description="x", quiet=True)) == ["a", "b"]
    assert sys.stderr.getvalue() == ""


def test_terminal_gets_a_bar_with_counts_and_rate(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setenv("TERM", "xterm")
    assert list(track(range(7), total=7, description="verifying", unit="shards")) == list(range(7))
    out = term.getvalue()
    assert "verifying" in out and "7/7" in out and "shards/s" in out


def test_scripted_runs_do_not_import_rich():
    code = (
        "import sys; from headrace.dataio.commands.progress import track; list(track(range(3), total=3, description='x')); "
        "sys.exit('rich' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.DEVNULL)
    assert result.returncode == 0
