"""Ctrl-C (SIGINT) during training, ``dataio shard`` and ``dataio verify`` ends with one line, "interrupted", and
exit status 130, never a ``KeyboardInterrupt`` traceback (issue 34 item 11). The trainer is run as a real process
group with two loader workers and interrupted as a terminal does (SIGINT to the whole group); the ``dataio`` verbs
in-process, the signal sent from inside their work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from tests.helpers import REPO, child_env
from tests.loader_util import make_text_dataset

from headrace.dataio.cli import main as dataio


def _interrupt_inside(monkeypatch, module, name):
    original = getattr(module, name)

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, interrupted)


def test_dataio_verify_and_shard_say_interrupted(tmp_path, capsys, monkeypatch):
    import headrace.dataio.prepare.job as job
    import headrace.dataio.shards.verify as verify

    make_text_dataset(tmp_path / "d", [4, 4])
    _interrupt_inside(monkeypatch, verify, "verify_shard")
    assert dataio(["verify", str(tmp_path / "d"), "--quiet", "--workers", "1"]) == 130
    assert capsys.readouterr().err == "dataio verify: interrupted\n"
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(20)))
    _interrupt_inside(monkeypatch, job, "write_shard")
    assert dataio(["shard", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out"), "--quiet"]) == 130
    assert capsys.readouterr().err == "dataio shard: interrupted\n"


def test_trainer_with_loader_workers_says_interrupted(tmp_path):
    make_text_dataset(tmp_path / "d", [200])
    proc = subprocess.Popen(
        [sys.executable, "-m", "headrace.training", "--config", str(REPO / "configs" / "debug_llama.yaml"),
         f"data.datasets=[{{path: {tmp_path / 'd'}}}]", "data.num_workers=2", "data.seq_len=64",
         "data.packing_buffer=8", "trainer.max_steps=100000", "trainer.log_every=1", "checkpoint.export_hf=false",
         "logging.tensorboard=false", f"trainer.output_dir={tmp_path / 'out'}"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        seen = []
        for line in proc.stderr:  # the console's step lines: training (and the loader's workers) are running
            seen.append(line)
            if "step" in line and "loss" in line:
                break
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole group
        rest = proc.stderr.read()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 130, "".join(seen)[-2000:] + rest[-3000:]
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest and rest.strip().endswith("interrupted"), rest
