"""What a checkpoint is on disk, shared by its save, load and export: the step folders and which is the newest,
the state split into safetensors tensors and JSON, the model record a resume compares, the RNG's encoding.

Layout: ``checkpoints/step-00000100/`` holds ``shard-0000R-model-0000K-of-0000N.safetensors`` (each rank writes
its own shards through DCP's ``HuggingFaceStorageWriter``) plus ``trainer_state.json``: the step, every
data-parallel rank's loader state (a list ordered by dp rank, so a different dp world can redistribute the
stream), every rank's RNG state, the optimizer's non-tensor state (``param_groups.<fqn>.lr`` ...: optimizer state
is flattened to per-parameter keys, so ranks holding different parameters, pipeline stages, write disjoint keys)
and the seal (``headrace.training.checkpoint.seal``). Folder names are zero-padded so they sort by step; a
``step-N.tmp`` folder is a save in progress and never the newest. Cost: a directory listing per lookup.
"""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
)

from headrace.training.checkpoint import store
from headrace.training.distributed.parallel_dims import gather_objects
from headrace.training.errors import JobInputError

STATE_FILE = "trainer_state.json"


# Optimizer state keyed by parameter name (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): ranks that
# hold different parameters (pipeline stages) then write disjoint keys instead of colliding param_groups lists.
FLAT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# LoRA (``trainable_only``): frozen parameters are the base's, referenced by the trainer state, not copied; not
# strict, as the frozen keys are absent by design (a trainable key missing from the files still fails the read)
TRAINABLE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


STEP_DIR = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(folder: str | Path, step: int) -> Path | str:
    """Where the checkpoint of ``step`` lives (``step-00000100``; a URL under a URL); zero-padded so names sort by
    step."""
    name = f"step-{step:08d}"
    return store.join(str(folder), name) if store.is_url(folder) else Path(folder) / name


def latest(folder: str | Path) -> Path | str | None:
    """The newest complete checkpoint in ``folder`` (``*.tmp`` and ones without the state file are ignored)."""
    if store.is_url(folder):
        return next(reversed(store.step_folders(str(folder), STATE_FILE, complete_only=True)), None)
    return next(reversed(step_dirs(Path(folder))), None)


def step_dirs(folder: Path) -> list[Path]:
    """The complete step folders of a local ``folder`` (each holding the state file), oldest first."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if STEP_DIR.match(p.name) and (p / STATE_FILE).is_file())


def split_state(model_state: dict, optim_state: dict | None = None) -> tuple[dict, dict]:
    """``(tensors, plain)``: every tensor under one flat key (``model.<fqn>``, ``optim.<key>``) for the
    safetensors files, and the optimizer's non-tensor values (lr, betas, flags) for the JSON."""
    tensors, plain = {}, {}
    for key, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"checkpoint: model state {key} is a {type(value).__name__}, not a tensor")
        tensors[f"model.{key}"] = value
    for key, value in (optim_state or {}).items():
        if isinstance(value, torch.Tensor):
            tensors[f"optim.{key}"] = value
        else:
            plain[key] = value
    return tensors, plain


def joined_state(tensors: dict, plain: dict, saved_plain: dict, path: Path) -> tuple[dict, dict]:
    """``split_state`` undone: (model state, optimizer state) with ``plain``'s keys taken from ``saved_plain``
    (a tuple stays a tuple: JSON made it a list)."""
    if missing := sorted(plain.keys() - saved_plain.keys()):
        raise JobInputError(
            f"checkpoint {path}: holds no optimizer setting {missing[0]} (and {len(missing) - 1} "
            "more): saved with other parameters than this job trains"
        )
    model_state = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    optim_state = {k.removeprefix("optim."): v for k, v in tensors.items() if k.startswith("optim.")}
    optim_state.update({k: tuple(saved_plain[k]) if isinstance(v, tuple) else saved_plain[k] for k, v in plain.items()})
    return model_state, optim_state


def file_index(state: dict, max_bytes: float) -> dict[str, int]:
    """fqn -> output file number (1..N): tensors in rank then state-dict order, a new file when the next would
    pass ``max_bytes``. A collective: pipeline ranks hold different stages, so the sizes (global, not the
    shard's) of every rank's tensors are gathered and every rank computes the same mapping."""
    sizes = {
        fqn: size
        for part in gather_objects([(fqn, t.numel() * t.element_size()) for fqn, t in state.items()])
        for fqn, size in part
    }
    mapping, index, used = {}, 1, 0
    for fqn, size in sizes.items():
        if used and used + size > max_bytes:
            index, used = index + 1, 0
        mapping[fqn], used = index, used + size
    return mapping


# config keys that say nothing about the weights' meaning: bookkeeping, and what only initialisation reads
_NOT_THE_MODEL = {
    "transformers_version",
    "_name_or_path",
    "architectures",
    "torch_dtype",
    "dtype",
    "use_cache",
    "_attn_implementation_autoset",
    "attn_implementation",
    "_attn_implementation",
    "initializer_range",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "_commit_hash",
}


def model_config_record(hf_config) -> dict:
    """What ``check_model_config`` compares: the model's config as JSON, without ``_NOT_THE_MODEL``."""
    fields = json.loads(json.dumps(hf_config.to_dict(), default=str))
    return {k: v for k, v in fields.items() if k not in _NOT_THE_MODEL}


def check_model_config(path: Path, saved: dict | None, current: dict) -> None:
    """``JobInputError`` naming every key whose value differs between the checkpoint's model and this job's."""
    if saved is None:
        raise JobInputError(f"checkpoint {path}: records no model config to compare with this job's")
    differ = [
        f"{k} {saved.get(k, '(unset)')!r} -> {current.get(k, '(unset)')!r}"
        for k in sorted(saved.keys() | current.keys())
        if saved.get(k) != current.get(k)
    ]
    if differ:
        raise JobInputError(
            f"checkpoint {path} holds another model than this job's model config: "
            f"{'; '.join(differ)} (resume with the model it was trained with, or set "
            "checkpoint.resume: false / another trainer.output_dir)"
        )


def rng_state() -> dict:
    state = {"cpu": _encode(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = _encode(torch.cuda.get_rng_state())
    return state


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def decode_tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_error(where: Path, e: CheckpointException) -> Exception:
    """One line for a failed DCP write: the directory and the first rank's cause, when the cause is the file
    system's (an OS error: a full disk, a file-size limit, a permission); any other failure keeps its traceback."""
    for rank, failure in sorted(e.failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, OSError):
            what = f"{cause.strerror or cause}{f' ({cause.filename})' if cause.filename else ''}"
        else:
            continue
        return JobInputError(f"checkpoint: cannot write {where} (rank {rank}): {what}")
    return e


def say_on_rank0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


__all__ = [
    "FLAT_OPTIONS",
    "STATE_FILE",
    "STEP_DIR",
    "TRAINABLE_OPTIONS",
    "check_model_config",
    "checkpoint_dir",
    "decode_tensor",
    "file_index",
    "joined_state",
    "latest",
    "model_config_record",
    "rng_state",
    "say_on_rank0",
    "split_state",
    "step_dirs",
    "write_error",
    "write_json",
]
