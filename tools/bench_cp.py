"""Benchmark context parallelism on CPU: saved activations per rank, tokens/s per mode, work imbalance.

    .venv/bin/python -m tools.bench_cp imbalance [--seq-lens 16384 32768]
    .venv/bin/torchrun --nproc-per-node 4 -m tools.bench_cp train [--seq-lens 16384 32768] [--steps 2]

imbalance: the demo corpus's real documents (``headrace.dataio.bench.corpus.demo_token_documents``, byte tokens)
packed best-fit into rows of seq_len; per row, ``headrace.dataio.feed.cp_split.attention_work``'s max/mean causal work
over the CP ranks for the head-tail split and, beside it, a contiguous split. Prints mean and worst row.

train: one tiny Llama (``--hidden``, 2 layers, GQA 4/2 heads) with ``headrace_varlen`` attention, the
trainer's ``CausalLMLoss`` and ``forward_loss_sum``, on one packed row of demo documents per seq_len. For
cp 1, 2, 4 (the first cp ranks form the group; the others wait) and each ``cp_comm`` mode: the bytes of
tensors saved for backward on rank 0 during the forward, counted with
``torch.autograd.graph.saved_tensors_hooks`` (distinct storages, parameters excluded), their ratio to
1/cp of cp 1, the best fwd+bwd step time over ``--steps`` (after one warm-up) as row tokens/s, rank 0's
CPU seconds in that step (``time.process_time``: robust to other load on a shared machine), and the
bytes rank 0 sent for attention per step. Ranks share the machine's cores: on a 2-core box cp 4 runs
4 processes on 2 cores, so its tokens/s shows the overhead, not the speed-up a cp-core machine gets.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from headrace.dataio.bench.corpus import demo_token_documents
from headrace.dataio.feed.cp_split import attention_work, cp_shard
from headrace.dataio.batching.packing import Packer, pack
from headrace.dataio.config import PackingConfig


def packed_rows(seq_len: int, rows: int) -> list[dict]:
    """``rows`` single-row packed batches of demo-corpus documents."""
    docs = demo_token_documents(3000)
    packer = Packer(PackingConfig(seq_len=seq_len, packing="best_fit", packing_buffer=64), rows_per_batch=1)
    out = []
    for batch in pack(enumerate(docs), packer):
        out.append(batch)
        if len(out) == rows:
            break
    return out


def run_imbalance(seq_lens: list[int]) -> None:
    print("| seq_len | cp | rows | head-tail mean | head-tail worst | contiguous mean | contiguous worst |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in seq_lens:
        rows = packed_rows(seq_len, 32)
        for cp in (2, 4, 8):
            reports = [attention_work(r["cu_seqlens"], cp) for r in rows]
            ht = [r["causal"]["imbalance"] for r in reports]
            cont = [r["causal_contiguous"]["imbalance"] for r in reports]
            print(
                f"| {seq_len} | {cp} | {len(rows)} | {sum(ht) / len(ht):.4f} | {max(ht):.4f} | "
                f"{sum(cont) / len(cont):.3f} | {max(cont):.3f} |"
            )


def saved_bytes(fn, params: set[int]) -> tuple[object, int]:
    """Run ``fn``; return its result and the bytes of distinct storages saved for backward, except those
    whose address is in ``params``."""
    storages: dict[int, int] = {}

    def pack_hook(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        result = fn()
    return result, sum(storages.values())


def run_train(seq_lens: list[int], steps: int, hidden: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from headrace.kernels.cp_attention import exchanged_bytes
    from headrace.kernels.hf_attention import register_varlen_attention
    from headrace.training.distributed.context_parallel import cp_attention_kwargs
    from headrace.training.models.loss import CausalLMLoss
    from headrace.training.step import forward_loss_sum

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = AutoConfig.for_model(
        "llama",
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(seq_lens),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = CausalLMLoss(AutoModelForCausalLM.from_config(config, attn_implementation=register_varlen_attention()))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    groups = {cp: dist.new_group(list(range(cp))) for cp in (1, 2, 4) if cp <= world}
    if rank == 0:
        print(
            f"tiny llama hidden {hidden}, 2 layers, 4/2 heads; {world} ranks on {torch.get_num_threads()} "
            f"thread(s) each"
        )
        print(
            "| seq_len | cp | mode | saved MiB/rank | x (cp1 / cp) | tokens/s | step s | rank-0 CPU s | "
            "MiB sent/rank/step |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
    for seq_len in seq_lens:
        batch = packed_rows(seq_len, 1)[0]
        base = None
        for cp, group in groups.items():
            for mode in ("allgather", "ring") if cp > 1 else ("-",):
                if rank < cp:
                    shard = cp_shard(batch, cp, rank) if cp > 1 else batch

                    def step():
                        kwargs = cp_attention_kwargs(_Mesh(group, cp), mode) if cp > 1 else {}
                        model.zero_grad(set_to_none=True)
                        loss, saved = saved_bytes(lambda: forward_loss_sum(model, shard, False, kwargs), params)
                        loss.backward()
                        return saved

                    saved = step()  # warm-up (plans, allocator)
                    times, cpu = [], []
                    for _ in range(steps):
                        dist.barrier(group)
                        start, start_cpu = time.perf_counter(), time.process_time()
                        step()
                        times.append(time.perf_counter() - start)
                        cpu.append(time.process_time() - start_cpu)
                    sent = exchanged_bytes() if cp > 1 else 0
                    if rank == 0:
                        base = saved if cp == 1 else base
                        best = min(times)
                        print(
                            f"| {seq_len} | {cp} | {mode} | {saved / 2**20:.1f} | {saved * cp / base:.3f} | "
                            f"{seq_len / best:,.0f} | {best:.2f} | {min(cpu):.2f} | {sent / 2**20:.1f} |",
                            flush=True,
                        )
                dist.barrier()
    dist.destroy_process_group()


class _Mesh:
    """The two DeviceMesh methods ``cp_attention_kwargs`` reads, for a plain process group."""

    def __init__(self, group, size):
        self.group, self._size = group, size

    def get_group(self):
        return self.group

    def size(self):
        return self._size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["imbalance", "train"])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    if args.what == "imbalance":
        run_imbalance(args.seq_lens)
    else:
        run_train(args.seq_lens, args.steps, args.hidden)


if __name__ == "__main__":
    main()
