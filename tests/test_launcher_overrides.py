"""``python -m headrace.training.launch --slurm``: every override reaches the trainer exactly as given (issue 34
item 2). The generated per-node command is run through a real bash, with the trainer replaced by ``printf``, so
what bash would hand torchrun is compared word for word with what the user typed."""

from __future__ import annotations

import shlex
import subprocess

import pytest
import yaml

from headrace.training.launch import main


def _node_words(script: str, tmp_path) -> list[str]:
    """The words the per-node bash passes to torchrun, with the launcher's own variables set as SLURM would."""
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    per_node = shlex.split(srun)[-1].replace("exec ", "exec printf '%s\\n' ", 1)
    env = {
        "PATH": "/usr/bin:/bin",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NUM_NODES": "2",
        "RDZV_HOST": "node7",
        "SLURM_JOB_ID": "42",
        "DATA_SEED": "1234",
    }
    proc = subprocess.run(
        ["bash", "-c", per_node, "bash", "ONE", "TWO"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.splitlines()


@pytest.mark.parametrize(
    "value",
    [
        "runs/r$1",
        "runs/$(touch PWNED)",
        "runs/`touch PWNED`",
        "runs/it's $HOME",
        'runs/"$SLURM_JOB_ID"',
        "runs/a\\b;touch PWNED",
    ],
)
def test_override_values_reach_the_trainer_unexpanded(tmp_path, capsys, value):
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
    override = f"trainer.output_dir={tmp_path}/{value}"
    assert main(["--config", str(job), "--slurm", "--dry-run", "--nodes", "2", override, "optim.lr=1e-4"]) == 0
    script = capsys.readouterr().out.partition("\nsbatch ")[0]
    words = _node_words(script, tmp_path)
    assert words[words.index("--config") + 2 :] == [override, "optim.lr=1e-4", "trainer.data_seed=1234"]
    # the launcher's own variables still expand
    assert "--nnodes=2" in words and "--rdzv-endpoint=node7:29500" in words and "--rdzv-conf=is_host=true" in words
    assert not (tmp_path / "PWNED").exists()
    # the directory the launcher names is the one the trainer will use
    assert f"#SBATCH --output={tmp_path}/{value.replace('%', '%%')}/slurm/%x-%j.out" in script.splitlines()


@pytest.mark.parametrize(
    "args",
    [
        ["--sbatch-arg=--partition=gpu\ntouch PWNED"],
        ["--name", "../../escape"],
        ['trainer.output_dir="run\\ntouch PWNED"'],
    ],
)
def test_line_breaks_and_path_escapes_are_refused(tmp_path, capsys, args):
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
    try:
        code = main(["--config", str(job), "--slurm", "--dry-run", *args])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err and err[-1].startswith(("error:", "python -m")), err
