"""The loader stage timing's own cost per batch (``headrace.dataio.stagetimes``), as a ``timeit`` of exactly the calls
one packed batch pays: the worker's read / decode / collate stamps (``BatchMaker.__call__``), the packing stage's
fold and its own time (``PackedBatches._pack``) and the trainer's sum (``StageTotals.watch``).

    python -m tools.bench_stage_timing [--number 200000]

Prints the best of 5 repeats, in microseconds a batch; divide by the loader's time a batch (``dataio bench``'s
samples/s and batch size) for its share.
"""

from __future__ import annotations

import argparse
import time
import timeit

from headrace.dataio.stagetimes import TIMES, StageTotals, add_time, merge_times


def one_batch(totals: StageTotals) -> None:
    start = time.perf_counter()
    reading = time.perf_counter()
    collating = time.perf_counter()
    batch = {TIMES: {"read": reading - start, "decode": collating - reading}}
    add_time(batch, "collate", collating)
    packing = time.perf_counter()
    held = merge_times({}, batch.get(TIMES))
    held["pack"] = held.get("pack", 0.0) + time.perf_counter() - packing
    merge_times(totals.seconds, {TIMES: held}.get(TIMES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=200_000)
    args = parser.parse_args()
    totals = StageTotals()
    best = min(timeit.repeat(lambda: one_batch(totals), number=args.number, repeat=5)) / args.number
    print(f"stage timing per batch: {best * 1e6:.2f} us")


if __name__ == "__main__":
    main()
