"""A full disk (a file-size limit: the writes fail as on a full disk) during the ``hf/`` export is one line naming
what could not be written, exit 2 (issue 34 item 17); it was an ENOSPC / CheckpointException traceback. Through
``python -m headrace.training`` in a child process with ``RLIMIT_FSIZE`` lowered: the job's small files fit, the
export's weights do not (no checkpoint is saved, so the export is the first large write)."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys

from tests.helpers import REPO, child_env
from tests.loader_util import make_text_dataset


def _limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))


def test_export_on_a_full_disk_is_one_line(tmp_path):
    make_text_dataset(tmp_path / "d", [20])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "headrace.training",
            "--config",
            str(REPO / "configs" / "debug_llama.yaml"),
            "logging.console=false",
            "trainer.max_steps=1",
            "data.seq_len=64",
            "data.packing_buffer=8",
            "checkpoint.save_final=false",
            f"trainer.output_dir={tmp_path / 'out'}",
            f"data.datasets=[{{path: {tmp_path / 'd'}}}]",
        ],
        cwd=REPO,
        env=child_env(HEADRACE_DEBUG=None),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limit,
    )
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(ours) == 1 and ours[0].startswith("error: checkpoint") and "cannot write" in ours[0], ours
    assert str(tmp_path / "out") in ours[0] and not (tmp_path / "out" / "hf").exists(), ours
