"""Preemption on the demo model: seconds from SIGTERM to the job's exit, beside one step and one blocking save.

    OMP_NUM_THREADS=1 python -m tools.bench_preemption --work /tmp/preempt [--after 8] [--rounds 2]

Builds the demo corpus and its text shards under ``--work`` (``tools.demo_corpus``, ``dataio shard``), then per
round runs the demo job (``configs/demo.yaml``: 2 processes under torchrun, FSDP2, packed 256-token rows) with
the launcher's environment (``headrace.training.launch.ENV``), no interval checkpoint, no validation, and sends
SIGTERM to the torchrun agent once the job has logged ``--after`` steps, as a scheduler does. The agent forwards
it; the trainers stop at the next step boundary, save (a blocking save) and exit 75. Printed per round (JSON): the
signal-to-exit seconds, the seconds until the trainers said the checkpoint was saved (the rest is the processes'
teardown: loader workers, process group, interpreters, the agent), the mean step time of the logged steps (``step_time_mean``), the save's own seconds (the
trainers' ``preempted: step N saved in S s`` line), and the target ``2 x step + save`` (issue 45).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from headrace.training.launch import ENV

REPO = Path(__file__).resolve().parents[1]


def build_data(work: Path) -> Path:
    """The demo corpus's text shards under ``work`` (built once)."""
    shards = work / "shards" / "text"
    if not (shards / ".index").exists() and not any(shards.glob("*.tar")):
        subprocess.run([sys.executable, "-m", "tools.demo_corpus", "--out", str(work / "corpus")], cwd=REPO, check=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "headrace.dataio",
                "shard",
                str(work / "corpus" / "text.jsonl"),
                "--output",
                str(shards),
                "--tokenizer",
                str(work / "corpus" / "tokenizer.json"),
                "--samples-per-shard",
                "500",
                "--workers",
                "1",
            ],  # fmt: skip
            cwd=REPO,
            check=True,
        )
    return shards


def one_round(work: Path, shards: Path, after: int, index: int) -> dict:
    out = work / f"run{index}"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: no checkpoint to resume, no earlier metrics
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
        "headrace.training", "--config", str(REPO / "configs" / "demo.yaml"), f"trainer.output_dir={out}",
        f"data.datasets=[{{path: {shards}}}]", f"model.tokenizer={work / 'corpus' / 'tokenizer.json'}",
        "data.val=null", "trainer.eval_every=0", "trainer.max_steps=100000", "trainer.log_every=1",
        "checkpoint.interval=0", "checkpoint.export_hf=false", "logging.console=false",
        "logging.tensorboard=false",
    ]  # fmt: skip
    env = dict(os.environ, **ENV, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []  # (when read, line): the trainers' output as it comes
    reader = threading.Thread(target=lambda: lines.extend((time.perf_counter(), line) for line in proc.stdout))
    reader.start()
    metrics = out / "metrics.jsonl"
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < after:
        if proc.poll() is not None:
            reader.join()
            raise SystemExit("".join(line for _, line in lines)[-3000:])
        time.sleep(0.02)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=600)
    exit_s = time.perf_counter() - sent
    reader.join()
    log = "".join(line for _, line in lines)
    saved_at = next(t for t, line in lines if line.startswith("preempted: step"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    saved = re.search(r"preempted: step (\d+) saved in ([0-9.]+) s", log)
    if saved is None:
        raise SystemExit(log[-3000:])
    step_s = sum(r["step_time_mean"] for r in records[1:]) / max(1, len(records) - 1)  # the first: warm-up
    save_s = float(saved.group(2))
    return {
        "signal_to_exit_s": exit_s,
        "signal_to_saved_s": saved_at - sent,  # the trainers' stop + save, without the processes' teardown
        "step_s": step_s,
        "save_s": save_s,
        "target_s": 2 * step_s + save_s,
        "met": exit_s <= 2 * step_s + save_s,
        "stopped_after_step": int(saved.group(1)),
        "signalled_after_logged_steps": len(records),
        "load": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--after", type=int, default=8, help="logged steps before the signal")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    shards = build_data(args.work)
    for index in range(args.rounds):
        print(json.dumps(one_round(args.work, shards, args.after, index)), flush=True)


if __name__ == "__main__":
    main()
