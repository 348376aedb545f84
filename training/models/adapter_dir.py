"""Reading a peft adapter directory (``peft.pretrained_path``: ``adapter_config.json`` + ``adapter_model.safetensors``),
a folder someone else wrote, with the rules the pretrained, tokenizer and speech folders follow
(``headrace.training.dir_files``): a file is read only when its real path stays inside the folder (a link out is
refused, naming it, before anything is read), the config is one JSON object, and a file that does not parse or
does not fit this model is one ``JobInputError`` line naming the folder. Cost: one ``realpath`` per file, the
safetensors header once, then the adapter's tensor bytes."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.api import CheckpointException

from headrace.training.dcp_logging import quiet_metadata_fallback
from headrace.training.dir_files import file_inside, files_inside, read_json_object
from headrace.training.errors import JobInputError

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = "peft.pretrained_path"


def adapter_config_file(path: str | Path) -> Path:
    """``path/adapter_config.json`` once the folder is an adapter directory whose files all stay inside it (the
    tensor reader reads every ``*.safetensors`` there, so each is checked)."""
    try:
        config, weights = file_inside(path, ADAPTER_CONFIG), file_inside(path, ADAPTER_WEIGHTS)
        files_inside(path, "*.safetensors")
    except JobInputError as e:
        raise JobInputError(f"{_KEY}: {e}") from None
    if config is None or weights is None:
        raise JobInputError(
            f"{_KEY}: {path} is not a peft adapter directory (needs {ADAPTER_CONFIG} "
            f"and {ADAPTER_WEIGHTS}; .bin adapters are pickles and are not read)"
        )
    return config


def read_config_object(file: Path) -> dict:
    """The JSON object in ``file`` (``JobInputError`` naming it: not JSON, nested too deep, not an object)."""
    try:
        return read_json_object(file)
    except JobInputError as e:
        raise JobInputError(f"{_KEY}: {e}") from None


def stored_keys(path: str | Path) -> set[str]:
    """The tensor names in the adapter's safetensors header."""
    file = Path(path) / ADAPTER_WEIGHTS
    try:
        with safe_open(str(file), "pt") as f:  # the header only
            return set(f.keys())
    except (SafetensorError, OSError) as e:
        raise JobInputError(f"{_KEY}: {file} is not a readable safetensors file ({_first_line(e)})") from None


def read_adapter_tensors(tensors: dict, path: str | Path) -> None:
    """Fill ``tensors`` (peft names, this rank's layout) from the adapter's files; a tensor of another shape or
    dtype (an adapter of another base) or unreadable bytes is one line. A collective."""
    try:
        with quiet_metadata_fallback():
            dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
    except CheckpointException as e:
        rank, failure = min(e.failures.items())
        cause = failure[0] if isinstance(failure, tuple) else failure
        raise JobInputError(
            f"{_KEY}: {path} does not fit this model (rank {rank}: {type(cause).__name__}: {_first_line(cause)}); "
            "is it an adapter of another base model?"
        ) from None


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return " ".join(lines[0].split())[:200] if lines else type(e).__name__


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapter_config_file",
    "read_adapter_tensors",
    "read_config_object",
    "stored_keys",
]
