"""tools/gpu_check.sh's skeleton on a CPU: the report's shape, the time box, the exit status. What the parts
measure needs a GPU and runs where one is lent (BENCHMARKS.md, GPU check)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ["versions", "shards", "train_headrace", "train_plain", "train_eager", "gpu_tests", "kernels", "moe",
         "train_webdataset", "smoke", "speech_recipe"]


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    report = tmp_path / "report.md"
    proc = subprocess.run(["bash", str(REPO / "tools/gpu_check.sh"), "--report", str(report), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHON=sys.executable, GPU_CHECK_TIMEOUT_VERSIONS="300", **env))
    return proc, report.read_text()


def test_dry_run_reports_versions_and_lists_every_part(tmp_path):
    proc, report = _run(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert report.startswith("# GPU check: ") and "`bash tools/gpu_check.sh --dry-run`" in report
    table = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith(("| part", "| ---"))]
    assert [row.split(" | ")[0][2:] for row in table] == PARTS
    assert table[0].startswith("| versions | ok |")
    for row in table[1:]:
        assert " | dry-run | " in row or " | skipped: " in row, row
    import torch
    import transformers

    versions = report[report.index("## versions"):report.index("## shards")]
    assert f"torch {torch.__version__}" in versions and f"transformers {transformers.__version__}" in versions
    assert "device: " in versions and "nvidia-smi" in versions and "flash_attn " in versions
    for name in PARTS:
        assert f"## {name}\n\n$ " in report
    assert "-m tools.bench_train --config configs/llama_1b.yaml --device cuda" in report
    assert "--sources plain" in report and "-m pytest" in report and " -m gpu " in report
    assert "tools/speech_recipe.sh --manifest demo/corpus_asr_gpu/audio_manifest.jsonl" in report
    assert "distributed.compile=false" in report


def test_a_part_whose_box_no_longer_fits_the_budget_is_skipped_and_reported(tmp_path):
    proc, report = _run(tmp_path, "--parts", "versions,kernels", "--budget", "400", GPU_CHECK_TIMEOUT_KERNELS="500")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split(" | ")[0][2:]: line for line in report.splitlines() if line.startswith("| ")}
    assert " | ok | " in rows["versions"]
    assert " | skipped: budget (" in rows["kernels"] and "of 400s, box 500s)" in rows["kernels"]


def test_a_part_past_its_box_is_reported_and_the_others_still_run(tmp_path):
    proc, report = _run(tmp_path, "--parts", "kernels,versions", GPU_CHECK_TIMEOUT_KERNELS="1")
    assert proc.returncode == 1
    rows = {line.split(" | ")[0][2:]: line for line in report.splitlines() if line.startswith("| ")
            and not line.startswith("| ---")}
    assert set(rows) == {"part", "versions", "kernels"}
    assert " | ok | " in rows["versions"] and " | timed out after 1s | " in rows["kernels"]
    assert "## kernels\n\n$ " in report and "status: timed out after 1s" in report


def test_unknown_part_is_one_line_exit_2(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "tools/gpu_check.sh"), "--parts", "versions,nope"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("gpu_check: unknown part 'nope'")
