"""tools/gpu_check.sh's skeleton on a CPU: the report's shape, the time box, the exit status. What the parts
measure needs a GPU and runs where one is lent (BENCHMARKS.md, GPU check)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = [
    "versions",
    "shards",
    "train_headrace",
    "train_torchtitan",
    "train_plain",
    "train_float8",
    "train_float8_rowwise",
    "train_offload",
    "float8_loss",
    "train_eager",
    "gpu_tests",
    "kernels",
    "moe",
    "lora",
    "train_webdataset",
    "smoke",
    "speech_recipe",
]


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    report = tmp_path / "report.md"
    proc = subprocess.run(
        ["bash", str(REPO / "tools/gpu_check.sh"), "--report", str(report), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHON=sys.executable, GPU_CHECK_TIMEOUT_VERSIONS="300", **env),
    )
    return proc, report.read_text()


def test_plan_reports_versions_and_lists_every_part(tmp_path):
    proc, report = _run(tmp_path, "--plan")
    assert proc.returncode == 0, proc.stderr
    assert report.startswith("# GPU check: ") and "`bash tools/gpu_check.sh --plan`" in report
    table = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith(("| part", "| ---"))]
    assert [row.split(" | ")[0][2:] for row in table] == PARTS
    assert table[0].startswith("| versions | ok |")
    for row in table[1:]:
        assert " | planned | " in row or " | skipped: " in row, row
    import torch
    import transformers

    versions = report[report.index("## versions") : report.index("## shards")]
    assert f"torch {torch.__version__}" in versions and f"transformers {transformers.__version__}" in versions
    assert "device: " in versions and "nvidia-smi" in versions and "flash_attn " in versions
    for name in PARTS:
        assert f"## {name}\n\n$ " in report
    assert "-m tools.bench_train --config configs/llama_1b.yaml --device cuda" in report
    assert "--sources plain" in report and "-m pytest" in report and " -m gpu " in report
    assert "tools/speech_recipe.sh --manifest demo/corpus_asr_gpu/audio_manifest.jsonl" in report
    assert "distributed.compile=false" in report
    assert "-m tools.bench_torchtitan" in report and "quantize.linear.float8={recipe_name: tensorwise}" in report
    assert "distributed.offload_policy=cpu" in report and "-m tools.loss_gap" in report


def test_a_part_whose_box_no_longer_fits_the_budget_is_skipped_and_reported(tmp_path):
    proc, report = _run(tmp_path, "--parts", "versions,kernels", "--budget", "400", GPU_CHECK_TIMEOUT_KERNELS="500")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split(" | ")[0][2:]: line for line in report.splitlines() if line.startswith("| ")}
    assert " | ok | " in rows["versions"]
    assert " | skipped: budget (" in rows["kernels"] and "of 400s, box 500s)" in rows["kernels"]


def test_a_part_past_its_box_is_reported_and_the_others_still_run(tmp_path):
    proc, report = _run(tmp_path, "--parts", "kernels,versions", GPU_CHECK_TIMEOUT_KERNELS="1")
    assert proc.returncode == 1
    rows = {
        line.split(" | ")[0][2:]: line
        for line in report.splitlines()
        if line.startswith("| ") and not line.startswith("| ---")
    }
    assert set(rows) == {"part", "versions", "kernels"}
    assert " | ok | " in rows["versions"] and " | timed out after 1s | " in rows["kernels"]
    assert "## kernels\n\n$ " in report and "status: timed out after 1s" in report


def test_unknown_part_is_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        ["bash", str(REPO / "tools/gpu_check.sh"), "--parts", "versions,nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith("gpu_check: unknown part 'nope'")


def test_loss_gap_passes_within_its_limit_and_fails_past_it(tmp_path):
    """tools.loss_gap, the float8_loss part's verdict: exit 0 within --max, 1 past it."""
    import json
    import subprocess
    import sys

    for name, loss in (("bf16", 4.00), ("close", 4.05), ("far", 4.20)):
        (tmp_path / f"{name}.json").write_text(
            json.dumps({"headrace": {"last_loss": loss, "tokens_per_s": 100.0, "max_mem_gib": 10.0}})
        )
    run = lambda other: subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.loss_gap",
            str(tmp_path / "bf16.json"),  # noqa: E731
            str(tmp_path / f"{other}.json"),
            "--max",
            "0.02",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    close, far = run("close"), run("far")
    assert close.returncode == 0 and "+1.25%" in close.stdout, close.stdout + close.stderr
    assert far.returncode == 1 and "+5.00%" in far.stdout


def _planted_checkout(tmp_path: Path, parts: dict[str, str]) -> Path:
    """A copy of the script and its CPU stand-in beside planted tools/<module>.py parts."""
    root = tmp_path / "checkout"
    (root / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools/gpu_check.sh", root / "tools")
    shutil.copytree(REPO / "tools/gpu_dry_run", root / "tools/gpu_dry_run")
    (root / "tools/__init__.py").write_text("")
    for module, source in parts.items():
        (root / f"tools/{module}.py").write_text(source)
    return root


def test_dry_run_stops_each_part_at_its_first_cuda_call_and_fails_a_broken_set_up(tmp_path):
    """kernels reaches the device in a child process (the whole part stops there, its file:line reported);
    moe breaks in its set-up, before any CUDA call: the dry run fails it, on the CPU."""
    root = _planted_checkout(
        tmp_path,
        {
            "bench_kernels": "import subprocess, sys, time, torch\n"
            "assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)\n"
            "subprocess.run([sys.executable, '-c', 'import torch; torch.zeros(1, device=\"cuda\")'])\n"
            "time.sleep(60)\n",  # never reached: the child's CUDA call ended the part
            "bench_moe": "raise SystemExit('planted: the part cannot parse its arguments')\n",
        },
    )
    report_path = tmp_path / "report.md"
    proc = subprocess.run(
        ["bash", str(root / "tools/gpu_check.sh"), "--dry-run", "--parts", "kernels,moe", "--report", str(report_path)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHON=sys.executable, GPU_CHECK_TIMEOUT_KERNELS="240", GPU_CHECK_TIMEOUT_MOE="240"),
    )
    report = report_path.read_text()
    rows = {line.split(" | ")[0][2:]: line for line in report.splitlines() if line.startswith("| ")}
    assert proc.returncode == 1, report
    assert " | dry-run: set-up ok, first CUDA call at <string>:1 | " in rows["kernels"], rows["kernels"]
    assert " | dry-run: failed before any CUDA call (exit 1) | " in rows["moe"]
    assert "planted: the part cannot parse its arguments" in report
    assert set(rows) == {"part", "---", "kernels", "moe"}


def _wheel(folder: Path, name: str, version: str, requires: list[str], size: int = 0) -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n".format(name, version)
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", meta)
        zf.writestr(f"{dist}/padding.bin", os.urandom(size))


def test_carry_check_names_an_open_requirement_and_a_carry_over_the_limit(tmp_path, capsys):
    from tools import gpu_carry

    versions = gpu_carry.pins(REPO / "constraints.txt")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.flac").write_bytes(b"x" * 1000)

    def check(requires_of_torchtitan: list[str], limit_mib: float) -> tuple[int, str]:
        wheels = tmp_path / f"whl{len(list(tmp_path.iterdir()))}"
        wheels.mkdir()
        for name, version in versions.items():
            _wheel(wheels, name, version, requires_of_torchtitan if name == "torchtitan" else [], size=2**16)
        code = gpu_carry.main(
            ["--out", str(wheels), "--offline", "--corpus", str(corpus), "--limit-mib", str(limit_mib)]
        )
        return code, capsys.readouterr().err

    # closed: an image package, a carried one at an accepted version, a marker that does not apply on the image
    ok = ["numpy", "datasets<4.8", "wandb", 'colorama; sys_platform == "win32"', "einops; python_version >= '3.10'"]
    assert check(ok, 64) == (0, "")
    code, err = check([*ok, "not-in-the-image>=1"], 64)
    assert code == 1 and "torchtitan needs not-in-the-image>=1: neither in the image nor carried" in err
    code, err = check(["datasets>=5"], 64)
    assert code == 1 and "torchtitan needs datasets>=5, carried datasets 4.7.0" in err
    code, err = check(ok, 1)
    assert code == 1 and "MiB, over the 1 MiB one call carries" in err
