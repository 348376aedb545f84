"""Shuffle quality and shards per batch of the epoch order, today's sample window against the
shard window (``data.shuffle_window_shards``), on shard layouts from few large to many small shards.

    .venv/bin/python -m tools.shuffle_quality [--batch 256] [--window 8192] [--window-shards 64]

For each layout (``SHARDS x SAMPLES`` a shard) and each order, one full epoch of ``EpochOrder`` (what one
rank with 0 workers reads; the positions a loader hands out are these): the metrics of
``tools.bench_loader.shuffle_quality`` (mean gap between consecutive outputs in source order as a
fraction of the epoch, 0.33 for a uniform permutation; output/source position correlation, 0 for one),
the fraction of consecutive outputs from one shard (1/shards for a uniform permutation), and the mean
and largest number of distinct shards in a batch of ``--batch`` (what the open-shard budget must hold
for a batch to reopen nothing), and the time of the epoch's order. Pure numpy, seconds per layout.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from headrace.dataio.stream.ordering.epoch_order import EpochOrder
from tools.bench_loader import shuffle_quality

LAYOUTS = ((10, 100_000), (100, 10_000), (1_000, 1_000), (10_000, 100), (100_000, 10))


def measure(shards: int, per_shard: int, batch: int, window: int, window_shards: int) -> dict:
    sizes = np.full(shards, per_shard, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    order = EpochOrder(starts, sizes, seed=0, shuffle=True, window=window, window_shards=window_shards)
    t0 = time.perf_counter()
    n = len(order)
    out = np.concatenate([order.indices(0, np.arange(a, min(n, a + batch))) for a in range(0, n, batch)])
    seconds = time.perf_counter() - t0
    assert np.array_equal(np.sort(out), np.arange(n))
    shard = out // per_shard
    usable = n // batch * batch
    per_batch = [len(set(b.tolist())) for b in shard[:usable].reshape(-1, batch)]
    return {
        **shuffle_quality(out),
        "same_shard_neighbours": round(float((shard[1:] == shard[:-1]).mean()), 4),
        "shards_per_batch": round(float(np.mean(per_batch)), 1),
        "max_shards_per_batch": int(max(per_batch)),
        "order_s": round(seconds, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--window", type=int, default=8192)
    p.add_argument("--window-shards", type=int, default=64)
    args = p.parse_args()
    print(
        "| shards x samples | order | mean gap | position correlation | same-shard neighbours "
        "| shards per batch (mean / max) | epoch order s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for shards, per_shard in LAYOUTS:
        for name, ws in (("sample window", 0), (f"shard window ({args.window_shards})", args.window_shards)):
            m = measure(shards, per_shard, args.batch, args.window, ws)
            print(
                f"| {shards:,} x {per_shard:,} | {name} | {m['mean_gap']} | {m['position_correlation']} "
                f"| {m['same_shard_neighbours']} | {m['shards_per_batch']} / {m['max_shards_per_batch']} "
                f"| {m['order_s']} |"
            )


if __name__ == "__main__":
    main()
