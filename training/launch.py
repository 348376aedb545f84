"""``python -m headrace.training.launch``: run the trainer on many machines, under SLURM or by hand.

SLURM (``--slurm --nodes N --gpus-per-node G [--time T] [--jobs K] [--dry-run]``): writes
``<output_dir>/slurm/<name>.sbatch`` and submits it. The script ``srun``s one ``torchrun`` agent per
node; the agents meet in a c10d rendezvous on the allocation's first host (``scontrol show hostnames``,
port ``--port``, id ``$SLURM_JOB_ID``; the agent on node 0 hosts the store, ``is_host=true``) and start G
trainer processes each, ``--nnodes $SLURM_JOB_NUM_NODES``. ``--jobs K`` chains K jobs with
``--dependency=afterany`` (each starts when the previous ends, however it ended: time limit, failure),
each with its own data seed: the script's first argument, passed as ``trainer.data_seed`` and echoed
into the job's output; ``slurm/jobs.jsonl`` records every job id with its seed. Each job resumes from
the newest complete checkpoint (``checkpoint.resume``); the seed orders only the epochs not begun yet
(``headrace.dataio.stream.ordering.seeding``), so no sample of the epoch in progress repeats or is skipped. ``--dry-run`` prints
the script and the ``sbatch`` commands instead.

By hand (``--nnodes N --node-rank R --master ADDR[:PORT]``): runs (or with ``--dry-run`` prints) this
node's ``torchrun``; type it on every machine with its own ``--node-rank``. ``--rdzv c10d`` (default):
the node with rank 0 hosts the rendezvous store at ADDR, the others connect (torchrun then numbers the
nodes itself); ``--rdzv static``: fixed node ranks with ``--master-addr``/``--master-port``.

Preemption: the script asks SLURM for ``SIGUSR1`` ``--signal-lead`` seconds (default 120) before the time limit
(``#SBATCH --signal=USR1@120``); the torchrun agents forward it to the trainers (``ENV``) and give them that long
to end (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) before SIGKILL: every rank stops at the next step boundary, saves and
exits (``trainer.preemption``), and the chain's next job resumes from that checkpoint. ``--signal-lead 0``: no
signal asked for.

Fault tolerance in both: ``--max-restarts M`` lets torchrun restart all workers of the job up to M times
when one dies; the trainer then resumes from the newest complete checkpoint with the loader position
saved in it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from headrace.config import ConfigError
from headrace.dataio.stream.ordering.seeding import fresh_seed

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# Workers get their own TCPStore instead of sharing the rendezvous one: with the shared store a restarted
# worker group reads the previous attempt's gloo/NCCL addresses and hangs in init_process_group
# (pytorch/pytorch#135712; measured with torch 2.13: --max-restarts 1 never came back without it).
# The agent forwards SIGUSR1 (SLURM's warning, ``--signal-lead``) to the trainers as it does SIGTERM, instead of dying of
# it; the trainers then save and exit (``headrace.training.components.preemption``). torchrun's ``--signals-to-handle``
# read from its environment (PET_*): it overwrites TORCHELASTIC_SIGNALS_TO_HANDLE with its own default otherwise.
ENV = {
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
}


def trainer_args(config: str, overrides: list[str]) -> list[str]:
    return ["-m", "headrace.training", "--config", str(Path(config).resolve()), *overrides]


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """This node's torchrun for a run by hand (see the module docstring)."""
    host, _, port = args.master.partition(":")
    port = port or str(args.port)
    cmd = [
        *TORCHRUN,
        f"--nnodes={args.nnodes}",
        f"--nproc-per-node={args.nproc_per_node}",
        f"--max-restarts={args.max_restarts}",
    ]
    if args.rdzv == "static":
        cmd += [f"--node-rank={args.node_rank}", f"--master-addr={host}", f"--master-port={port}"]
    else:
        cmd += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host}:{port}",
            f"--rdzv-id={args.rdzv_id}",
            f"--rdzv-conf=is_host={str(args.node_rank == 0).lower()}",
        ]
    if args.local_addr:
        cmd.append(f"--local-addr={args.local_addr}")
    return cmd + trainer_args(args.config, args.overrides)


def sbatch_script(args: argparse.Namespace, output_dir: Path) -> str:
    """The sbatch script of one job of the chain; its first argument is the job's data seed."""
    directives = [
        f"--job-name={args.name}",
        f"--nodes={args.nodes}",
        "--ntasks-per-node=1",
        f"--output={str(output_dir / 'slurm').replace('%', '%%')}/%x-%j.out",
        "--open-mode=append",
    ]
    if args.gpus_per_node:
        directives.append(f"--gpus-per-node={args.gpus_per_node}")
    if args.time:
        directives.append(f"--time={args.time}")
    if args.signal_lead:
        directives.append(f"--signal=USR1@{args.signal_lead}")
    directives += args.sbatch_arg
    for d in directives:
        if "\n" in d or "\r" in d:
            raise ConfigError(
                f"#SBATCH line {d!r}: a line break in an sbatch directive would start a new script line; remove it"
            )
    # Only the launcher's own words expand on the node ($SLURM_*, $RDZV_HOST, $IS_HOST, $DATA_SEED), inside double
    # quotes; every other word (the config path and overrides the user gave) is single-quoted, so it reaches the
    # trainer exactly as given: no second expansion of `$1`, `$(cmd)` or backquotes.
    expands = {
        "--nnodes=$SLURM_JOB_NUM_NODES",
        f"--rdzv-endpoint=$RDZV_HOST:{args.port}",
        "--rdzv-id=$SLURM_JOB_ID",
        "--rdzv-conf=is_host=$IS_HOST",
    }
    node = [
        *TORCHRUN,
        "--nnodes=$SLURM_JOB_NUM_NODES",
        f"--nproc-per-node={args.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=$RDZV_HOST:{args.port}",
        "--rdzv-id=$SLURM_JOB_ID",
        "--rdzv-conf=is_host=$IS_HOST",
        f"--max-restarts={args.max_restarts}",
    ]
    words = " ".join(
        [
            *(f'"{w}"' if w in expands else shlex.quote(w) for w in node),
            *map(shlex.quote, trainer_args(args.config, args.overrides)),
            '"trainer.data_seed=$DATA_SEED"',
        ]
    )
    per_node = f'IS_HOST=false; [ "$SLURM_NODEID" = 0 ] && IS_HOST=true; exec {words}'
    return "\n".join(
        [
            "#!/bin/bash",
            *(f"#SBATCH {d}" for d in directives),
            "# written by python -m headrace.training.launch; argument 1: this job's data seed",
            "set -euo pipefail",
            'export DATA_SEED="${1:?usage: sbatch this-script DATA_SEED}"',
            'export RDZV_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            *(f"export {k}={v}" for k, v in ENV.items()),
            *([f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={args.signal_lead}"] if args.signal_lead else []),
            f"cd {shlex.quote(str(Path.cwd()))}",
            f'echo "job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES node(s) x {args.nproc_per_node}, '
            f'rendezvous $RDZV_HOST:{args.port}, data seed $DATA_SEED"',
            f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c {shlex.quote(per_node)}",
            "",
        ]
    )


class SubmitError(RuntimeError):
    """``sbatch`` refused a job (its own message, one line) or is not installed."""


def submit_chain(script: Path, seeds: list[int], output_dir: Path, dry_run: bool) -> list[str]:
    """``sbatch`` the script once per seed, each job after the previous (``afterany``); returns the job ids.
    ``SubmitError`` with sbatch's own message when it fails (the jobs already submitted are listed)."""
    ids: list[str] = []
    for i, seed in enumerate(seeds):
        cmd = ["sbatch", "--parsable", *([f"--dependency=afterany:{ids[-1]}"] if ids else []), str(script), str(seed)]
        if dry_run:
            print(shlex.join(cmd))
            ids.append(f"JOB{i + 1}")
            continue
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            raise SubmitError(
                "sbatch not found: run this on a SLURM login node (or --dry-run to see the commands)"
            ) from None
        if proc.returncode != 0:
            said = " ".join((proc.stderr.strip() or proc.stdout.strip() or "no message").split())
            before = f" (already submitted: {', '.join(ids)})" if ids else ""
            raise SubmitError(f"sbatch exited with status {proc.returncode}: {said}{before}")
        out = proc.stdout.strip()
        ids.append(out.split(";")[0])  # --parsable: "id" or "id;cluster"
        with open(output_dir / "slurm" / "jobs.jsonl", "a") as f:
            f.write(
                json.dumps(
                    {"job_id": ids[-1], "data_seed": seed, "after": ids[-2] if i else None, "script": str(script)}
                )
                + "\n"
            )
        print(f"submitted job {ids[-1]} (data seed {seed}" + (f", after {ids[-2]})" if i else ")"), flush=True)
    return ids


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m headrace.training.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="the job YAML (as for python -m headrace.training)")
    p.add_argument("overrides", nargs="*", help="dotted overrides passed to the trainer")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (SLURM: --gpus-per-node)")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="trainer processes per node (default: --gpus-per-node, or 1 without GPUs)",
    )
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of the whole job on a failure")
    p.add_argument("--port", type=int, default=29500, help="rendezvous port (default 29500)")
    p.add_argument("--dry-run", action="store_true", help="print what would run or be submitted")
    slurm = p.add_argument_group("SLURM")
    slurm.add_argument("--slurm", action="store_true", help="write and submit an sbatch script")
    slurm.add_argument("--nodes", type=int, default=1, help="nodes per job")
    slurm.add_argument("--time", default=None, help="time limit per job (sbatch --time, e.g. 04:00:00)")
    slurm.add_argument("--jobs", type=int, default=1, help="chain this many jobs (afterany), each a fresh seed")
    slurm.add_argument("--name", default="headrace", help="job name (default headrace)")
    slurm.add_argument(
        "--signal-lead",
        type=int,
        default=120,
        metavar="SECONDS",
        help="ask for SIGUSR1 this long before the time limit: the trainers save and exit (default 120; 0: none)",
    )
    slurm.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra #SBATCH line, e.g. --sbatch-arg=--partition=gpu (repeatable)",
    )
    manual = p.add_argument_group("by hand (no SLURM)")
    manual.add_argument("--nnodes", type=int, default=1, help="nodes of the run")
    manual.add_argument("--node-rank", type=int, default=0, help="this node's rank (0 hosts the rendezvous)")
    manual.add_argument("--master", default="127.0.0.1", help="ADDR[:PORT] of node 0")
    manual.add_argument("--rdzv", choices=("c10d", "static"), default="c10d", help="rendezvous (default c10d)")
    manual.add_argument("--rdzv-id", default="headrace", help="c10d run id, the same on every node")
    manual.add_argument("--local-addr", default=None, help="this node's address for the other nodes")
    args = p.parse_args(argv)
    if args.nproc_per_node is None:
        args.nproc_per_node = args.gpus_per_node or 1
    if not 0 <= args.signal_lead <= 65535:
        p.error(f"--signal-lead {args.signal_lead}: seconds in 0..65535 (SLURM's --signal limit)")
    for name in ("nodes", "jobs", "nnodes", "nproc_per_node"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.name or "/" in args.name or args.name.startswith(".") or not args.name.isprintable():
        p.error(
            f"--name {args.name!r}: a job name is one printable file name (no '/', not starting with '.'), "
            "since the script is written as <output_dir>/slurm/<name>.sbatch"
        )
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank {args.node_rank} outside 0..{args.nnodes - 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    from headrace.training.config.load import load_job_config  # deferred: --help and argument errors load no torch

    args = parse_args(argv)
    try:  # fail here, not on the cluster: the config must load
        cfg = load_job_config(args.config, args.overrides)
    except (ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.slurm:
        cmd = torchrun_command(args)
        if args.dry_run:
            print(shlex.join([*(f"{k}={v}" for k, v in ENV.items()), *cmd]))
            return 0
        os.execvpe(cmd[0], cmd, {**os.environ, **ENV})
    if args.signal_lead and "SIGUSR1" not in cfg.trainer.preemption.signals:
        print(
            "error: --signal-lead asks SLURM for SIGUSR1, which trainer.preemption.signals does not list: add it, "
            "or pass --signal-lead 0",
            file=sys.stderr,
        )
        return 2
    output_dir = Path(cfg.trainer.output_dir).resolve()
    try:
        script = sbatch_script(args, output_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seeds = [fresh_seed() for _ in range(args.jobs)]
    path = output_dir / "slurm" / f"{args.name}.sbatch"
    if args.dry_run:
        print(script)
    else:
        from headrace.training.components.run_lock import first_symlink

        if (link := first_symlink(output_dir)) is not None:  # what the trainer would refuse: refuse it here first
            print(
                f"error: trainer.output_dir: {link} is a symbolic link out of it; the job writes only under its "
                "output_dir",
                file=sys.stderr,
            )
            return 2
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(script)
        path.chmod(0o755)
    try:
        submit_chain(path, seeds, output_dir, args.dry_run)
    except SubmitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
