"""``python -m headrace.training.launch``: the sbatch script and its chain, the per-node torchrun commands, and the
errors, without a cluster (a real SLURM runs the script in test_multinode.py)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml


@pytest.fixture
def launch(capsys, monkeypatch):
    """``python -m headrace.training.launch ARGS`` in this process: (exit code, stdout, stderr)."""
    from headrace.training.launch import main

    def run(*args, env=None):
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse errors
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture
def job(tmp_path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"config": {"model_type": "llama"}},
                "data": {"datasets": [{"path": "d"}], "seq_len": 64},
                "trainer": {"output_dir": str(tmp_path / "run")},
            }
        )
    )
    return path


def test_sbatch_script_and_chain(job, tmp_path, launch):
    """--dry-run prints the script (valid bash) and K sbatch commands chained with afterany, one fresh seed
    each; a real submission writes the script and slurm/jobs.jsonl with the ids that sbatch returned."""
    args = [
        "--config",
        str(job),
        "--slurm",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--time",
        "04:00:00",
        "--jobs",
        "3",
        "--max-restarts",
        "2",
        "--sbatch-arg=--partition=gpu",
        "optim.lr=1e-4",
        "data.datasets=[{path: /data/a b}]",
    ]
    code, out, err = launch(*args, "--dry-run")
    assert code == 0, err
    script, _, submits = out.partition("\nsbatch ")
    submits = ("sbatch " + submits).strip().splitlines()
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=04:00:00",
        "#SBATCH --partition=gpu",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
    ):
        assert line in script.splitlines(), line
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    per_node = shlex.split(srun)[-1]  # what bash -c runs on every node
    for word in (
        '"--nnodes=$SLURM_JOB_NUM_NODES"',
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        '"--rdzv-endpoint=$RDZV_HOST:29500"',
        '"--rdzv-id=$SLURM_JOB_ID"',
        "--max-restarts=2",
        "optim.lr=1e-4",
        "'data.datasets=[{path: /data/a b}]'",
        '"trainer.data_seed=$DATA_SEED"',
    ):
        assert word in per_node, word
    assert '[ "$SLURM_NODEID" = 0 ] && IS_HOST=true' in per_node

    assert len(submits) == 3
    seeds = [int(shlex.split(s)[-1]) for s in submits]
    assert len(set(seeds)) == 3
    assert "--dependency" not in submits[0]
    assert "--dependency=afterany:JOB1" in submits[1] and "--dependency=afterany:JOB2" in submits[2]

    bin_dir = tmp_path / "bin"  # an sbatch that answers like SLURM's --parsable and records its arguments
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        '#!/bin/bash\necho "$@" >> "$SBATCH_LOG"\necho $((1000 + $(wc -l < "$SBATCH_LOG")))";cluster"\n'
    )
    (bin_dir / "sbatch").chmod(0o755)
    log = tmp_path / "sbatch.log"
    code, _, err = launch(*args, env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "SBATCH_LOG": str(log)})
    assert code == 0, err
    calls = log.read_text().splitlines()
    assert "--dependency=afterany:1001" in calls[1] and "--dependency=afterany:1002" in calls[2]
    jobs = [json.loads(line) for line in (tmp_path / "run" / "slurm" / "jobs.jsonl").read_text().splitlines()]
    assert [j["job_id"] for j in jobs] == ["1001", "1002", "1003"]
    assert [j["after"] for j in jobs] == [None, "1001", "1002"]
    assert [str(j["data_seed"]) for j in jobs] == [c.split()[-1] for c in calls]
    assert (tmp_path / "run" / "slurm" / "headrace.sbatch").read_text() == script


def test_torchrun_commands_by_hand(job, launch):
    """The command of each node: c10d with node 0 hosting the store, or static ranks."""
    common = [
        "--config",
        str(job),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--master",
        "10.0.0.1:29400",
        "--dry-run",
        "--max-restarts",
        "1",
    ]
    node0 = shlex.split(launch(*common, "--node-rank", "0")[1])
    node1 = shlex.split(launch(*common, "--node-rank", "1", "--local-addr", "10.0.0.2")[1])
    assert node0[0] == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    for word in (
        "--nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29400",
        "--max-restarts=1",
        "-m",
        "headrace.training",
    ):
        assert word in node0 and word in node1
    assert "--rdzv-conf=is_host=true" in node0 and "--rdzv-conf=is_host=false" in node1
    assert "--local-addr=10.0.0.2" in node1
    static = shlex.split(launch(*common, "--node-rank", "1", "--rdzv", "static")[1])
    assert {"--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29400"} <= set(static)


def test_errors_are_one_line(job, launch):
    code, _, err = launch("--config", str(job), "--nnodes", "2", "--node-rank", "2")
    assert code == 2 and "--node-rank 2 outside 0..1" in err
    code, _, err = launch("--config", str(job), "--slurm", "--dry-run", "trainer.eval_every=5")
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: ") and "trainer.eval_every=5 needs a data.val" in last


def test_failing_sbatch_says_its_own_message(job, tmp_path, launch):
    """Was a CalledProcessError traceback hiding sbatch's message (issue 25)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        '#!/bin/bash\necho "sbatch: error: invalid partition specified: gpux" >&2\nexit 1\n'
    )
    (bin_dir / "sbatch").chmod(0o755)
    code, _, err = launch(
        "--config",
        str(job),
        "--slurm",
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )
    assert code == 2
    assert err == "error: sbatch exited with status 1: sbatch: error: invalid partition specified: gpux\n"
