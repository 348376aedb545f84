"""``python -m headrace.training.speech.eval`` gives one line, exit 2, for the user's inputs (issue 34 item 14): a
missing data directory or model, broken safetensors in the model, an utterance longer than the encoder's window
(named, before any decoding). Through its ``main``, in-process, on a tiny Qwen2-Audio checkpoint."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import soundfile
import webdataset as wds

from tests.loader_util import index_dir
from tests.test_speech_checkpoints import save_qwen2_audio

from headrace.training.speech.eval import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("speech_eval")
    save_qwen2_audio(root / "ckpt")
    (root / "long").mkdir()
    with wds.TarWriter(str(root / "long" / "utt-000000.tar")) as w:
        for key, seconds in (("short", 0.3), ("too-long", 3.0)):
            buf = io.BytesIO()
            soundfile.write(buf, np.full(int(16000 * seconds), 0.01, np.float32), 16000, format="FLAC")
            w.write({"__key__": key, "flac": buf.getvalue(), "json": json.dumps({"text": "a b"}).encode()})
    index_dir(root / "long")
    return root


def _broken_weights(root, tmp_path):
    shutil.copytree(root / "ckpt", tmp_path / "m")
    next((tmp_path / "m").glob("*.safetensors")).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    return tmp_path / "m", root / "long"


CASES = {
    "no_data": (lambda root, tmp: (root / "ckpt", tmp / "nope"), "error: --data: "),
    "no_model": (lambda root, tmp: (tmp / "nomodel", root / "long"), "error: --model: "),
    "broken_weights": (_broken_weights, "is not a readable safetensors file"),
    "too_long": (
        lambda root, tmp: (root / "ckpt", root / "long"),
        "error: --data: utterance 'too-long' is 3.00 s, longer than the qwen2_audio encoder's window of 0.8 s",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speech_eval_input_errors_are_one_line(saved, tmp_path, capsys, monkeypatch, case):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HEADRACE_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    make, said = CASES[case]
    model, data = make(saved, tmp_path)
    capsys.readouterr()
    code = main(["--model", str(model), "--data", str(data), "--split", "train", "--out", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and said in err, err
