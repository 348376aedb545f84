"""Runs that survive the cluster (issue 45), through the trainer and the launcher: preemption signals save and
exit with the stated code, the rerun continues exactly; non-finite steps are skipped on every rank, named and
bounded; no checkpoint holds a non-finite tensor. One torchrun launch holds the trainer checks
(``tests.dist.cluster_checks``); the SLURM chain runs its generated script with fake ``sbatch`` / ``srun``."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.dist.train_common import TINY_LLAMA, save_pretrained_tiny
from tests.helpers import REPO, child_env, free_port, torchrun
from tests.loader_util import make_text_dataset

STEPS = 8
CHAIN_STEPS = 24  # the SLURM chain's, inside epoch 0 (30 steps of 4 documents): the signal lands well before the end


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Shards, a saved initial model (every run starts from it) and the job: async checkpoints every 3 steps."""
    root = tmp_path_factory.mktemp("cluster")
    make_text_dataset(root / "train", [60, 60])
    save_pretrained_tiny(root / "pretrained", {**TINY_LLAMA, "vocab_size": 1024})
    job = dict(
        model=dict(pretrained_path=str(root / "pretrained"), attn_implementation="headrace_varlen"),
        data=dict(datasets=[dict(path=str(root / "train"))], seq_len=64, batch_size=2, num_workers=0, packing="none"),
        optim=dict(lr=3e-3, warmup_steps=1, max_grad_norm=1.0),
        trainer=dict(max_steps=STEPS, log_every=1, device="cpu"),
        checkpoint=dict(interval=3, async_mode="async", export_hf=False),
        logging=dict(console=False, tensorboard=False),
    )
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    return root


def assert_all_finite(checkpoints: Path) -> list[str]:
    """Every tensor of every checkpoint under ``checkpoints`` is finite; returns the checkpoints' names."""
    names = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-"))
    for name in names:
        for file in (checkpoints / name).glob("*.safetensors"):
            for key, tensor in load_file(file).items():
                assert torch.isfinite(tensor).all(), f"{name}/{file.name}: {key}"
    return names


def metrics(out: Path) -> dict[int, dict]:
    """metrics.jsonl's train records by step (a resumed run's later lines win)."""
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def test_preemption_and_nonfinite_steps_on_two_ranks(work):
    """SIGTERM on rank 1 at a random batch (and again during the save): both ranks stop after the same step, save,
    raise the exit code; the rerun's losses equal the uninterrupted run's. A planted Inf-loss batch on rank 0 is
    skipped on both ranks (no parameter or AdamW step count moves), named with its samples, counted; three in a
    row stop the run with one line, the newest checkpoint from before them; no checkpoint holds a NaN/Inf."""
    signal_at = random.Random().randint(4, 7)
    proc = torchrun(2, "tests.dist.cluster_checks", work, signal_at, timeout=600, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    results = [json.loads((work / f"result-rank{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(results):
        reference = {int(k): v for k, v in result["reference"].items()}
        assert sorted(reference) == list(range(1, STEPS + 1))
        preempted = result["preempted"]
        assert preempted is not None and preempted["code"] == 75, (rank, signal_at, preempted)
        # the prefetcher reads ahead of the step, so the stop comes a few steps before the signalled batch (at
        # step 0, before any step, there is nothing to save: the rerun starts afresh)
        latest = preempted["latest"]
        saved = 0 if latest == "None" else int(Path(latest).name.removeprefix("step-"))
        assert saved < STEPS, (signal_at, saved)
        resumed = {int(k): v for k, v in result["resumed"].items()}
        assert sorted(resumed) == list(range(saved + 1, STEPS + 1)), (saved, resumed)
        for step, loss in resumed.items():
            assert loss == pytest.approx(reference[step], rel=1e-6), (rank, step)

        planted = result["planted"]
        changed = {int(k): v for k, v in planted["changed"].items()}
        assert changed == {s: s != 3 for s in range(1, STEPS + 1)}, (rank, changed)
        assert {int(k): v for k, v in planted["nonfinite_steps"].items()} == {
            s: int(s == 3) for s in range(1, STEPS + 1)
        }
        assert result["streak"].startswith("trainer.max_bad_steps: 3 steps in a row"), result["streak"]
        assert "\n" not in result["streak"]
    named = [line for line in log.splitlines() if ": step 3: non-finite loss or grad norm" in line]
    assert sorted(line.split(":")[0] for line in named) == ["rank 0", "rank 1"], named
    keys = results[0]["planted"]["keys"]
    assert len(keys) == 1 and all(key in next(n for n in named if n.startswith("rank 0")) for key in keys[0])
    assert "preempted: step" in log and "exit code 75" in log
    # the streak: batches 5.. bad on rank 1 -> steps 5, 6, 7 skipped; the step-6 save waits; step 3 stays newest
    assert "checkpoint of step 6 not written" in log
    assert assert_all_finite(work / "streak" / "checkpoints") == ["step-00000003"]
    assert assert_all_finite(work / "planted" / "checkpoints")[-1] == f"step-{STEPS:08d}"
    assert assert_all_finite(work / "preempted" / "checkpoints")[-1] == f"step-{STEPS:08d}"


def test_cli_exits_with_the_stated_code(work, tmp_path):
    """``python -m headrace.training`` sent SIGTERM mid-run: saves the step it stopped after, exits 75 (or the
    configured code); the seconds from the signal to the exit are printed for BENCHMARKS.md."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "headrace.training", "--config", str(work / "job.yaml"),
           f"trainer.output_dir={out}", "trainer.max_steps=200", "checkpoint.interval=0",
           "trainer.preemption.exit_code=42"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=300)
    print(f"signal to exit: {time.monotonic() - sent:.2f} s")
    assert proc.returncode == 42, log[-3000:]
    last = max(metrics(out))
    assert f"preempted: step {last} saved in " in log and "; exit code 42" in log, log[-3000:]
    assert assert_all_finite(out / "checkpoints") == [f"step-{last:08d}"]


FAKE_SRUN = """#!/bin/bash
# srun: run the task (the last argument is bash -c's script) on this host; on the first job, once the trainer
# logged step $SIGNAL_AFTER, send SIGUSR1 to the task as SLURM's --signal does
cmd="${@: -1}"
bash -c "$cmd" &
task=$!
if [ ! -e "$WORK/signalled" ]; then
  until n=$(grep -c '"loss"' "$OUT/metrics.jsonl" 2>/dev/null); [ "${n:-0}" -ge "$SIGNAL_AFTER" ]; do
    kill -0 $task 2>/dev/null || break; sleep 0.05
  done
  touch "$WORK/signalled"; kill -USR1 $task
fi
wait $task
echo "task exit $?" >> "$WORK/srun.log"
"""

FAKE_SBATCH = """#!/bin/bash
# sbatch --parsable [--dependency=afterany:ID] SCRIPT SEED: runs the job now (afterany: after the previous one)
n=$(( $(cat "$WORK/jobs" 2>/dev/null || echo 0) + 1 )); echo $n > "$WORK/jobs"
script="${@: -2:1}"; seed="${@: -1}"
SLURM_JOB_ID=$((100 + n)) SLURM_JOB_NUM_NODES=1 SLURM_NODEID=0 SLURM_JOB_NODELIST=localhost \\
  bash "$script" "$seed" >> "$WORK/job-$n.out" 2>&1 || true
echo "$((100 + n))"
"""


def test_slurm_chain_resumes_from_the_preemption_checkpoint(work, tmp_path, process_group):
    """The launcher's generated script asks for SIGUSR1 ahead of the limit; under fake sbatch / srun / scontrol, the
    first job gets SIGUSR1 at step 3 (through the torchrun agent, which forwards it), saves and ends; the second job
    of the chain resumes from that checkpoint and finishes: its losses equal one uninterrupted process's."""
    from headrace.training.config.load import load_job_config
    from headrace.training.train import train

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("sbatch", FAKE_SBATCH), ("scontrol", "#!/bin/bash\necho localhost\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "run"
    env = child_env(PATH=f"{bin_dir}:{os.environ['PATH']}", WORK=str(tmp_path), OUT=str(out), SIGNAL_AFTER="3")
    proc = subprocess.run(
        [sys.executable, "-m", "headrace.training.launch", "--config", str(work / "job.yaml"), "--slurm", "--jobs",
         "2", "--nproc-per-node", "2", "--time", "00:10:00", "--signal-lead", "60", "--port",
         str(free_port()), f"trainer.output_dir={out}", f"trainer.max_steps={CHAIN_STEPS}"],  # fmt: skip
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    jobs = [(tmp_path / f"job-{n}.out").read_text() for n in (1, 2) if (tmp_path / f"job-{n}.out").exists()]
    assert proc.returncode == 0 and len(jobs) == 2, proc.stderr + "\n".join(jobs)[-4000:]
    script = (out / "slurm" / "headrace.sbatch").read_text()
    assert "#SBATCH --signal=USR1@60" in script and "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=60" in script
    assert "SIGUSR1" in jobs[0] and "preempted: step" in jobs[0], jobs[0][-3000:]
    assert (tmp_path / "srun.log").read_text().splitlines()[1] == "task exit 0"  # the second job ran to its end
    saved = int(jobs[0].split("preempted: step ")[1].split()[0])
    assert f"resumed from {out / 'checkpoints' / f'step-{saved:08d}'} at step {saved}" in jobs[1], jobs[1][-3000:]
    got = metrics(out)
    seed = json.loads((out / "slurm" / "jobs.jsonl").read_text().splitlines()[0])["data_seed"]
    reference = tmp_path / "reference"  # one process, the global batch of the two ranks, the first job's data seed
    overrides = [f"trainer.output_dir={reference}", "data.batch_size=4", f"trainer.data_seed={seed}",
                 f"trainer.max_steps={CHAIN_STEPS}"]  # fmt: skip
    train(load_job_config(str(work / "job.yaml"), overrides))
    want = metrics(reference)
    assert sorted(got) == sorted(want) == list(range(1, CHAIN_STEPS + 1))
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=2e-5), step


def test_pinned_save_buffers_exist_before_the_first_save(work, tmp_path, process_group, monkeypatch):
    """``async_with_pinned_mem``: every save, the first included, finds all its host buffers allocated (at start,
    before the first step) and adds none; the losses equal an ``async`` run's (the optimizer DCP initialised for
    the allocation is exactly a fresh one)."""
    from headrace.training.checkpoint import saver
    from headrace.training.config.load import load_job_config
    from headrace.training.train import train

    stage, kept = saver.stage, []

    def counting_stage(tensors, buffers, *, pin):
        if buffers is None:  # the async run: fresh memory every save
            return stage(tensors, buffers, pin=pin)
        before = dict(buffers)
        staged = stage(tensors, buffers, pin=pin)
        kept.append((len(before), all(buffers[k] is before.get(k) for k in buffers)))
        return staged

    monkeypatch.setattr(saver, "stage", counting_stage)
    runs = {}
    for mode in ("async_with_pinned_mem", "async"):
        overrides = [f"trainer.output_dir={tmp_path / mode}", "trainer.max_steps=5", "checkpoint.interval=2",
                     f"checkpoint.async_mode={mode}", "data.batch_size=4"]  # fmt: skip
        runs[mode] = {r["step"]: r["loss"] for r in train(load_job_config(str(work / "job.yaml"), overrides))}
    assert len(kept) == 3 and all(count > 0 and same for count, same in kept), kept  # saves at 2, 4, final 5
    assert runs["async_with_pinned_mem"] == runs["async"]
