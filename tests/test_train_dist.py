"""Real gloo process groups on CPU: one 4-rank launch checks the chunked loss's gradients (fp32, bf16) and
runs every layout against a single-process reference (+ bf16, resume, export logits), one 2-rank launch
loads the 4-rank checkpoint and runs a compiled step (see tests/dist/train_layouts.py for the checks); one
4-rank launch trains every other family of ``headrace.training.models.families.TESTED_FAMILIES`` (tests/dist/train_families.py)."""

from __future__ import annotations

import pytest

from tests.dist.train_common import save_pretrained_tiny
from tests.helpers import torchrun


@pytest.mark.slow
def test_layouts_resume_and_reshard(tmp_path):
    save_pretrained_tiny(tmp_path / "pretrained")
    out = torchrun(4, "tests.dist.train_layouts", tmp_path, "layouts").stdout
    for check in (
        "chunked loss under fsdp2",
        "fsdp2_bf16 losses",
        "fsdp2 matches",
        "hsdp_ac matches",
        "ddp matches",
        "tp_sp matches",
        "fsdp2_tp_sp matches",
        "fsdp2_offload matches",
        "resume reproduces",
        "hf export logits equal",
        "fsdp2 dp=4 checkpoint resumes as hsdp",
        "fsdp2 dp=4 checkpoint resumes as dp2_tp2",
    ):
        assert out.count(f"OK {check}") == 4, out[-3000:]
    out = torchrun(2, "tests.dist.train_layouts", tmp_path, "reshard").stdout
    for check in ("as reshard_dp2", "as reshard_tp2", "OK float8 under fsdp2", "OK per-block compile"):
        assert out.count(check) == 2, out[-3000:]


@pytest.mark.slow
def test_families_match_single_process(tmp_path):
    from headrace.training.models.families import TESTED_FAMILIES

    out = torchrun(4, "tests.dist.train_families", tmp_path).stdout
    for family in TESTED_FAMILIES[1:]:  # llama: test_layouts_resume_and_reshard
        for check in ("hsdp_ac matches", "fsdp2_tp matches", "hf export loads"):
            assert out.count(f"OK {family} {check}") == 4, out[-3000:]
