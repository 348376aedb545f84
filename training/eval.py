"""``[torchrun ...] -m training.eval --config X.yaml --checkpoint DIR [a.b=c ...]``: validate a finished run.

``DIR`` is a DCP checkpoint (``checkpoints/step-N``, or a ``checkpoints/`` folder: its newest complete
one) or a consolidated ``hf/`` export (``config.json`` + safetensors). The model is built and
parallelized from the job config exactly as the trainer does (any world size: DCP reshards), only its
weights are loaded (no optimizer state), and ``training.validation`` runs over ``data.val``. Rank 0 prints
one JSON line: ``{"checkpoint", "val_loss", "val_ppl", "val_tokens", "val_docs"}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

from configtree import ConfigError


def resolve_checkpoint(path: str) -> tuple[Path, str]:
    """``(directory, kind)`` with kind ``dcp`` or ``hf``; a ``checkpoints/`` folder means its newest one."""
    from training import checkpoint

    p = Path(path)
    if (p / checkpoint.STATE_FILE).is_file():
        return p, "dcp"
    if (p / "config.json").is_file():
        return p, "hf"
    newest = checkpoint.latest(p)
    if newest is None:
        raise ValueError(f"--checkpoint {path}: neither a checkpoint (step-N with {checkpoint.STATE_FILE}), a folder "
                         "holding complete ones, nor an hf/ export (config.json)")
    return newest, "dcp"


def evaluate_checkpoint(cfg, path: str) -> dict:
    """Build the model of ``cfg``, load the weights at ``path``, run the val stream (a collective)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    from training.parallel_dims import ParallelDims
    from training.train import build_model, forward_loss_sum, init_distributed, pick_device
    from training.validation import run_validation, val_data_config

    ckpt, kind = resolve_checkpoint(path)
    val_cfg = val_data_config(cfg.data)
    if val_cfg is None:
        raise ValueError("training.eval needs a data.val stream (e.g. data.val: {datasets: [{path: ..., split: val}]})")
    if kind == "hf":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, config=None, config_path=None,
                                                                 pretrained_path=str(ckpt)))
    device = pick_device(cfg.trainer.device)
    init_distributed(device.type)
    dims = ParallelDims.from_config(cfg.distributed, dist.get_world_size())
    meshes = dims.build_meshes(device.type)
    torch.manual_seed(cfg.trainer.seed)
    model, _ = build_model(cfg, dims, meshes, device)
    if kind == "dcp":
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(ckpt))
        set_model_state_dict(model, state["model"])
    autocast = cfg.trainer.precision == "bf16" and not isinstance(model, FSDPModule)  # as the trainer does
    result = run_validation(model, functools.partial(forward_loss_sum, autocast=autocast), val_cfg, meshes, device)
    return {"checkpoint": str(ckpt), **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the job YAML of the run (its data.val is evaluated)")
    parser.add_argument("--checkpoint", required=True, help="checkpoints/step-N, a checkpoints/ folder, or hf/")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.val.batch_size=8")
    args = parser.parse_args(argv)

    from training.config import load_job_config

    try:
        cfg = load_job_config(args.config, args.overrides)
        resolve_checkpoint(args.checkpoint)
    except (ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from training.train import process_group_closed

    with process_group_closed():
        result = evaluate_checkpoint(cfg, args.checkpoint)
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
