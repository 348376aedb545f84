"""The checkpoint directory's bookkeeping (``headrace.training.checkpoint.layout``): which step directory
counts as the latest, and a save that cannot finish names its directory in one line."""

from __future__ import annotations

import sys

from headrace.training.checkpoint import layout
from tests.helpers import REPO, child_env
from tests.loader_util import make_text_dataset
from tests.test_bad_input_trainer import BASE, datasets


def test_latest_ignores_partial_checkpoints(tmp_path):
    for name, complete in (
        ("step-00000002", True),
        ("step-00000004", True),
        ("step-00000006.tmp", True),
        ("step-00000008", False),
    ):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / layout.STATE_FILE).write_text("{}")
    assert layout.latest(tmp_path).name == "step-00000004"
    assert layout.latest(tmp_path / "missing") is None


def test_checkpoint_save_on_a_full_disk_names_the_directory(tmp_path):
    """A file-size limit (RLIMIT_FSIZE: the writes fail as on a full disk) under ``python -m headrace.training``: was a
    CheckpointException traceback; now one line naming the checkpoint directory, exit 2."""
    import resource
    import subprocess

    make_text_dataset(tmp_path / "d", [20])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "headrace.training",
            *BASE,
            f"trainer.output_dir={tmp_path / 'out'}",
            datasets(tmp_path / "d"),
        ],
        cwd=REPO,
        env=child_env(HEADRACE_DEBUG=None),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000)),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert ours == [
        f"error: checkpoint: cannot write {tmp_path / 'out' / 'checkpoints' / 'step-00000001.tmp'} "
        "(rank 0): File too large"
    ], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
