"""Symbolic links in a run's ``trainer.output_dir`` are refused before anything is written (issue 34 item 3): a
link where the job writes (its lock, ``config.yaml``, ``metrics.jsonl``, ``checkpoints/``, a file deep in it) would
make the trainer truncate the file it points to. Through ``python -m headrace.training``'s ``main``, one process."""

from __future__ import annotations

import os

import pytest

from tests.helpers import DEBUG_LLAMA_CLI
from tests.loader_util import make_text_dataset

from headrace.training.__main__ import main

BASE = [*DEBUG_LLAMA_CLI, "trainer.max_steps=1"]


@pytest.mark.parametrize(
    "name", [".headrace-train.lock", "config.yaml", "metrics.jsonl", "checkpoints", "checkpoints/step-1/.metadata"]
)
def test_a_link_inside_output_dir_is_refused_and_its_target_untouched(tmp_path, capsys, one_rank, name):
    make_text_dataset(tmp_path / "d", [20])
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    (out / name).symlink_to(victim)
    code = main([*BASE, f"trainer.output_dir={out}", f"data.datasets=[{{path: {tmp_path / 'd'}}}]"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: trainer.output_dir: {out / name} is a symbolic link out of it"), err
    assert err.count("\n") == 1 and victim.read_text() == "precious\n"
    assert sorted(os.listdir(out)) == sorted({name.split("/")[0]})  # nothing else written


def test_output_dir_itself_may_be_a_link_and_links_inside_it_stay(tmp_path, capsys, one_rank):
    """``output_dir`` a link to the storage; a link whose target stays inside (wandb's ``latest-run``) is kept."""
    make_text_dataset(tmp_path / "d", [20])
    (tmp_path / "storage" / "wandb" / "run-1").mkdir(parents=True)
    (tmp_path / "storage" / "wandb" / "latest-run").symlink_to("run-1")
    (tmp_path / "out").symlink_to(tmp_path / "storage")
    code = main([*BASE, f"trainer.output_dir={tmp_path / 'out'}", f"data.datasets=[{{path: {tmp_path / 'd'}}}]"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "storage" / "config.yaml").is_file()


def test_the_launcher_refuses_a_link_in_its_slurm_folder(tmp_path, capsys, monkeypatch):
    import yaml

    from headrace.training.launch import main as launch

    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch: the refusal must come before any submission
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "model": {"config": {"model_type": "llama"}},
                "data": {"datasets": [{"path": "d"}], "seq_len": 64},
                "trainer": {"output_dir": str(tmp_path / "run")},
            }
        )
    )
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "run" / "slurm").mkdir(parents=True)
    (tmp_path / "run" / "slurm" / "headrace.sbatch").symlink_to(victim)
    assert launch(["--config", str(job), "--slurm"]) == 2
    assert "is a symbolic link" in capsys.readouterr().err and victim.read_text() == "precious\n"
