"""Checkpoints: DCP for model + optimizer, a small JSON for everything else, and the consolidated HF export.

Layout: ``checkpoints/step-00000100/`` holds the DCP files (each rank writes its own shards, so saving
is parallel and a checkpoint loads into any world size or layout: DCP reshards by FQN and DTensor
placement; optimizer state is flattened to per-parameter keys, so pipeline stages reshard to any pp too)
plus ``trainer_state.json``: the step, every data-parallel rank's loader state (a list ordered by dp rank,
so a different dp world can redistribute the stream) and every rank's RNG state.

Atomicity: everything is written under ``step-N.tmp``; after a barrier rank 0 writes the JSON last
(temp file, fsync, rename) and renames the directory. ``latest()`` only considers ``step-N`` directories
holding ``trainer_state.json``, so a crash at any moment leaves the previous checkpoint as the latest.

Trust and completeness (``headrace.training.components.checkpoint_seal``): the JSON also records every file's size and an HMAC of
DCP's ``.metadata`` (a pickle) keyed by the run's ``checkpoints/.seal-key``; ``load_newest`` checks them before
DCP reads anything, refuses a directory this run did not write, and falls back to the previous checkpoint when
the newest is incomplete (saying so). The JSON carries the model's config too, compared key by key on resume.

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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from torch.distributed.checkpoint.api import CheckpointException

from headrace.training.components.checkpoint_seal import Incomplete, NotSealed, check, seal, seal_key
from headrace.training.dir_files import file_inside
from headrace.training.errors import JobInputError
from headrace.training.models.hf_experts import expert_converters, hub_names, per_expert_views
from headrace.training.models.loss import unwrap_causal_lm
from headrace.training.distributed.parallel_dims import gather_objects

STATE_FILE = "trainer_state.json"
# Optimizer state keyed by parameter name (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): ranks that
# hold different parameters (pipeline stages) then write disjoint keys instead of colliding param_groups lists.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(folder: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives (``step-00000100``); zero-padded so names sort by step."""
    return Path(folder) / f"step-{step:08d}"


def latest(folder: str | Path) -> Path | None:
    """The newest complete checkpoint in ``folder`` (``*.tmp`` and ones without the state file are ignored)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    done = [p for p in folder.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), default=None)


def save(folder: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         loader_states: list, keep_last: int | None = None, *, extra: dict | None = None) -> Path:
    """Write checkpoint ``step`` atomically (a collective: every rank calls it). ``extra``: more JSON for the
    trainer state (the model config, the run's first loss). A write that fails (a full disk) is one line
    naming the directory, on every rank."""
    final = checkpoint_dir(folder, step)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)  # leftovers of a crashed save
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    except CheckpointException as e:
        raise write_error(tmp, e) from e
    rng = gather_objects(_rng_state())
    dist.barrier()
    if dist.get_rank() == 0:
        state = {"step": step, "loader": loader_states, "rng": rng, **(extra or {})}
        _write_json(tmp / STATE_FILE, seal(state, tmp, seal_key(Path(folder), create=True), STATE_FILE))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(Path(folder), keep_last)
    dist.barrier()
    return final


def gather_loader_states(batches, dp_mesh) -> list:
    """Every dp rank's loader state as of the last batch trained on, ordered by dp rank (TP/CP/PP peers hold
    identical ones): what ``save`` stores. Taken from ``batches`` (the ``DevicePrefetcher``), which may have read
    ahead of the step. A collective."""
    by_dp = dict(gather_objects((dp_mesh.get_local_rank(), batches.state_dict())))
    return [by_dp[r] for r in range(len(by_dp))]


def write_error(where: Path, e: CheckpointException) -> Exception:
    """One line for a failed DCP write: the directory and the first rank's cause, when the cause is the file
    system's (an OS error: a full disk, a file-size limit, a permission; or torch's zip writer failing
    mid-file, ``unexpected pos``); any other failure keeps its traceback."""
    for rank, failure in sorted(e.failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, OSError):
            what = f"{cause.strerror or cause}{f' ({cause.filename})' if cause.filename else ''}"
        elif isinstance(cause, RuntimeError) and "unexpected pos" in str(cause):
            what = "a file stopped growing mid-write (disk full or a file-size limit?)"
        else:
            continue
        return JobInputError(f"checkpoint: cannot write {where} (rank {rank}): {what}")
    return e


@contextlib.contextmanager
def export_errors(where: Path):
    """The file system's refusals while exporting ``where`` (a full disk, a file-size limit, a permission) as one
    ``JobInputError`` line naming it, as ``write_error`` does for a checkpoint save; other failures keep their
    traceback. The checkpoint of the step was saved before the export, so nothing is lost."""
    from safetensors import SafetensorError

    try:
        yield
    except CheckpointException as e:
        raise write_error(where, e) from e
    except OSError as e:
        raise JobInputError(f"checkpoint.export_hf: cannot write {e.filename or where}: {e.strerror or e}") from e
    except SafetensorError as e:  # safetensors' own writer: "Error while serializing: IoError(Os { code: 28, ...
        if "IoError" not in str(e):
            raise
        raise JobInputError(f"checkpoint.export_hf: cannot write {where}: {' '.join(str(e).split())[:200]}") from e


def sealed_state(path: Path) -> dict:
    """The trainer state of checkpoint ``path`` once its seal holds (``headrace.training.components.checkpoint_seal.check``)."""
    return check(path, seal_key(path.parent, create=False), STATE_FILE)


def load_newest(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                model_config: dict) -> tuple[Path, dict] | None:
    """Load the newest complete checkpoint of ``folder`` (``load``) and return ``(path, trainer state)``; None
    when there is none. Rank 0 checks each candidate's seal and every rank learns the verdict: an incomplete one
    is skipped for the previous one (said on rank 0), one this run did not write or one of another model is a
    ``JobInputError`` on every rank. A collective."""
    folder = Path(folder)
    candidates = sorted((p for p in folder.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()),
                        reverse=True) if folder.is_dir() else []
    for path in candidates:
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
            raise JobInputError(f"checkpoint {path}: refused: {what}; loading it would unpickle its files "
                                "(README, security notes)")
        if kind == "incomplete":
            _say(f"checkpoint {path} is incomplete ({what}): falling back to the previous one")
            continue
        check_model_config(path, what.get("model_config"), model_config)
        try:
            return path, load(path, model, optimizer, what)
        except CheckpointException as e:  # a data file damaged at its right size
            _say(f"checkpoint {path} does not load ({one_failure(e)}): falling back to the previous one")
    if candidates:
        raise JobInputError(f"checkpoint: no complete checkpoint in {folder} (see above); move it away to start "
                            "afresh")
    return None


def one_failure(e: CheckpointException) -> str:
    rank, failure = min(e.failures.items())
    cause = failure[0] if isinstance(failure, tuple) else failure
    return f"rank {rank}: {type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"


def _say(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


# config keys that say nothing about the weights' meaning: bookkeeping, and what only initialisation reads
_NOT_THE_MODEL = {"transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype", "use_cache",
                  "_attn_implementation_autoset", "attn_implementation", "_attn_implementation", "initializer_range",
                  "output_attentions", "output_hidden_states", "return_dict", "_commit_hash"}


def model_config_record(hf_config) -> dict:
    """What ``check_model_config`` compares: the model's config as JSON, without ``_NOT_THE_MODEL``."""
    fields = json.loads(json.dumps(hf_config.to_dict(), default=str))
    return {k: v for k, v in fields.items() if k not in _NOT_THE_MODEL}


def check_model_config(path: Path, saved: dict | None, current: dict) -> None:
    """``JobInputError`` naming every key whose value differs between the checkpoint's model and this job's."""
    if saved is None:
        raise JobInputError(f"checkpoint {path}: records no model config to compare with this job's")
    differ = [f"{k} {saved.get(k, '(unset)')!r} -> {current.get(k, '(unset)')!r}"
              for k in sorted(saved.keys() | current.keys()) if saved.get(k) != current.get(k)]
    if differ:
        raise JobInputError(f"checkpoint {path} holds another model than this job's model config: "
                            f"{'; '.join(differ)} (resume with the model it was trained with, or set "
                            "checkpoint.resume: false / another trainer.output_dir)")


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict) -> dict:
    """Restore model and optimizer from ``path`` into the current layout; returns ``trainer_state`` (the
    checked JSON of ``path``), after restoring this rank's RNG when the world size is unchanged."""
    path = Path(path)
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_OPTIONS)
    if len(trainer_state["rng"]) == dist.get_world_size():
        torch.set_rng_state(_decode(trainer_state["rng"][dist.get_rank()]["cpu"]))
        cuda = trainer_state["rng"][dist.get_rank()].get("cuda")
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(_decode(cuda))
    return trainer_state


def export_hf(model: nn.Module, hf_config, out_dir: str | Path, tokenizer: str | None = None, *,
              shard_size_mb: float = 5000.0, experts_layout: str = "per_expert") -> Path:
    """Consolidated, sharded safetensors (``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``)
    + ``config.json`` (+ tokenizer) that ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads. Collective.

    No rank gathers the model: every rank writes its own shards through DCP's ``HuggingFaceStorageWriter``
    (``save_distributed``), then each rank consolidates the output files ``k`` with ``k % world == rank``
    (torch's ``consolidate_safetensors_files_on_every_rank``, the path torchtitan exports with), reading
    the shard files back from the shared directory. Output files hold at most ``shard_size_mb`` (one
    tensor larger than that gets a file of its own). MoE experts: ``experts_layout`` ``per_expert`` writes the
    keys transformers' ``save_pretrained`` writes (the hub's, ``headrace.training.models.hf_experts``), ``fused`` the in-memory
    3D tensors (which only transformers 5 loads)."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

    state = get_model_state_dict(model)  # this rank's shards (DTensor) under HF names
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
    sizes = {fqn: size for part in gather_objects([(fqn, t.numel() * t.element_size()) for fqn, t in state.items()])
             for fqn, size in part}
    mapping, index, used = {}, 1, 0
    for fqn, size in sizes.items():
        if used and used + size > max_bytes:
            index, used = index + 1, 0
        mapping[fqn], used = index, used + size
    return mapping


def _copy_tokenizer(tokenizer: str, dest: Path) -> None:
    src = Path(tokenizer)
    if src.is_dir():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                     "chat_template.json"):
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


def _prune(folder: Path, keep_last: int | None) -> None:
    if not keep_last:
        return
    done = sorted(p for p in folder.iterdir() if _STEP_DIR.match(p.name))
    for old in done[:-keep_last]:
        shutil.rmtree(old)


__all__ = ["STATE_FILE", "check_model_config", "checkpoint_dir", "export_errors", "export_hf", "gather_loader_states",
           "latest", "load", "load_newest", "model_config_record", "save", "sealed_state"]
