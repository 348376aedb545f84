"""A damaged ``trainer_state.json`` in the newest checkpoint (issue 34 item 18): nested 100,000 levels deep (it used
to be a RecursionError traceback) or cut short, the trainer falls back to the previous checkpoint; of another
shape (a number, ``files`` not a mapping), one line. Through ``python -m headrace.training``'s ``main``."""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO
from tests.loader_util import make_text_dataset

from headrace.training.__main__ import main


def _args(tmp_path, steps):
    return [
        "--config",
        str(REPO / "configs" / "debug_llama.yaml"),
        "logging.console=false",
        "checkpoint.export_hf=false",
        f"trainer.max_steps={steps}",
        "checkpoint.interval=1",
        "data.seq_len=64",
        "data.packing_buffer=8",
        "trainer.log_every=1",
        f"trainer.output_dir={tmp_path / 'out'}",
        f"data.datasets=[{{path: {tmp_path / 'd'}}}]",
    ]


@pytest.mark.parametrize(
    "content,falls_back",
    [
        (b"[" * 100_000 + b"]" * 100_000, True),
        (b'{"seal": "x", "fil', True),
        (b"3", False),
        (b'{"seal": "x", "files": [1]}', False),
    ],
)
def test_damaged_state_file_falls_back_or_is_one_line(tmp_path, capsys, one_rank, content, falls_back):
    make_text_dataset(tmp_path / "d", [40])
    assert main(_args(tmp_path, 2)) == 0
    newest = max((tmp_path / "out" / "checkpoints").glob("step-*"))
    (newest / "trainer_state.json").write_bytes(content)
    capsys.readouterr()
    code = main(_args(tmp_path, 3))
    err = capsys.readouterr().err
    if falls_back:  # resumed from step 1: steps 2 and 3 are logged again
        steps = [
            json.loads(line)["step"]
            for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line
        ]
        assert code == 0 and steps[-2:] == [2, 3], (err, steps)
    else:
        assert code == 2 and err.count("\n") == 1 and "trainer_state.json" in err, err
