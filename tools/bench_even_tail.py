"""Cost of the finite-stream tail agreement (``headrace.dataio.feed.even.even_batches``) per batch.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m tools.bench_even_tail --batches 2000

Each rank iterates ``--batches`` small in-memory batches twice, interleaved in rounds: plainly, and through
``even_batches`` on a gloo group (one all_reduce of two integers per batch in the loop's thread). Prints the
median over rounds of the extra microseconds per batch on rank 0: the price a finite stream (``data.epochs``,
validation) pays for never deadlocking at its tail. An endless training stream pays nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from headrace.dataio.feed.even import even_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo")
    batches = [{"labels": torch.zeros(1, 8, dtype=torch.long)} for _ in range(args.batches)]
    extra = []
    for _ in range(args.rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in batches:
            pass
        plain = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        for _ in even_batches(batches, group):
            pass
        agreed = time.perf_counter() - start
        extra.append((agreed - plain) / args.batches * 1e6)
    if dist.get_rank() == 0:
        print(
            f"{dist.get_world_size()} ranks, {args.batches} batches x {args.rounds} rounds: even_batches adds "
            f"{statistics.median(extra):.1f} us per batch (median; rounds {', '.join(f'{e:.1f}' for e in extra)})",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
