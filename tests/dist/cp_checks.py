"""torchrun script: context parallelism against single-process references (one 4-rank launch).

``torchrun --nproc-per-node 4 -m tests.dist.cp_checks WORKDIR`` (WORKDIR holds ``pretrained/``):

1. attention alone: for CP groups of 2 (ranks {0,1} and {2,3}) and 4, both modes, random THD layouts
   (documents shorter than 2P, straddling chunk and rank boundaries, empty segments, GQA): each rank's
   output and dq/dk/dv equal the per-document reference on the unsplit padded layout, fp32;
2. training: cp4 (both modes), cp2 x dp2 FSDP2 (both modes), cp2 x tp2 with sequence parallel and
   activation checkpointing: losses, grad norms and final weights equal the single-process reference
   of tests/dist/train_layouts.py on the same packed batches (which have padding tails and short
   documents; asserted below); the logged CP metrics are consistent;
3. resume: the cp2 x dp2 checkpoint of step 2 continues at cp1 (dp4) and at cp4 with the losses of the
   uninterrupted run.
Prints ``OK <check>`` per passed check; any mismatch raises.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist.train_common import packed_batches
from tests.dist.train_layouts import (
    GLOBAL_MICRO, STEPS, check_close, exported_params, job, loaders, reference, resume_step2,
)

from headrace.dataio.feed.cp_split import cp_shard  # noqa: E402
from headrace.kernels.cp_attention import MODES, cp_attention  # noqa: E402
from headrace.kernels.varlen_attention import varlen_attention_reference  # noqa: E402
from headrace.training.train import train  # noqa: E402


def random_layout(gen: torch.Generator, cp: int) -> torch.Tensor:
    """cu_seqlens of a random packed row: short (< 2cp), odd, long and empty segments."""
    lengths = torch.randint(0, 6 * cp, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen)
    lengths[0] = max(1, int(lengths[0]))
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).int()


def check_attention(cp: int, group, cp_rank: int, trials: int = 6) -> None:
    gen = torch.Generator().manual_seed(cp)
    for trial in range(trials):
        cu = random_layout(gen, cp)
        total = int(cu[-1])
        dummy = {k: torch.zeros(1, total, dtype=torch.long) for k in ("input_ids", "labels", "position_ids")}
        shard = cp_shard(dict(dummy, cu_seqlens=cu), cp, cp_rank)
        padded_cu, idx = shard["cu_seqlens_padded"], shard["padded_index"]
        n = int(padded_cu[-1])
        heads, kv_heads, dim = (4, 2, 8) if trial % 2 else (2, 2, 16)
        q, k, v, w = (torch.randn(n, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads, heads))
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = varlen_attention_reference(*full, padded_cu)
        (ref * w).sum().backward()
        for mode in MODES:
            local = [x[idx].clone().requires_grad_() for x in (q, k, v)]
            out = cp_attention(*local, shard["cu_seqlens"], group, mode=mode)
            (out * w[idx]).sum().backward()
            check_close(f"cp{cp} {mode} out", out.detach(), ref.detach()[idx], 1e-5)
            for name, got, want in zip("qkv", local, full):
                check_close(f"cp{cp} {mode} d{name} (trial {trial})", got.grad, want.grad[idx], 1e-5)
    print(f"OK cp{cp} attention matches the per-document reference (both modes, {trials} layouts)", flush=True)


def check_batches_cover_edge_cases(batches: list[dict]) -> None:
    """The training batches must contain what the issue asks CP to get right."""
    padded_tail = any(int(b["labels"][r, -1]) == -100 for b in batches for r in range(b["labels"].shape[0]))
    lengths = torch.cat([(b["cu_seqlens"][1:] - b["cu_seqlens"][:-1]).long() for b in batches])
    assert padded_tail, "no row with a padding tail"
    assert bool((lengths < 8).any()), "no document shorter than 2 x cp (8) tokens"
    assert bool((lengths % 8 != 0).any()), "no document straddling a chunk boundary"


def train_layouts(workdir: Path, batches: list[dict]) -> None:
    ref_losses, ref_norms, ref_params = reference(workdir, batches)
    layouts = {
        "cp4_allgather": (dict(cp_size=4, cp_comm="allgather"), 4),
        "cp4_ring": (dict(cp_size=4, cp_comm="ring"), 4),
        "cp2_dp2_allgather": (dict(cp_size=2, cp_comm="allgather"), 2),
        "cp2_dp2_ring": (dict(cp_size=2, cp_comm="ring"), 2),
        "cp2_tp2_sp_ac": (dict(cp_size=2, cp_comm="ring", tp_size=2, sequence_parallel=True,
                               activation_checkpointing=True), 4),
    }
    for name, (distributed, k) in layouts.items():
        history = train(job(workdir, name, dict(strategy="fsdp2", **distributed), k), loaders(batches, k))
        check_close(f"{name} losses", [r["loss"] for r in history], ref_losses, 2e-5)
        check_close(f"{name} grad norms", [r["grad_norm"] for r in history], ref_norms, 1e-4)
        for r in history:
            assert r["cp_imbalance"] >= 1.0 and r["cp_bytes_sent"] > 0, r
        if dist.get_rank() == 0:
            params = exported_params(workdir / name)
            for key, value in params.items():
                check_close(f"{name} param {key}", value, ref_params[key], 5e-5)
        print(f"OK {name} matches the single-process reference", flush=True)


def resume_other_cp(workdir: Path, batches: list[dict]) -> None:
    expected = [r["loss"] for r in train(job(workdir, "cp2_full", dict(cp_size=2, cp_comm="ring"), 2),
                                          loaders(batches, 2))]
    for name, distributed, k in (("resume_cp1", dict(cp_size=1), 1),
                                 ("resume_cp4", dict(cp_size=4, cp_comm="allgather"), 4)):
        resume_step2(workdir, "cp2_full", name, distributed, k, batches, expected)
        print(f"OK cp2 checkpoint resumes as {name}", flush=True)


def main() -> None:
    workdir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    check_attention(2, pairs[rank // 2], rank % 2)
    check_attention(4, dist.group.WORLD, rank)
    batches = packed_batches(STEPS * GLOBAL_MICRO)
    check_batches_cover_edge_cases(batches)
    train_layouts(workdir, batches)
    resume_other_cp(workdir, batches)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
