"""The README's quick start, as written: every command of its "Quick start" section, parsed from the README's
``bash`` blocks (so the two cannot drift), run by bash in a scratch checkout-like folder (``configs/`` linked
in) on a tiny corpus, with a few overrides appended that keep it short (2 trainer steps, 4 bench batches).
Then what each job promises is checked: shards that verify, a trained run with its metrics and ``hf/``
export, a bench report, the launcher's dry runs. Cost: ~20-30 s, most of it the 2-process torchrun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env
from tests.test_shard import sentence, write_tokenizer

# Appended to commands, by what they start; every other command runs exactly as written.
TINY = {
    "torchrun ": ["trainer.max_steps=2", "logging.console=false", "data.packing_buffer=8"],
    "dataio bench ": ["--batches", "4"],
}


def quick_start_commands(readme: str) -> dict[str, list[str]]:
    """``### title`` -> its commands, from the ``bash`` blocks of the ``## Quick start`` section: continuation
    lines joined, comments and blank lines dropped."""
    section = re.search(r"^## Quick start.*?$(.*?)(?=^## )", readme, re.S | re.M)
    assert section, "README has no '## Quick start' section"
    jobs = {}
    for part in re.split(r"^### ", section.group(1), flags=re.M)[1:]:
        title = part.splitlines()[0].strip()
        blocks = re.findall(r"^```bash\n(.*?)^```", part, re.S | re.M)
        text = "\n".join(blocks).replace("\\\n", " ")
        jobs[title] = [
            line.split("  #")[0].strip()
            for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
    return jobs


def with_tiny_overrides(command: str) -> str:
    for start, extra in TINY.items():
        if command.startswith(start):
            return " ".join([command, *extra])
    return command


def test_the_parser_finds_the_commands():
    readme = (
        "intro\n## Quick start\n### 1. A\n```bash\nfoo --a \\\n    --b  # note\n# comment\n```\n### 2. B\n"
        "```bash\nbar\n```\n## Next\n```bash\nnot this\n```\n"
    )
    assert quick_start_commands(readme) == {"1. A": ["foo --a      --b"], "2. B": ["bar"]}


@pytest.mark.slow
def test_every_quick_start_command_runs_on_a_tiny_corpus(tmp_path):
    jobs = quick_start_commands((REPO / "README.md").read_text())
    assert len(jobs) == 4 and all(jobs.values()), jobs
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "corpus").mkdir()
    write_tokenizer(tmp_path / "corpus")
    with open(tmp_path / "corpus" / "text.jsonl", "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": sentence(i, 20 + i % 50)}) + "\n")
    env = child_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    outputs = {}
    for title, commands in jobs.items():
        for command in commands:
            proc = subprocess.run(
                ["bash", "-c", with_tiny_overrides(command)],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 0, f"{title}: {command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            outputs[command] = proc.stdout
    # 1. the shards: verified, split into train and val
    assert any("OK" in out for cmd, out in outputs.items() if cmd.startswith("dataio verify"))
    assert (tmp_path / "shards" / "text" / ".nv-meta").is_dir()
    # 2. the run: 2 logged steps with finite losses, an hf/ export
    run = tmp_path / "runs" / "quickstart"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] > 0 for r in records)
    assert (run / "hf" / "config.json").is_file()
    # 3. the bench report
    assert json.loads((tmp_path / "bench-out" / "results.json").read_text())
    # 4. the launcher's dry runs: the sbatch chain, and this node's torchrun
    launches = [out for cmd, out in outputs.items() if cmd.startswith("python -m headrace.training.launch")]
    assert any("sbatch --parsable --dependency=afterany" in out for out in launches)
    assert any("--nnodes=2" in out and "--rdzv-endpoint=10.0.0.1:29500" in out for out in launches)
