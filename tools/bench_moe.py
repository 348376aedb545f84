"""Benchmark MoE experts: grouped GEMM vs per-expert loop vs transformers' own experts, and EP exchange time.

    .venv/bin/python -m tools.bench_moe experts [--tokens 4096] [--experts 16] [--hidden 512] [--device cpu]
    .venv/bin/python -m tools.bench_moe ep [--ep 2 4] [--tokens 4096]      # launches torchrun per ep size
    .venv/bin/python -m tools.bench_moe capacity [--factors none 1.25 1.0] [--skew 0 1]

experts: forward+backward of one Qwen3-MoE sparse block (router + experts, top-k routing, bf16 or fp32) on
``--tokens`` tokens; tokens/s for headrace's ``grouped_mm`` and ``loop`` experts forward and for
transformers' ``experts_implementation`` ``eager`` and ``grouped_mm`` on the same module and input (its
``batched_mm`` took 59 s a step at the defaults: ``--hf-impls`` adds it), interleaved rounds, best round
reported (headrace.dataio.bench.timing).

capacity: headrace's ``grouped_mm`` forward+backward of the same block with dropless routing and with each
capacity factor (``headrace.training.distributed.moe_routing``; ``--pad`` adds the padded-to-capacity variants): tokens/s (wall, and
per CPU-second of this process, which the other jobs on a shared box do not move), best of interleaved rounds,
and the fraction of token-expert assignments dropped. The random router routes random tokens almost evenly; ``--skew``
adds ``skew`` times one fixed random unit direction to every token (a shared component, as real hidden states
have), which gives each expert a fixed logit offset and the routing a lasting imbalance.

ep: the same block on ``--tokens`` tokens per rank with its experts split over ``ep`` gloo ranks
(headrace.training.distributed.expert_parallel): per fwd+bwd step, the step time, the seconds inside the four token exchanges
(two forward, two backward) and the bytes each rank sends. The exchange time on one CPU box is memory copies
and gloo's TCP loopback, not a network: read it as the protocol's overhead, not as cluster figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from headrace.dataio.bench.timing import best_interleaved, cpu_seconds, interleaved, timed

HEADRACE_IMPLS = ("grouped_mm", "loop")
HF_IMPLS = ("eager", "grouped_mm")  # batched_mm gathers a weight copy per token: 59 s a step at the defaults


def build_block(args, experts_implementation: str = "eager"):
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
    )
    config._experts_implementation = experts_implementation
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block.to(args.device, args.dtype)


def fwd_bwd(block, x):
    def step():
        block.zero_grad(set_to_none=True)
        x.grad = None
        y = block(x)
        y.backward(torch.ones_like(y))
        if x.device.type == "cuda":
            torch.cuda.synchronize()

    return step


def bench_experts(args) -> dict:
    from headrace.training.distributed.expert_parallel import install_experts_forward

    x = torch.randn(1, args.tokens, args.hidden, device=args.device, dtype=args.dtype, requires_grad=True)
    calls = {}
    for impl in HEADRACE_IMPLS:
        block = build_block(args)
        install_experts_forward(
            block.experts, layer=0, num_experts=args.experts, ep_group=None, ep=1, impl=impl, stats=None
        )
        calls[f"headrace {impl}"] = fwd_bwd(block, x)
    for impl in args.hf_impls:
        calls[f"transformers {impl}"] = fwd_bwd(build_block(args, impl), x)
    for call in calls.values():  # warm-up
        call()
    best = best_interleaved(calls, args.repeats)
    return {name: {"seconds": s, "tokens_per_s": args.tokens / s} for name, s in best.items()}


def bench_capacity(args) -> list[dict]:
    from headrace.training.distributed.expert_parallel import MoEStats, install_experts_forward
    from headrace.training.distributed.moe_routing import Capacity

    variants = [
        (None if f == "none" else float(f), pad)
        for f in args.factors
        for pad in ((False, True) if args.pad and f != "none" else (False,))
    ]
    out = []
    for skew in args.skew:
        gen = torch.Generator().manual_seed(1)
        direction = torch.randn(args.hidden, generator=gen)
        x = torch.randn(1, args.tokens, args.hidden, generator=gen) + skew * direction / direction.norm()
        x = x.to(args.device, args.dtype).requires_grad_()
        calls, stats = {}, {}
        for factor, pad in variants:
            name = f"skew {skew} factor {factor}" + (" padded" if pad else "")
            block, stats[name] = build_block(args), MoEStats()
            install_experts_forward(
                block.experts,
                layer=0,
                num_experts=args.experts,
                ep_group=None,
                ep=1,
                impl="grouped_mm",
                stats=stats[name],
                capacity=None if factor is None else Capacity(factor=factor, pad=pad),
            )
            calls[name] = fwd_bwd(block, x)
        for call in calls.values():  # warm-up, and the routing statistics of one step
            call()
        dropped = {name: s.dropped / float(s.tokens_per_expert[0].sum()) for name, s in stats.items()}
        imbalance = next(float(s.tokens_per_expert[0].max() / s.tokens_per_expert[0].mean()) for s in stats.values())
        rounds = interleaved(
            {name: functools.partial(wall_and_cpu, call) for name, call in calls.items()}, args.repeats
        )
        for (factor, pad), name in zip(variants, calls):
            seconds, cpu = min(r[0] for r in rounds[name]), min(r[1] for r in rounds[name])
            out.append(
                {
                    "skew": skew,
                    "factor": factor,
                    "pad": pad,
                    "imbalance": imbalance,
                    "dropped": dropped[name],
                    "seconds": seconds,
                    "tokens_per_s": args.tokens / seconds,
                    "cpu_seconds": cpu,
                    "tokens_per_cpu_s": args.tokens / cpu,
                }
            )
    return out


def wall_and_cpu(call) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds of one call (CPU seconds do not depend on the share of the
    cores other jobs leave; on CUDA they are not the kernels' time)."""
    start = cpu_seconds()[0]
    return timed(call), cpu_seconds()[0] - start


def ep_worker(args) -> None:
    """One rank of ``tools.bench_moe ep`` (under torchrun): time fwd+bwd steps of the EP-split block."""
    import torch.distributed as dist

    from headrace.training.distributed.expert_parallel import MoEStats, install_experts_forward

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, ep = dist.get_rank(), dist.get_world_size()
    block = build_block(args)
    local = args.experts // ep
    with torch.no_grad():  # this rank's slice of the fused weights (what Shard(0) on the ep mesh holds)
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(block.experts, name)
            setattr(block.experts, name, torch.nn.Parameter(full[rank * local : (rank + 1) * local].clone()))
    stats = MoEStats()
    install_experts_forward(
        block.experts,
        layer=0,
        num_experts=args.experts,
        ep_group=dist.group.WORLD,
        ep=ep,
        impl="grouped_mm",
        stats=stats,
    )
    torch.manual_seed(rank + 1)
    x = torch.randn(1, args.tokens, args.hidden, dtype=args.dtype, requires_grad=True)
    step = fwd_bwd(block, x)
    step()
    rows = []
    for _ in range(args.repeats):
        stats.reset()
        dist.barrier()
        start = time.perf_counter()
        step()
        rows.append((time.perf_counter() - start, stats.a2a_seconds, stats.a2a_bytes))
    everyone = [None] * ep
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        # per round: the slowest rank's step and exchange time, the mean bytes sent; then the median round
        rounds = sorted(
            (max(r[i][0] for r in everyone), max(r[i][1] for r in everyone), sum(r[i][2] for r in everyone) / ep)
            for i in range(args.repeats)
        )
        step_s, a2a_s, sent = rounds[len(rounds) // 2]
        print(
            json.dumps(
                {
                    "ep": ep,
                    "step_s": step_s,
                    "a2a_s": a2a_s,
                    "a2a_frac": a2a_s / step_s,
                    "a2a_mib_per_rank": sent / 2**20,
                    "tokens_per_s": ep * args.tokens / step_s,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


def bench_ep(args) -> list[dict]:
    out = []
    for ep in args.ep:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ep}",
            __file__,
            "_ep_worker",
            *sys.argv[2:],
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        out.append(json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["experts", "ep", "capacity", "_ep_worker"])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256, help="moe_intermediate_size")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--factors", nargs="+", default=["none", "1.25", "1.0"], help="capacity factors (none: dropless)"
    )
    parser.add_argument("--pad", action="store_true", help="capacity: also pad every expert to its capacity")
    parser.add_argument("--skew", type=float, nargs="+", default=[0.0, 8.0], help="capacity: shared token component")
    parser.add_argument("--hf-impls", nargs="+", default=list(HF_IMPLS), help="transformers experts_implementation(s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    args.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.what == "_ep_worker":
        return ep_worker(args)
    result = {"experts": bench_experts, "ep": bench_ep, "capacity": bench_capacity}[args.what](args)
    if args.json:
        print(json.dumps(result))
    elif args.what == "capacity":
        for r in result:
            factor = "dropless" if r["factor"] is None else f"factor {r['factor']}" + (" padded" if r["pad"] else "")
            print(
                f"skew {r['skew']:4.1f} (imbalance {r['imbalance']:4.2f}) {factor:20s} {r['tokens_per_s']:8.0f} "
                f"tokens/s {r['tokens_per_cpu_s']:8.0f} tokens/CPU-s {r['seconds'] * 1e3:7.1f} ms  "
                f"dropped {100 * r['dropped']:5.2f}%"
            )
    elif args.what == "experts":
        base = result["transformers eager"]["tokens_per_s"]
        for name, r in result.items():
            print(
                f"{name:28s} {r['tokens_per_s']:12.0f} tokens/s  {r['seconds'] * 1e3:8.1f} ms  "
                f"{r['tokens_per_s'] / base:5.2f}x eager"
            )
    else:
        for r in result:
            print(
                f"ep {r['ep']}: step {r['step_s'] * 1e3:7.1f} ms, all_to_all {r['a2a_s'] * 1e3:7.1f} ms "
                f"({100 * r['a2a_frac']:4.1f}%), {r['a2a_mib_per_rank']:6.2f} MiB sent per rank, "
                f"{r['tokens_per_s']:9.0f} tokens/s"
            )


if __name__ == "__main__":
    main()
