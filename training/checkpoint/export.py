"""The consolidated ``hf/`` export: sharded safetensors that ``AutoModelForCausalLM.from_pretrained`` loads.

It never gathers the model: every rank writes its shards with DCP's ``HuggingFaceStorageWriter`` and every rank
consolidates a share of the output files, so peak memory per rank is its shard plus one tensor being copied
(BENCHMARKS.md "hf export memory"). MoE experts are written per expert, as ``save_pretrained`` and the hub have
them, by the ranks holding them (``headrace.training.models.hf_experts``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
)

from headrace.training.dir_files import file_inside
from headrace.training.errors import JobInputError
from headrace.training.models.float8 import high_precision_weights
from headrace.training.models.hf_experts import expert_converters, hub_names, per_expert_views
from headrace.training.models.loss import unwrap_causal_lm
from headrace.training.checkpoint.layout import (
    file_index,
    write_error,
    write_json,
)


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
    mapping = file_index(state, shard_size_mb * 2**20)  # the same on every rank, also when stages differ (pp)
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
        write_json(dest / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})


__all__ = [
    "export_errors",
    "export_hf",
]
