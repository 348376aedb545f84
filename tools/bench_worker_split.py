"""What splitting the loader's work over processes can give on this machine: the ceiling for workers.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench_worker_split --data /tmp/lp-bench/text13k \\
        [--batch-sizes 32,256] [--rounds 5]

Three ways to make one epoch of plain batches (no shuffle, ``epochs: 1``), each from a loader built
fresh in this process, interleaved over ``--rounds``:

- ``one process``: this process makes every batch (the loader with ``num_workers: 0``);
- ``split, no transport``: the loader's own batch function (``RankBatches.make_batch``) run in 2
  processes forked after the first batch, process ``w`` making batches ``b % 2 == w`` into its own
  memory and dropping them: the work split in two with nothing sent anywhere and no main process --
  what 2 workers would reach if their transport and the main process cost nothing;
- ``2 workers``: the loader with ``num_workers: 2`` (ring, pipes, main process).

Prints the median samples/s of each and their ratios to one process. The batch function is taken from
the loader by wrapping ``headrace.dataio.stream.rank.iterate`` (it receives the ``RankBatches``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import time


def _cfg(data: str, batch: int, workers: int):
    from headrace.config import from_dict
    from headrace.dataio.config import DataConfig

    cfg = from_dict(DataConfig, {"datasets": [{"path": data}], "batch_size": batch}, "data")
    return dataclasses.replace(cfg, num_workers=workers, shuffle=False, epochs=1, packing="none", seq_len=None)


def loader_epoch(data: str, batch: int, workers: int) -> float:
    """Samples/s of one epoch of the loader, from its construction to its last batch."""
    from headrace.dataio import build_loader

    start, n = time.perf_counter(), 0
    for b in build_loader(_cfg(data, batch, workers), dp_rank=0, dp_size=1):
        n += len(b["__key__"])
        del b
    return n / (time.perf_counter() - start)


def split_epoch(data: str, batch: int, processes: int = 2) -> float:
    """Samples/s of one epoch made by ``processes`` forked processes with no transport (see the docstring)."""
    import headrace.dataio.stream.rank as rank
    from headrace.dataio import build_loader
    from headrace.dataio.stream.reading.collate import plain_memory

    captured = {}
    iterate = rank.iterate

    def capture(batches, **kwargs):
        captured["batches"] = batches
        return iterate(batches, **kwargs)

    rank.iterate = capture
    try:
        start = time.perf_counter()
        stream = iter(build_loader(_cfg(data, batch, 0), dp_rank=0, dp_size=1))
        next(stream)  # the first batch here, as the loader's workers have it
    finally:
        rank.iterate = iterate
    batches = captured["batches"]
    gc.freeze()
    pids = []
    for w in range(processes):
        pid = os.fork()
        if pid == 0:
            for b in range(1 + w, batches.last, processes):
                batches.make_batch(b, plain_memory)
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    seconds = time.perf_counter() - start
    gc.unfreeze()
    last = len(batches.make_batch(batches.last - 1, plain_memory)["__key__"])  # after the clock: only the last is short
    return ((batches.last - 1) * batch + last) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="an indexed directory of .npy token samples")
    ap.add_argument("--batch-sizes", default="32,256")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for batch in (int(x) for x in args.batch_sizes.split(",")):
        loader_epoch(args.data, batch, 0)  # warm the page cache and the imports
        runs: dict[str, list[float]] = {"one process": [], "split, no transport": [], "2 workers": []}
        for _ in range(args.rounds):
            runs["one process"].append(loader_epoch(args.data, batch, 0))
            runs["split, no transport"].append(split_epoch(args.data, batch))
            runs["2 workers"].append(loader_epoch(args.data, batch, 2))
        one = statistics.median(runs["one process"])
        print(
            f"batch {batch}: "
            + "; ".join(
                f"{k} {statistics.median(v):,.0f}/s ({statistics.median(v) / one:.2f}x)" for k, v in runs.items()
            )
        )


if __name__ == "__main__":
    main()
