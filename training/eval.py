"""``[torchrun ...] -m headrace.training.eval --config X.yaml --checkpoint DIR [a.b=c ...]``: validate a finished run.

``DIR`` is a checkpoint (``checkpoints/step-N``, or a ``checkpoints/`` folder: its newest complete
one) or a consolidated ``hf/`` export (``config.json`` + safetensors). A checkpoint gets the trainer's
guarantees: its seal must hold under this user's key and its files' hashes must match before any tensor is
read, and nothing is unpickled (``headrace.training.checkpoint.restore``). The model is built and
parallelized from the job config exactly as the trainer does (any world size: DCP reshards), only its
weights are loaded (no optimizer state), and ``headrace.training.validation`` runs over ``data.val``. Rank 0 prints
one JSON line: ``{"checkpoint", "val_loss", "val_ppl", "val_tokens", "val_docs"}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from headrace.config import ConfigError


def resolve_checkpoint(path: str) -> tuple[Path, str]:
    """``(directory, kind)`` with kind ``dcp`` or ``hf``; a ``checkpoints/`` folder means its newest one."""
    # deferred: the CLI's --help and argument errors load no torch
    from headrace.training.checkpoint import layout

    p = Path(path)
    if (p / layout.STATE_FILE).is_file():
        return p, "dcp"
    if (p / "config.json").is_file():
        return p, "hf"
    newest = layout.latest(p)
    if newest is None:
        raise ValueError(
            f"--checkpoint {path}: neither a checkpoint (step-N with {layout.STATE_FILE}), a folder "
            "holding complete ones, nor an hf/ export (config.json)"
        )
    return newest, "dcp"


def check_inputs(cfg, path: str) -> tuple[Path, str, dict | None]:
    """``(directory, kind, sealed trainer state or None)``; ValueError (one line) when ``cfg`` has no val stream,
    the checkpoint's seal does not hold, or it cannot hold the model."""
    # deferred, these four: the CLI's --help loads no torch
    from headrace.training.checkpoint.restore import sealed_state
    from headrace.training.checkpoint.seal import Incomplete, NotSealed
    from headrace.training.config.validate import check_validation
    from headrace.training.model_kinds import model_kind

    ckpt, kind = resolve_checkpoint(path)
    check_validation(cfg)
    state = None
    if kind == "dcp":
        try:
            state = sealed_state(ckpt)  # before any tensor is read
        except (Incomplete, NotSealed) as e:
            raise ValueError(f"--checkpoint {ckpt}: refused: {e}") from None
    refusal = model_kind(cfg).hf_export_refusal
    if kind == "hf" and refusal is not None:
        raise ValueError(f"--checkpoint {path}: {refusal}")
    return ckpt, kind, state


def evaluate_checkpoint(cfg, path: str) -> dict:
    """Build the model of ``cfg`` (its pipeline when pp > 1), load the weights at ``path``, run the val
    stream (a collective)."""
    # deferred, all of these: the CLI's --help and argument errors load no torch
    import torch
    import torch.distributed as dist
    from headrace.training.checkpoint.restore import load_model_weights
    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.distributed.process_group import init_distributed, pick_device
    from headrace.training.model_kinds import build_model_or_pipeline, model_kind
    from headrace.training.models.converters import build_converters, for_merged_export
    from headrace.training.validation import make_validator

    ckpt, kind, state = check_inputs(cfg, path)
    cfg = model_kind(cfg).prepare_job(cfg)  # the job as the trainer ran it (a SALM on a speech LLM's checkpoint)
    if kind == "hf":
        cfg = for_merged_export(  # a LoRA run's hf/ holds the merged model
            dataclasses.replace(
                cfg, model=dataclasses.replace(cfg.model, config=None, config_path=None, pretrained_path=str(ckpt))
            )
        )
    device = pick_device(cfg.trainer.device)
    init_distributed(device.type)
    dims = ParallelDims.from_config(cfg.distributed, dist.get_world_size())
    dims.build_meshes(device.type)
    torch.manual_seed(cfg.trainer.seed)
    model, _, pipe = build_model_or_pipeline(cfg, dims, device)
    validate = make_validator(cfg, dims, device, model, pipe)
    if kind == "dcp":
        # a LoRA checkpoint holds the trainable parameters only; the frozen base is built from the job's config
        load_model_weights(ckpt, model, state, trainable_only=build_converters(cfg).trainable_only)
    return {"checkpoint": str(ckpt), **validate()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m headrace.training.eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="the job YAML of the run (its data.val is evaluated)")
    parser.add_argument("--checkpoint", required=True, help="checkpoints/step-N, a checkpoints/ folder, or hf/")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.val.batch_size=8")
    args = parser.parse_args(argv)

    from headrace.training.config.load import (
        load_job_config,
    )  # deferred: the CLI's --help and argument errors load no torch

    try:
        cfg = load_job_config(args.config, args.overrides)
        check_inputs(cfg, args.checkpoint)
    except (ConfigError, OSError, ValueError) as e:
        if int(os.environ.get("RANK", 0)) == 0:  # the same on every rank of a torchrun: said once
            print(f"error: {e}", file=sys.stderr)
        return 2
    # deferred, these two: the CLI's --help and argument errors load no torch
    import torch.distributed as dist

    from headrace.training.distributed.process_group import process_group_closed

    with process_group_closed():
        try:
            result = evaluate_checkpoint(cfg, args.checkpoint)
        except ConfigError as e:  # JobInputError: a checkpoint file that does not hash to its seal, alike on every rank
            if dist.get_rank() == 0:
                print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
