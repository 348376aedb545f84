"""Saving a checkpoint, in the step or in the background (``checkpoint.async_mode``).

Atomicity: everything is written under ``step-N.tmp``; after every rank's files are written, rank 0 writes the
JSON last (temp file, fsync, rename) and renames the directory, so a crash at any moment leaves the previous
checkpoint as the latest (``layout.latest``). Each file's size and SHA-256 come from its writer stream and are
sealed into the JSON. A ``folder`` that is an fsspec URL (``s3://``) gets the same checkpoint written locally,
uploaded, and the state file uploaded last as the commit marker (``headrace.training.checkpoint.store``).

Saves (``Saver``): ``disabled`` writes in the step; ``async`` copies the state to fresh host memory and writes it
from a background thread over a gloo group of its own while training goes on; ``async_with_pinned_mem`` copies
into host buffers allocated at start (``save_buffers``; page-locked where CUDA is), so every save, the first
included, costs the step one memcpy and no allocation. One save at a time (a second waits, said in the log), the
final save waits, and a background failure is raised at the next step, naming the checkpoint.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
)
from torch.distributed.tensor import DTensor

from headrace.training.checkpoint import store
from headrace.training.checkpoint.prune import prune
from headrace.training.checkpoint.seal import (
    HashingFileSystem,
    UntrustedKey,
    seal,
    seal_key,
)
from headrace.training.distributed.parallel_dims import gather_objects
from headrace.training.errors import JobInputError
from headrace.training.models.float8 import high_precision_weights
from headrace.training.checkpoint.layout import (
    FLAT_OPTIONS,
    STATE_FILE,
    TRAINABLE_OPTIONS,
    checkpoint_dir,
    file_index,
    rng_state,
    say_on_rank0,
    split_state,
    write_error,
    write_json,
)

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


# Most bytes per safetensors file: DCP's writer builds a whole file in memory before writing it.
_FILE_BYTES = 512 * 2**20


def unshared(tensors: dict) -> dict:
    """``tensors`` with every entry whose storage an earlier entry already holds (tied embeddings: ``lm_head`` and
    ``embed_tokens`` are one parameter) replaced by a copy: safetensors refuses two entries over one storage. The
    load reads both into the one parameter, with the same values."""
    seen, out = set(), {}
    for key, value in tensors.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        storage = local.untyped_storage().data_ptr() if local.numel() else None
        out[key] = value.clone() if storage in seen else value
        seen.add(storage)
    return out


def stage(tensors: dict, buffers: dict | None, *, pin: bool) -> dict:
    """A host copy of ``tensors`` (DTensors keep their mesh and placements) that training may not change.
    ``buffers``: host tensors by key, filled on first use and reused (None: fresh memory every time)."""
    pin = pin and torch.cuda.is_available()
    staged = {}
    for key, t in tensors.items():
        local = t.to_local() if isinstance(t, DTensor) else t
        buf = buffers.get(key) if buffers is not None else None
        if buf is None:
            buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
            if buffers is not None:
                buffers[key] = buf
        buf.copy_(local, non_blocking=pin)
        staged[key] = (
            DTensor.from_local(buf, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
            if isinstance(t, DTensor)
            else buf
        )
    if pin:
        torch.cuda.synchronize()  # the copies are done before training changes what they read
    return staged


def write(
    folder: str | Path,
    step: int,
    tensors: dict,
    files: dict[str, int],
    state: dict,
    key: bytes | None,
    *,
    keep_last: int | None,
    group=None,
    local: Path | None = None,
) -> Path | str:
    """Write checkpoint ``step`` from ``tensors`` (key -> file number ``files``, the same on every rank) and the
    JSON ``state`` atomically (a collective over ``group``; ``key``: rank 0's seal key). Each file's size and
    SHA-256 come from its writer stream. A URL ``folder``: written under ``local``, then uploaded, the state
    file last (``headrace.training.checkpoint.store``)."""
    url = checkpoint_dir(folder, step) if store.is_url(folder) else None
    final = checkpoint_dir(local if url else folder, step)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        if url:
            store.remove(url)  # a save of this step cut off earlier: its parts must not mix with this one's
    dist.barrier(group=group)
    writer = dcp.HuggingFaceStorageWriter(str(tmp), fqn_to_index_mapping=files, save_distributed=True)
    writer.fs = hashing = HashingFileSystem()
    try:
        dcp.save(tensors, storage_writer=writer, process_group=group)
    except CheckpointException as e:
        raise write_error(tmp, e) from e
    if url:
        store.upload(tmp, sorted(hashing.digests), url)
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashing.digests, group=group)  # also: every rank's files are uploaded
    if dist.get_rank() == 0:
        write_json(tmp / STATE_FILE, seal(state, {n: d for part in digests for n, d in part.items()}, key))
        if url:
            store.upload(tmp, [STATE_FILE], url)  # the commit marker, last
            store.prune(str(folder), keep_last, STATE_FILE, written=url)
        else:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            prune(Path(folder), keep_last, final, key, STATE_FILE)
    dist.barrier(group=group)
    if url:
        shutil.rmtree(tmp, ignore_errors=True)  # every rank: its host's local copy
    return url or final


class Saver:
    """Writes a job's checkpoints, in the step or in the background (module docstring, ``checkpoint.async_mode``).

    ``save`` gathers what needs the training process group (RNG, the optimizer's plain values, the file index)
    in the step, then writes; ``raise_if_failed`` at every step surfaces a background failure; ``wait`` before
    the final save and export."""

    def __init__(self, async_mode: str = "disabled"):
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"checkpoint.async_mode: {async_mode!r} is not one of {', '.join(ASYNC_MODES)}")
        self.async_mode = async_mode
        # async_with_pinned_mem's kept host buffers, by key (filled at start: ``save_buffers``)
        self.buffers: dict | None = {} if async_mode == "async_with_pinned_mem" else None
        self._group = None  # the background writes' gloo group, made at the first async save (a collective)
        self._thread: threading.Thread | None = None
        self._writing: Path | None = None
        self._error: BaseException | None = None

    def save(
        self,
        folder: str | Path,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loader_states: list,
        *,
        keep_last: int | None = None,
        extra: dict | None = None,
        local: Path | None = None,
        trainable_only: bool = False,
    ) -> Path | str:
        """Checkpoint ``step`` (a collective). ``extra``: more JSON for the trainer state (the model config, the
        run's first loss); ``local``: where a checkpoint for a URL ``folder`` is written before its upload;
        ``trainable_only``: the model's trainable parameters only (LoRA: the frozen base is ``extra``'s reference,
        not a copy). Returns where the checkpoint is (or will be, once written)."""
        self.wait(say=True)
        folder = folder if store.is_url(folder) else Path(folder)
        model_state, optim_state = get_state_dict(
            model, optimizer, options=TRAINABLE_OPTIONS if trainable_only else FLAT_OPTIONS
        )
        tensors, plain = split_state(high_precision_weights(model_state), optim_state)
        tensors = unshared(tensors)
        state = {
            "step": step,
            "loader": loader_states,
            "rng": gather_objects(rng_state()),
            "optim_plain": {k: v for part in gather_objects(plain) for k, v in part.items()},
            **(extra or {}),
        }
        files = file_index(tensors, _FILE_BYTES)
        key = seal_key_or_fail(create=True) if dist.get_rank() == 0 else None
        if self.async_mode == "disabled":
            return write(folder, step, tensors, files, state, key, keep_last=keep_last, local=local)
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        staged = stage(tensors, self.buffers, pin=self.async_mode == "async_with_pinned_mem")
        self._writing = checkpoint_dir(folder, step)
        self._thread = threading.Thread(
            target=self._write_in_background,
            args=(folder, step, staged, files, state, key, keep_last, local),
            daemon=True,
            name=f"checkpoint-{step}",
        )
        self._thread.start()
        return self._writing

    def _write_in_background(self, folder, step, staged, files, state, key, keep_last, local) -> None:
        try:
            write(folder, step, staged, files, state, key, keep_last=keep_last, group=self._group, local=local)
        except BaseException as e:  # kept for the training thread to raise
            self._error = e

    @property
    def busy(self) -> bool:
        """A background save is being written."""
        return self._thread is not None and self._thread.is_alive()

    def raise_if_failed(self) -> None:
        """Raise a finished background save's failure (``JobInputError`` naming the checkpoint), once."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            line = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise JobInputError(
                f"checkpoint {self._writing}: the background save failed: {type(e).__name__}: {line}"
            ) from e

    def wait(self, *, say: bool = False) -> None:
        """Block until the save in flight (if any) is written, then ``raise_if_failed``."""
        if self._thread is not None:
            if say and self._thread.is_alive():
                say_on_rank0(f"checkpoint: waiting for the save of {self._writing} still being written (one at a time)")
            self._thread.join()
        self.raise_if_failed()


def save(
    folder: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader_states: list,
    keep_last: int | None = None,
    *,
    extra: dict | None = None,
    trainable_only: bool = False,
) -> Path:
    """Write checkpoint ``step`` in the step (``Saver("disabled")``; a collective)."""
    return Saver().save(
        folder, step, model, optimizer, loader_states, keep_last=keep_last, extra=extra, trainable_only=trainable_only
    )


def gather_loader_states(batches, dp_mesh) -> list:
    """Every dp rank's loader state as of the last batch trained on, ordered by dp rank (TP/CP/PP peers hold
    identical ones): what ``save`` stores. Taken from ``batches`` (the ``DevicePrefetcher``), which may have read
    ahead of the step. A collective."""
    by_dp = dict(gather_objects((dp_mesh.get_local_rank(), batches.state_dict())))
    return [by_dp[r] for r in range(len(by_dp))]


def seal_key_or_fail(*, create: bool) -> bytes | None:
    """``seal.seal_key``, an untrusted key a ``JobInputError``."""
    try:
        return seal_key(create=create)
    except UntrustedKey as e:
        raise JobInputError(f"checkpoint: refused: {e}") from None


__all__ = [
    "ASYNC_MODES",
    "Saver",
    "gather_loader_states",
    "save",
    "seal_key_or_fail",
    "stage",
    "unshared",
    "write",
]
