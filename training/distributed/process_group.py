"""The process group of a job: joining it (torchrun's environment, or a 1-rank group for a plain ``python -m``),
closing it, this rank's device, and the gloo group of a finite stream's tail agreement.
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch
import torch.distributed as dist


def world_size() -> int:
    """The job's world size: the process group's, or before there is one the launcher's ``WORLD_SIZE`` (1 without
    a launcher), so the degrees can be checked before any process group work."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def init_distributed(device_type: str) -> None:
    """Join the torchrun process group; a plain ``python -m headrace.training`` becomes a 1-rank group."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo")


@contextlib.contextmanager
def process_group_closed():
    """Destroy the process group the body joined, also when it raises (torchrun entry points)."""
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def pick_device(name: str) -> torch.device:
    """``trainer.device``: ``auto`` is this rank's GPU when CUDA is available, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"trainer.device=cuda but torch {torch.__version__} sees no CUDA device "
                "(use trainer.device=cpu or auto)"
            )
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def new_tail_group():
    """The gloo group of a finite stream's tail agreement (``headrace.dataio.feed.even``): one all_reduce of two
    integers per batch in the loop's thread, on the host whatever the device. Collective: every rank calls it
    at the same point."""
    return dist.new_group(backend="gloo")


__all__ = ["init_distributed", "new_tail_group", "pick_device", "process_group_closed", "world_size"]
