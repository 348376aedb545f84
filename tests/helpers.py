"""What every kind of test shares: the checkout's root, a free local port, the environment of a
child process, and the one way tests launch several processes with torchrun.

``torchrun`` runs a module (``-m``: a script under ``tests/dist/``, or the trainer itself) on
``nproc`` local processes with gloo (``--standalone``: a rendezvous of its own on a free port), with
one intra-op thread each, from the checkout's root; it returns the finished process, and unless
``check=False`` first asserts that it succeeded, with the tail of its output as the message.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# set by an outer torchrun or a test's process group; a child that inherited them would join the wrong job
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# ``python -m headrace.training``'s arguments for a quick run of the tiny debug Llama (no console, no hf/ export)
DEBUG_LLAMA_CLI = (
    "--config",
    str(REPO / "configs" / "debug_llama.yaml"),
    "logging.console=false",
    "checkpoint.export_hf=false",
    "data.seq_len=64",
    "data.packing_buffer=8",
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str | None) -> dict[str, str]:
    """This process's environment for a child: the checkout importable ahead of what PYTHONPATH already
    holds (packages carried to a machine there), one intra-op thread, no inherited rank variables;
    ``extra`` sets variables (None: removes one)."""
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), OMP_NUM_THREADS="1")
    for key in _RANK_VARS:
        env.pop(key, None)
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def torchrun(
    nproc: int,
    module: str,
    *args,
    launcher_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 400,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node NPROC [launcher_args] -m MODULE ARGS`` from the checkout's root."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *launcher_args,
            "-m",
            module,
            *map(str, args),
        ],
        cwd=REPO,
        env=child_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc


__all__ = ["REPO", "child_env", "free_port", "torchrun"]
