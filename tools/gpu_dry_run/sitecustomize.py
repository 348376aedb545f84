"""A CPU stand-in for a GPU, loaded only by `tools/gpu_check.sh --dry-run` (it puts this folder on PYTHONPATH).

torch is told a CUDA device exists and answers queries about it as the lent H200 would (capability 9.0, 132 SMs,
~140 GiB), so import-time capability checks pass; the first call that would touch the device (lazy CUDA init, set_device, a stream,
pinned memory, an NCCL process group) writes `file:line` of the caller to $GPU_DRY_MARKER and kills the part's
whole process group (`timeout` made it one), torchrun children and wrapper scripts included. A part whose
set-up (argument parsing, config validation, corpus and shard checks, model construction on meta, imports of
the carried packages) is broken fails before that line, on the CPU, before any device time is spent.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from types import SimpleNamespace

MARKER = os.environ.get("GPU_DRY_MARKER")


def _reached() -> None:
    here = next(
        (
            f"{f.filename}:{f.lineno}"
            for f in reversed(traceback.extract_stack()[:-1])
            if "/torch/" not in f.filename and f.filename != __file__
        ),
        "?",
    )
    fd = os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, f"{here}\n".encode())
    os.close(fd)
    print(f"gpu_check dry-run: first CUDA call at {here}", file=sys.stderr, flush=True)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _stopper():
    # one function object per patched name: dynamo keeps one trace rule per torch object, and the names differ
    return lambda *_args, **_kwargs: _reached()


def _nccl_aware(init):
    def init_process_group(*args, **kwargs):
        backend = kwargs.get("backend", args[0] if args else None)
        if backend is None or "nccl" in str(backend):
            _reached()
        return init(*args, **kwargs)

    return init_process_group


if MARKER:
    import torch
    import torch.distributed

    H200 = SimpleNamespace(
        name="NVIDIA H200 (gpu_check dry-run)",
        major=9,
        minor=0,
        multi_processor_count=132,
        total_memory=150_000_000_000,
        L2_cache_size=60 * 2**20,
    )
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_bf16_supported = lambda *a, **k: True
    torch.cuda.get_device_capability = lambda *a, **k: (H200.major, H200.minor)
    torch.cuda.get_device_properties = lambda *a, **k: H200
    torch.cuda.get_device_name = lambda *a, **k: H200.name
    for name in ("_lazy_init", "init", "set_device", "synchronize", "mem_get_info"):
        setattr(torch.cuda, name, _stopper())
    for name in ("Stream", "Event"):  # classes still: annotations such as `torch.cuda.Stream | None` must evaluate
        setattr(torch.cuda, name, type(name, (), {"__new__": _stopper()}))
    torch.Tensor.pin_memory = _stopper()
    torch.distributed.is_nccl_available = lambda: True
    torch.distributed.init_process_group = _nccl_aware(torch.distributed.init_process_group)
