"""Real gloo process groups on CPU: one 4-rank launch checks the chunked loss's gradients (fp32, bf16) and
runs every layout against a single-process reference (+ bf16, resume, export logits), one 2-rank launch
loads the 4-rank checkpoint and runs a compiled step (see tests/dist/train_layouts.py for the checks); one
4-rank launch trains every other family of ``training.models.families.TESTED_FAMILIES`` (tests/dist/train_families.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from train_common import save_pretrained_tiny  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "dist" / "train_layouts.py"


def torchrun(nproc: int, *args, script: Path = SCRIPT) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(script), *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc.stdout


@pytest.mark.slow
def test_layouts_resume_and_reshard(tmp_path):
    save_pretrained_tiny(tmp_path / "pretrained")
    out = torchrun(4, tmp_path, "layouts")
    for check in ("chunked loss under fsdp2", "fsdp2_bf16 losses", "fsdp2 matches", "hsdp_ac matches",
                  "ddp matches", "tp_sp matches", "fsdp2_tp_sp matches", "resume reproduces", "hf export logits equal"):
        assert out.count(f"OK {check}") == 4, out[-3000:]
    out = torchrun(2, tmp_path, "reshard")
    for check in ("as reshard_dp2", "as reshard_tp2", "OK per-block compile"):
        assert out.count(check) == 2, out[-3000:]


@pytest.mark.slow
def test_families_match_single_process(tmp_path):
    from training.models.families import TESTED_FAMILIES

    out = torchrun(4, tmp_path, script=REPO / "tests" / "dist" / "train_families.py")
    for family in TESTED_FAMILIES[1:]:  # llama: test_layouts_resume_and_reshard
        for check in ("hsdp_ac matches", "fsdp2_tp matches", "hf export loads"):
            assert out.count(f"OK {family} {check}") == 4, out[-3000:]
