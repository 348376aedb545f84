"""Position -> (dataset, draw) cost: ``EpochizedSchedule`` (energon ``blend_epochized``) beside ``BlendSchedule``.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench_schedule

Both schedules over the same datasets (4 and 64 of them, ~5.2M / ~83M positions an epoch); each call
locates one 1024-sample batch of a DP rank of 64 (positions 64 apart). Prints CPU microseconds per call,
the minimum of 5 interleaved repetitions of 500 calls (CPU time, so a loaded machine skews it less).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from headrace.dataio.stream.ordering.blend import BlendSchedule
from headrace.dataio.stream.ordering.epochized import EpochizedSchedule

COUNTS = [3_000_000, 1_500_000, 700_001, 12_345]


def cpu_us_per_call(schedule, *, calls: int, batch: int, dp: int) -> float:
    start = time.process_time()
    for i in range(calls):
        schedule.locate(dp * (np.arange(batch) + i * batch))
    return (time.process_time() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dp", type=int, default=64)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for datasets in (4, 64):
        counts = (COUNTS * 16)[:datasets]
        schedules = {
            "BlendSchedule": BlendSchedule([c / sum(counts) for c in counts], counts),
            "EpochizedSchedule": EpochizedSchedule(counts),
        }
        best = dict.fromkeys(schedules, float("inf"))
        for _ in range(args.repeats):
            for name, schedule in schedules.items():
                best[name] = min(best[name], cpu_us_per_call(schedule, calls=args.calls, batch=args.batch, dp=args.dp))
        print(f"{datasets} datasets: " + ", ".join(f"{name} {us:.0f} us CPU" for name, us in best.items()))


if __name__ == "__main__":
    main()
