"""Peak memory per rank while writing the ``hf/`` export: DCP's HF writer vs a gather on rank 0.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 -m tools.bench_export --out /tmp/export_bench

An FSDP2-sharded Llama (``--hidden``, ``--layers``, ``--vocab``; fp32) is exported twice from the same
shards: ``headrace.training.checkpoint.export.export_hf`` (every rank writes its shards with DCP's
``HuggingFaceStorageWriter``, every rank consolidates some output files) and the gather it replaced
(``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` on rank 0, then one
``safetensors.save_file``). Memory is each process's peak resident set during the call above its
resident set before it (Linux: ``/proc/self/clear_refs`` resets the peak, ``VmHWM`` reads it): what the
export adds on top of the model each rank already holds. Prints one row per method.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist


def rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_during(fn) -> tuple[float, float]:
    """(peak RSS growth in MiB, seconds) of ``fn()`` in this process."""
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = rss_mib("VmRSS")
    start = time.perf_counter()
    fn()
    dist.barrier()
    return rss_mib("VmHWM") - before, time.perf_counter() - start


def gather_on_rank0(model, out: Path) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in full.items()}, str(out / "model.safetensors"))
    del full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-size-mb", type=float, default=100.0)
    args = parser.parse_args()

    from headrace.training.checkpoint.export import export_hf
    from headrace.training.config.job_config import DistributedConfig, ModelConfig
    from headrace.training.models.loss import CausalLMLoss
    from headrace.training.models.build import build_hf_config, build_meta_model, materialize
    from headrace.training.distributed.parallel_dims import ParallelDims
    from headrace.training.distributed.parallelize import parallelize

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    fields = dict(
        model_type="llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128,
        tie_word_embeddings=False,
    )
    hf_config = build_hf_config(ModelConfig(config=fields))
    dims = ParallelDims.from_config(DistributedConfig(), dist.get_world_size())
    model = parallelize(
        CausalLMLoss(build_meta_model(hf_config)), dims.build_meshes("cpu"), DistributedConfig(), torch.float32
    )
    materialize(model, torch.device("cpu"))
    total_mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    rows = [
        ("dcp_hf_writer", lambda: export_hf(model, hf_config, args.out / "dcp", shard_size_mb=args.shard_size_mb)),
        ("gather_rank0", lambda: gather_on_rank0(model, args.out / "gather")),
    ]
    for name, fn in rows:
        mib, seconds = peak_during(fn)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mib)
        if dist.get_rank() == 0:
            per_rank = " ".join(f"{m:7.0f}" for m in everyone)
            print(
                f"{name:14s} model {total_mib:6.0f} MiB fp32, {dist.get_world_size()} ranks: peak RSS growth "
                f"per rank (MiB) {per_rank}; {seconds:.1f} s",
                flush=True,
            )
    if dist.get_rank() == 0:
        shutil.rmtree(args.out, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
