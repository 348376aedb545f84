"""A job YAML (or an override) whose aliases expand without bound is one line, exit 2, at load time (issue 34
item 10): it used to hang in ``to_dict`` (``save_job_config``) for minutes, after the process group was up. Through
``python -m headrace.training``'s and the launcher's ``main``."""

from __future__ import annotations

import pytest

from tests.helpers import REPO

from headrace.training.__main__ import main as train_main
from headrace.training.launch import main as launch_main

BOMB = "    l0: &l0 [1]\n" + "".join(f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9))
SELF = "    loop: &loop [*loop]\n"  # PyYAML builds a list that holds itself


@pytest.mark.parametrize("body", [BOMB, SELF, "    deep: " + "[" * 700 + "]" * 700 + "\n"])
@pytest.mark.parametrize("entry", ["trainer", "launcher"])
def test_alias_bomb_under_model_config_is_one_line(tmp_path, capsys, monkeypatch, body, entry):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HEADRACE_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    base = (REPO / "configs" / "debug_llama.yaml").read_text()
    job = tmp_path / "job.yaml"
    assert "model:\n  config:\n" in base
    job.write_text(base.replace("model:\n  config:\n", "model:\n  config:\n" + body, 1))
    args = ["--config", str(job), f"trainer.output_dir={tmp_path / 'out'}"]
    code = train_main(args) if entry == "trainer" else launch_main(["--dry-run", *args])
    err = capsys.readouterr().err
    said = {BOMB: "expands to more than 1,000,000 values", SELF: "a YAML alias inside itself"}.get(
        body, "nested too deeply to read"
    )
    assert code == 2 and err.count("\n") == 1 and f"{job}: {said}" in err, err
    assert not (tmp_path / "out").exists()


def test_alias_bomb_in_an_override_is_one_line(tmp_path, capsys, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HEADRACE_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    value = (
        "{a: &a [1,1,1,1,1,1,1,1,1,1], "
        + ", ".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(6))
        + "}"
    )
    code = train_main(
        [
            "--config",
            str(REPO / "configs" / "debug_llama.yaml"),
            f"trainer.output_dir={tmp_path / 'o'}",
            f"model.config.extra={value}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "expands to more than" in err, err


def test_a_lone_surrogate_escape_is_one_line(tmp_path, capsys):
    """Found by the launcher fuzz target: ``"\\ud800"`` in a YAML value is a lone surrogate, which the launcher's
    script (and any file name) cannot hold: it was a UnicodeEncodeError traceback."""
    job = tmp_path / "job.yaml"
    job.write_text((REPO / "configs" / "debug_llama.yaml").read_text())
    code = launch_main(["--config", str(job), "--slurm", "--dry-run", 'trainer.output_dir="runs/\\ud800"'])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "unpaired surrogate" in err, err
