"""Checkpoints that load without unpickling: DCP writing safetensors shards, JSON for the rest, saved in the
background when asked, and the consolidated HF export.

Layout: ``checkpoints/step-00000100/`` holds ``shard-0000R-model-0000K-of-0000N.safetensors`` (each rank writes
its own shards through DCP's ``HuggingFaceStorageWriter``, at most ``_FILE_BYTES`` a file) plus
``trainer_state.json``: the step, every data-parallel rank's loader state (a list ordered by dp rank, so a
different dp world can redistribute the stream), every rank's RNG state, the optimizer's non-tensor state
(``param_groups.<fqn>.lr`` ...: optimizer state is flattened to per-parameter keys, so ranks holding different
parameters, pipeline stages, write disjoint keys) and the seal (``checkpoint_seal``). A load reads the
safetensors headers (JSON) and tensor bytes with ``HuggingFaceStorageReader`` into a state dict of tensors
only, so no ``.metadata`` or byte item is ever unpickled (DCP asks the reader only for what the destination
holds); DCP reshards by FQN and chunk offsets, so a checkpoint loads into any world size or layout.

Atomicity: everything is written under ``step-N.tmp``; after every rank's files are written, rank 0 writes the
JSON last (temp file, fsync, rename) and renames the directory. ``latest()`` only considers ``step-N``
directories holding ``trainer_state.json``, so a crash at any moment leaves the previous checkpoint as the latest.
A ``folder`` that is an fsspec URL (``s3://``) gets the same checkpoint written locally, uploaded, and the state
file uploaded last as the commit marker (``checkpoint_store``).

Saves (``Saver``, ``checkpoint.async_mode``): ``disabled`` writes in the step; ``async`` copies the state to
fresh host memory and writes it from a background thread over a gloo group of its own while training goes on;
``async_with_pinned_mem`` copies into host buffers kept from the first save (page-locked where CUDA is), so a
save costs the step one memcpy and no allocation. One save at a time (a second waits, said in the log), the
final save waits, and a background failure is raised at the next step, naming the checkpoint.

The HF export (``export_hf``) never gathers the model: every rank writes its shards with DCP's
``HuggingFaceStorageWriter`` and every rank consolidates a share of the output files, so peak memory per
rank is its shard plus one tensor being copied (BENCHMARKS.md "hf export memory"). MoE experts are written
per expert, as ``save_pretrained`` and the hub have them, by the ranks holding them (``headrace.training.models.hf_experts``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import socket
import threading
from collections.abc import Callable
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
from torch.distributed.tensor import DTensor

from headrace.training.components import checkpoint_store as store
from headrace.training.components.checkpoint_fields import checked_fields
from headrace.training.components.checkpoint_prune import prune
from headrace.training.dcp_logging import quiet_metadata_fallback
from headrace.training.components.checkpoint_seal import (
    HashingFileSystem,
    Incomplete,
    NotSealed,
    UntrustedKey,
    check,
    seal,
    seal_key,
    verify_hashes,
)
from headrace.training.dir_files import file_inside
from headrace.training.distributed.parallel_dims import gather_objects
from headrace.training.errors import JobInputError
from headrace.training.models.float8 import high_precision_weights
from headrace.training.models.hf_experts import expert_converters, hub_names, per_expert_views
from headrace.training.models.loss import unwrap_causal_lm

STATE_FILE = "trainer_state.json"
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
# Optimizer state keyed by parameter name (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): ranks that
# hold different parameters (pipeline stages) then write disjoint keys instead of colliding param_groups lists.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# LoRA (``trainable_only``): frozen parameters are the base's, referenced by the trainer state, not copied; not
# strict, as the frozen keys are absent by design (a trainable key missing from the files still fails the read)
_TRAINABLE = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)
_STEP_DIR = re.compile(r"^step-(\d{8})$")
# Most bytes per safetensors file: DCP's writer builds a whole file in memory before writing it.
_FILE_BYTES = 512 * 2**20


def checkpoint_dir(folder: str | Path, step: int) -> Path | str:
    """Where the checkpoint of ``step`` lives (``step-00000100``; a URL under a URL); zero-padded so names sort by
    step."""
    name = f"step-{step:08d}"
    return store.join(str(folder), name) if store.is_url(folder) else Path(folder) / name


def latest(folder: str | Path) -> Path | str | None:
    """The newest complete checkpoint in ``folder`` (``*.tmp`` and ones without the state file are ignored)."""
    if store.is_url(folder):
        return next(reversed(store.step_folders(str(folder), STATE_FILE, complete_only=True)), None)
    folder = Path(folder)
    if not folder.is_dir():
        return None
    done = [p for p in folder.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), default=None)


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


def _joined(tensors: dict, plain: dict, saved_plain: dict, path: Path) -> tuple[dict, dict]:
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
    file last (``checkpoint_store``)."""
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
        _write_json(tmp / STATE_FILE, seal(state, {n: d for part in digests for n, d in part.items()}, key))
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
        self._buffers: dict | None = {} if async_mode == "async_with_pinned_mem" else None
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
        model_state, optim_state = get_state_dict(model, optimizer, options=_TRAINABLE if trainable_only else _OPTIONS)
        tensors, plain = split_state(high_precision_weights(model_state), optim_state)
        tensors = unshared(tensors)
        state = {
            "step": step,
            "loader": loader_states,
            "rng": gather_objects(_rng_state()),
            "optim_plain": {k: v for part in gather_objects(plain) for k, v in part.items()},
            **(extra or {}),
        }
        files = _file_index(tensors, _FILE_BYTES)
        key = seal_key_or_fail(create=True) if dist.get_rank() == 0 else None
        if self.async_mode == "disabled":
            return write(folder, step, tensors, files, state, key, keep_last=keep_last, local=local)
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        staged = stage(tensors, self._buffers, pin=self.async_mode == "async_with_pinned_mem")
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
                _say(f"checkpoint: waiting for the save of {self._writing} still being written (one at a time)")
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


def seal_key_or_fail(*, create: bool) -> bytes | None:
    """``checkpoint_seal.seal_key``, an untrusted key a ``JobInputError``."""
    try:
        return seal_key(create=create)
    except UntrustedKey as e:
        raise JobInputError(f"checkpoint: refused: {e}") from None


@contextlib.contextmanager
def export_errors(where: Path):
    """The file system's refusals while exporting ``where`` (a full disk, a file-size limit, a permission) as one
    ``JobInputError`` line naming it, as ``write_error`` does for a checkpoint save; other failures keep their
    traceback. The checkpoint of the step was saved before the export, so nothing is lost; any failure removes
    the export's temporary folder (``export_hf``'s ``hf.tmp``), so nothing partial stays behind."""
    from safetensors import SafetensorError

    try:
        try:
            yield
        except BaseException:
            shutil.rmtree(where.with_name(where.name + ".tmp"), ignore_errors=True)
            raise
    except CheckpointException as e:
        raise write_error(where, e) from e
    except OSError as e:
        raise JobInputError(f"checkpoint.export_hf: cannot write {e.filename or where}: {e.strerror or e}") from e
    except SafetensorError as e:  # safetensors' own writer: "Error while serializing: IoError(Os { code: 28, ...
        if "IoError" not in str(e):
            raise
        raise JobInputError(f"checkpoint.export_hf: cannot write {where}: {' '.join(str(e).split())[:200]}") from e


def sealed_state(path: Path) -> dict:
    """The trainer state of checkpoint ``path`` once its seal holds (``checkpoint_seal.check``; the files'
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
        candidates = (
            sorted(
                (p for p in folder.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()), reverse=True
            )
            if folder.is_dir()
            else []
        )
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
            _say(f"checkpoint {where} is incomplete ({what}): falling back to the previous one")
            continue
        check_model_config(where, what.get("model_config"), model_config)
        try:
            return where, load(path, model, optimizer, what, trainable_only)
        except CheckpointException as e:  # a header or tensor that does not fit this model
            _say(f"checkpoint {where} does not load ({one_failure(e)}): falling back to the previous one")
    if candidates:
        raise JobInputError(f"checkpoint: no complete checkpoint in {folder} (see above); move it away to start afresh")
    return None


def one_failure(e: CheckpointException) -> str:
    rank, failure = min(e.failures.items())
    cause = failure[0] if isinstance(failure, tuple) else failure
    return f"rank {rank}: {type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"


def _say(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


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
    options = _TRAINABLE if trainable_only else _OPTIONS
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    # float8 weights are read into the high-precision tensor they wrap (the one the float8 casts read)
    tensors, plain = split_state(high_precision_weights(model_state), optim_state)
    read_tensors(path, tensors)
    model_state, optim_state = _joined(tensors, plain, trainer_state["optim_plain"], path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options)
    if len(trainer_state["rng"]) == dist.get_world_size():
        torch.set_rng_state(_decode(trainer_state["rng"][dist.get_rank()]["cpu"]))
        cuda = trainer_state["rng"][dist.get_rank()].get("cuda")
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(_decode(cuda))
    return trainer_state


def load_model_weights(path: Path, model: nn.Module, trainer_state: dict, trainable_only: bool = False) -> None:
    """Only the model's weights from checkpoint ``path`` (its sealed ``trainer_state``), after its files' hashes
    hold (``damaged``: ``JobInputError``); ``trainable_only``: as ``Saver.save``'s. A collective."""
    if bad := damaged(path, trainer_state):
        raise JobInputError(f"checkpoint {path}: refused: {bad}")
    options = StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None
    tensors, _ = split_state(high_precision_weights(get_model_state_dict(model, options=options)))
    read_tensors(path, tensors)
    set_model_state_dict(model, _joined(tensors, {}, {}, path)[0], options=options)


def export_hf(
    model: nn.Module,
    hf_config,
    out_dir: str | Path,
    tokenizer: str | None = None,
    *,
    shard_size_mb: float = 5000.0,
    experts_layout: str = "per_expert",
    transform: Callable[[dict], dict] | None = None,
) -> Path:
    """Consolidated, sharded safetensors (``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``)
    + ``config.json`` (+ tokenizer) that ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads. Collective.

    No rank gathers the model: every rank writes its own shards through DCP's ``HuggingFaceStorageWriter``
    (``save_distributed``), then each rank consolidates the output files ``k`` with ``k % world == rank``
    (torch's ``consolidate_safetensors_files_on_every_rank``, the path torchtitan exports with), reading
    the shard files back from the shared directory. Output files hold at most ``shard_size_mb`` (one
    tensor larger than that gets a file of its own). ``transform(state)``: the state written instead of the
    model's own (LoRA: adapters merged into the base, ``headrace.training.models.lora.merged_state``). MoE
    experts: ``experts_layout`` ``per_expert`` writes the
    keys transformers' ``save_pretrained`` writes (the hub's, ``headrace.training.models.hf_experts``), ``fused`` the in-memory
    3D tensors (which only transformers 5 loads)."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

    state = high_precision_weights(get_model_state_dict(model))  # this rank's shards (DTensor) under HF names
    if transform is not None:
        state = transform(state)
    hf = unwrap_causal_lm(model)
    if getattr(hf_config, "tie_word_embeddings", False):  # stored once, as the embedding; re-tied on load
        state.pop(next(n for n, m in hf.named_modules() if m is hf.get_output_embeddings()) + ".weight")
    if experts_layout == "per_expert" and expert_converters(hf):
        state = per_expert_views(hf, state)
        state = dict(zip(hub_names(hf, state).values(), state.values()))
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    mapping = _file_index(state, shard_size_mb * 2**20)  # the same on every rank, also when stages differ (pp)
    dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp / "sharded"), save_distributed=True))
    consolidate_safetensors_files_on_every_rank(str(tmp / "sharded"), str(tmp), mapping)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp / "sharded")
        hf_config.save_pretrained(tmp)
        if tokenizer:
            _copy_tokenizer(tokenizer, tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    dist.barrier()
    return out_dir


def _file_index(state: dict, max_bytes: float) -> dict[str, int]:
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


def _copy_tokenizer(tokenizer: str, dest: Path) -> None:
    src = Path(tokenizer)
    if src.is_dir():
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
            "chat_template.json",
        ):
            if (path := file_inside(src, name)) is not None:  # never a link's target from outside the folder
                shutil.copyfile(path, dest / name)
    else:
        shutil.copy(src, dest / "tokenizer.json")
    if not (dest / "tokenizer_config.json").exists():  # lets AutoTokenizer.from_pretrained(hf/) find it
        _write_json(dest / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})


def _rng_state() -> dict:
    state = {"cpu": _encode(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = _encode(torch.cuda.get_rng_state())
    return state


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _decode(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


__all__ = [
    "ASYNC_MODES",
    "STATE_FILE",
    "Saver",
    "check_model_config",
    "checkpoint_dir",
    "damaged",
    "export_errors",
    "export_hf",
    "gather_loader_states",
    "latest",
    "load",
    "load_model_weights",
    "load_newest",
    "model_config_record",
    "read_tensors",
    "save",
    "sealed_state",
    "split_state",
    "stage",
    "write",
]
