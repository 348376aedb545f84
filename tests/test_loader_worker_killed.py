"""A loader worker killed under the trainer (SIGKILL, as the OOM killer does) ends the job with one line naming the
worker, its pid and the signal, exit 2 (issue 34 item 12); it used to be ``OSError: got end of file during message``
when the kill cut a message short. Through ``python -m headrace.training``'s ``main``, in-process, with two real
forked workers; worker 1 is killed as soon as it is started."""

from __future__ import annotations

import os
import signal

from tests.helpers import REPO
from tests.loader_util import make_text_dataset

from headrace.dataio.stream.reading import pool
from headrace.training.__main__ import main


def test_killed_worker_is_one_line_naming_it_and_the_signal(tmp_path, capsys, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HEADRACE_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    make_text_dataset(tmp_path / "d", [300])
    start, killed = pool.WorkerPool.__init__, []

    def start_then_kill(self, *args, **kwargs):
        start(self, *args, **kwargs)
        if not killed:
            killed.append(self.procs[1].pid)
            os.kill(self.procs[1].pid, signal.SIGKILL)

    monkeypatch.setattr(pool.WorkerPool, "__init__", start_then_kill)
    code = main(
        [
            "--config",
            str(REPO / "configs" / "debug_llama.yaml"),
            "logging.console=false",
            "checkpoint.export_hf=false",
            "trainer.max_steps=100000",
            "data.seq_len=64",
            "data.packing_buffer=8",
            "data.num_workers=2",
            f"trainer.output_dir={tmp_path / 'out'}",
            f"data.datasets=[{{path: {tmp_path / 'd'}}}]",
        ]
    )
    err = capsys.readouterr().err
    assert killed and code == 2 and err.count("\n") == 1, err
    assert f"(pid {killed[0]}) exited unexpectedly (killed by signal SIGKILL: Killed)" in err, err
