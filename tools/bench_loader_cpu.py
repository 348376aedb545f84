"""Loader CPU per sample, this checkout against another one, interleaved: the A/B that survives a shared machine.

    git -C . archive REV | tar -x -C /tmp/before          # the baseline tree, once
    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench_loader_cpu --data /tmp/lp-bench/text --baseline /tmp/before \\
        [--batch-sizes 8,32,256,1024] [--workers 0,2] [--epochs 5] [--rounds 3]

Each measurement is a fresh process (``--one``, with ``PYTHONPATH`` set to the tree measured) that
builds ``build_loader`` on ``--data`` (shuffled, ``epochs: 1``, plain batches) and reads ``--epochs``
whole epochs after one untimed warm-up epoch, each from a new loader (so the workers fork per epoch, as
in training with a finite stream). Per epoch: CPU seconds of the main process and of the reaped
workers (``getrusage``: microsecond resolution, where ``dataio bench``'s psutil poller counts 10 ms
clock ticks, a 5-10 % step on a 0.1-0.3 CPU-second epoch), the time to the first batch and the
samples/s after it; the median epoch is kept. Rounds, batch sizes, worker counts and the two trees
are interleaved (this tree, then the baseline, at each point), so load from other processes hits both
alike. Prints one markdown table: samples per CPU-second, before and after, with their ratio, and the
CPU cost of 2 workers against one process (1.0: workers cost nothing extra per sample).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one(data: str, batch: int, workers: int, epochs: int) -> dict:
    """Median epoch of ``build_loader`` (the tree on ``PYTHONPATH``) at one batch size and worker count."""
    from headrace.config import from_dict
    from headrace.dataio import build_loader
    from headrace.dataio.bench.timing import cpu_seconds
    from headrace.dataio.config import DataConfig

    cfg = from_dict(DataConfig, {"datasets": [{"path": data}], "batch_size": batch}, "data")
    cfg = dataclasses.replace(cfg, num_workers=workers, epochs=1, packing="none", seq_len=None)
    runs = []
    for epoch in range(epochs + 1):
        (main0, kids0), t0 = cpu_seconds(), time.perf_counter()
        n, first_at, first_n = 0, None, 0
        for b in build_loader(cfg, dp_rank=0, dp_size=1):
            n += len(b["__key__"])
            if first_at is None:
                first_at, first_n = time.perf_counter(), n
            del b
        end = time.perf_counter()
        main, kids = (now - then for now, then in zip(cpu_seconds(), (main0, kids0)))
        if epoch:  # the first one warms imports and the page cache
            runs.append(
                {
                    "samples": n,
                    "main_cpu_s": main,
                    "worker_cpu_s": kids,
                    "first_batch_s": first_at - t0,
                    "samples_per_s": (n - first_n) / (end - first_at),
                    "samples_per_cpu_s": n / (main + kids),
                }
            )
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def measure(tree: Path, data: str, batch: int, workers: int, epochs: int) -> dict:
    # this file by path (the baseline may not have it), run in ``tree`` with only ``tree`` on the path for ``dataio``
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--one",
            "--data",
            data,
            "--batch-sizes",
            str(batch),
            "--workers",
            str(workers),
            "--epochs",
            str(epochs),
        ],
        cwd=tree,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="an indexed directory of .npy token samples")
    ap.add_argument("--baseline", type=Path, help="a checkout of the revision to compare with")
    ap.add_argument("--batch-sizes", default="8,32,256,1024")
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes, counts = [int(x) for x in args.batch_sizes.split(",")], [int(x) for x in args.workers.split(",")]
    if args.one:
        print(
            json.dumps(
                {
                    "dataio": importlib.import_module("headrace.dataio").__file__,
                    **one(args.data, sizes[0], counts[0], args.epochs),
                }
            )
        )
        return
    trees = {"after": REPO, **({"before": args.baseline.resolve()} if args.baseline else {})}
    results: dict[tuple, list[dict]] = {}
    for _ in range(args.rounds):
        for batch in sizes:
            for workers in counts:
                for name, tree in trees.items():
                    results.setdefault((name, batch, workers), []).append(
                        measure(tree, args.data, batch, workers, args.epochs)
                    )

    def med(name: str, batch: int, workers: int, key: str) -> float:
        return statistics.median(r[key] for r in results[(name, batch, workers)])

    head = [
        "batch",
        "workers",
        *(f"{n} samples/CPU-s" for n in trees),
        *(["after/before"] if args.baseline else []),
        *(f"{n} main CPU us/sample" for n in trees),
        *(f"{n} first batch s" for n in trees),
        *(f"{n} samples/s" for n in trees),
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + " ---: |" * len(head))
    for batch in sizes:
        for workers in counts:
            row = [f"{med(n, batch, workers, 'samples_per_cpu_s'):,.0f}" for n in trees]
            if args.baseline:
                row.append(
                    f"{med('after', batch, workers, 'samples_per_cpu_s') / med('before', batch, workers, 'samples_per_cpu_s'):.2f}x"
                )
            row += [
                f"{med(n, batch, workers, 'main_cpu_s') / med(n, batch, workers, 'samples') * 1e6:.1f}" for n in trees
            ]
            row += [f"{med(n, batch, workers, 'first_batch_s'):.3f}" for n in trees]
            row += [f"{med(n, batch, workers, 'samples_per_s'):,.0f}" for n in trees]
            print(f"| {batch} | {workers} | " + " | ".join(row) + " |")
    if 0 in counts:
        for workers in (w for w in counts if w):
            cost = {
                n: [med(n, b, 0, "samples_per_cpu_s") / med(n, b, workers, "samples_per_cpu_s") for b in sizes]
                for n in trees
            }
            print(
                f"\nCPU per sample, {workers} workers / 1 process: "
                + "; ".join(
                    f"{n}: " + ", ".join(f"batch {b} {c:.2f}" for b, c in zip(sizes, cs)) for n, cs in cost.items()
                )
            )


if __name__ == "__main__":
    main()
