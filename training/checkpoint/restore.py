"""Loading a checkpoint without unpickling: the newest one a job trusts, into any world size or layout.

A load reads the safetensors headers (JSON) and tensor bytes with ``HuggingFaceStorageReader`` into a state
dict of tensors only, so no ``.metadata`` or byte item is ever unpickled (DCP asks the reader only for what the
destination holds); DCP reshards by FQN and chunk offsets. Before any tensor is read, rank 0 checks the seal
(``headrace.training.checkpoint.seal``) and the ranks re-hash a share of the files each: an incomplete
checkpoint is skipped for the previous one, a foreign one refused. Cost: one read of every file (hashes) plus
the tensor reads.
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from headrace.training.checkpoint import store
from headrace.training.checkpoint.fields import checked_fields
from headrace.training.dcp_logging import quiet_metadata_fallback
from headrace.training.checkpoint.seal import (
    Incomplete,
    NotSealed,
    UntrustedKey,
    check,
    seal_key,
    verify_hashes,
)
from headrace.training.distributed.parallel_dims import gather_objects
from headrace.training.errors import JobInputError
from headrace.training.models.float8 import high_precision_weights
from headrace.training.checkpoint.layout import (
    FLAT_OPTIONS,
    STATE_FILE,
    TRAINABLE_OPTIONS,
    check_model_config,
    decode_tensor,
    joined_state,
    say_on_rank0,
    split_state,
    step_dirs,
)


def sealed_state(path: Path) -> dict:
    """The trainer state of checkpoint ``path`` once its seal holds (``seal.check``; the files'
    hashes are ``verified``'s)."""
    try:
        key = seal_key(create=False)
    except UntrustedKey as e:
        raise NotSealed(str(e)) from None
    return checked_fields(check(path, key, STATE_FILE), STATE_FILE, torch.get_rng_state().numel())


def damaged(path: Path, state: dict) -> str | None:
    """Every rank re-hashes a share of the sealed files of ``path``: the first mismatch, the same on every rank,
    or None. A collective."""
    found = [d for d in gather_objects(verify_hashes(path, state, dist.get_rank(), dist.get_world_size())) if d]
    return found[0] if found else None


def _fetched(url: str, local: Path) -> Path:
    """The step folder ``url`` downloaded under ``local/.fetched-<host>/`` by each host's lowest rank. A
    collective."""
    hosts = gather_objects(socket.gethostname())
    path = local / f".fetched-{hosts[dist.get_rank()]}" / url.rstrip("/").rsplit("/", 1)[-1]
    if hosts.index(hosts[dist.get_rank()]) == dist.get_rank():
        store.download(url, path)
    dist.barrier()
    return path


def load_newest(
    folder: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_config: dict,
    local: Path | None = None,
    trainable_only: bool = False,
) -> tuple[Path, dict] | None:
    """Load the newest complete checkpoint of ``folder`` (``load``) and return ``(path, trainer state)``; None
    when there is none. Rank 0 checks each candidate's seal and every rank learns the verdict; the ranks re-hash
    its files: an incomplete or damaged one is skipped for the previous one (said on rank 0), one this user's
    saves did not write, one of the former pickled layout or of another model is a ``JobInputError`` on every
    rank. A URL ``folder``: each candidate is downloaded under ``local`` first (``_fetched``). A collective."""
    if store.is_url(folder):
        candidates = store.step_folders(str(folder), STATE_FILE, complete_only=True)[::-1]
    else:
        folder = Path(folder)
        candidates = step_dirs(folder)[::-1]
    for where in candidates:
        path = _fetched(where, local) if store.is_url(folder) else where
        verdict: list = [None]
        if dist.get_rank() == 0:
            try:
                verdict[0] = ("ok", sealed_state(path))
            except Incomplete as e:
                verdict[0] = ("incomplete", str(e))
            except NotSealed as e:
                verdict[0] = ("refused", str(e))
        dist.broadcast_object_list(verdict, src=0)
        kind, what = verdict[0]
        if kind == "refused":
            raise JobInputError(f"checkpoint {where}: refused: {what}")
        if kind == "ok" and (bad := damaged(path, what)):
            kind, what = "incomplete", bad
        if kind == "incomplete":
            say_on_rank0(f"checkpoint {where} is incomplete ({what}): falling back to the previous one")
            continue
        check_model_config(where, what.get("model_config"), model_config)
        try:
            return where, load(path, model, optimizer, what, trainable_only)
        except CheckpointException as e:  # a header or tensor that does not fit this model
            say_on_rank0(f"checkpoint {where} does not load ({one_failure(e)}): falling back to the previous one")
    if candidates:
        raise JobInputError(f"checkpoint: no complete checkpoint in {folder} (see above); move it away to start afresh")
    return None


def one_failure(e: CheckpointException) -> str:
    rank, failure = min(e.failures.items())
    cause = failure[0] if isinstance(failure, tuple) else failure
    return f"rank {rank}: {type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"


def read_tensors(path: Path, tensors: dict) -> None:
    """Fill ``tensors`` (a flat dict of tensors / DTensors) from the safetensors files of ``path``, resharded to
    their layout. Only tensors are asked for, so DCP reads headers and tensor bytes and never unpickles."""
    with quiet_metadata_fallback():  # a header that does not parse is the CheckpointException's line, once
        dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(path)))


def load(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    trainable_only: bool = False,
) -> dict:
    """Restore model and optimizer from ``path`` into the current layout; returns ``trainer_state`` (the
    checked JSON of ``path``), after restoring this rank's RNG when the world size is unchanged.
    ``trainable_only``: as ``Saver.save``'s (the frozen parameters stay as built)."""
    path = Path(path)
    options = TRAINABLE_OPTIONS if trainable_only else FLAT_OPTIONS
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    # float8 weights are read into the high-precision tensor they wrap (the one the float8 casts read)
    tensors, plain = split_state(high_precision_weights(model_state), optim_state)
    read_tensors(path, tensors)
    model_state, optim_state = joined_state(tensors, plain, trainer_state["optim_plain"], path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options)
    if len(trainer_state["rng"]) == dist.get_world_size():
        torch.set_rng_state(decode_tensor(trainer_state["rng"][dist.get_rank()]["cpu"]))
        cuda = trainer_state["rng"][dist.get_rank()].get("cuda")
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(decode_tensor(cuda))
    return trainer_state


def load_model_weights(path: Path, model: nn.Module, trainer_state: dict, trainable_only: bool = False) -> None:
    """Only the model's weights from checkpoint ``path`` (its sealed ``trainer_state``), after its files' hashes
    hold (``damaged``: ``JobInputError``); ``trainable_only``: as ``Saver.save``'s. A collective."""
    if bad := damaged(path, trainer_state):
        raise JobInputError(f"checkpoint {path}: refused: {bad}")
    options = StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None
    tensors, _ = split_state(high_precision_weights(get_model_state_dict(model, options=options)))
    read_tensors(path, tensors)
    set_model_state_dict(model, joined_state(tensors, {}, {}, path)[0], options=options)


__all__ = [
    "damaged",
    "load",
    "load_model_weights",
    "load_newest",
    "one_failure",
    "read_tensors",
    "sealed_state",
]
