"""One 4-rank gloo launch: SALM under FSDP2 and FSDP2 + TP + SP against a single-process reference, exact
resume, export of LLM + encoder + adapter, validation loss at dp 4 / dp 2 x tp 2 vs one process, eval during
training vs eval of the export; Whisper's encoder under FSDP2 x TP + activation checkpointing, and in bf16 frozen;
a Qwen2-Audio checkpoint trained in place under FSDP2 x TP + SP (see tests/dist/speech_layouts.py)."""

from __future__ import annotations

import pytest

from tests.helpers import torchrun


@pytest.mark.slow
def test_salm_layouts_match_single_process_and_resume(tmp_path):
    out = torchrun(4, "tests.dist.speech_layouts", tmp_path).stdout
    for check in (
        "fsdp2 matches",
        "fsdp2_tp_sp matches",
        "salm validation at dp4 and dp2 x tp2 equals",
        "whisper from scratch under fsdp2",
        "whisper_fsdp2_tp_ac matches",
        "whisper bf16 with a frozen encoder",
        "eval during training equals",
        "qwen2_audio checkpoint in place",
        "resume reproduces",
    ):
        assert out.count(f"OK {check}") == 4, out[-3000:]
