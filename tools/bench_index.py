"""Indexing speed: `dataio index` beside `energon prepare` on the same webdataset.ShardWriter tars.

    .venv/bin/python -m tools.bench_index [--shards 40] [--samples 500] [--workers 2] [--baseline DIR]

Writes the tars once into a temp dir, copies them, then times each indexer on its own copy (all with
the same worker count) and prints samples/s for each and the ratio. ``--baseline DIR`` also times the
``dataio index`` of another checkout (e.g. ``git archive`` of an older commit) in the same run.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np
import webdataset as wds

from headrace.dataio.shards.formats import npy_bytes
from headrace.dataio.bench.processes import REPO, time_dataio, time_energon_prepare


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--samples", type=int, default=500, help="samples per shard")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--baseline", type=Path, help="another checkout whose `dataio index` is timed too")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = Path(tmp) / "ours", Path(tmp) / "energon"
        ours.mkdir()
        with wds.ShardWriter(str(ours / "shard-%06d.tar"), maxcount=args.samples, verbose=0) as w:
            for i in range(args.shards * args.samples):
                tokens = rng.integers(0, 30000, int(rng.integers(10, 400)), dtype=np.uint16)
                w.write(
                    {
                        "__key__": f"s{i:09d}",
                        "txt": b"x" * int(rng.integers(50, 2000)),
                        "tokens.npy": npy_bytes(tokens),
                        "json": b'{"a": 1}',
                    }
                )
        shutil.copytree(ours, theirs)
        n = args.shards * args.samples

        def dataio_index(repo: Path, target: Path) -> float:
            return time_dataio(["index", str(target), "--quiet", "--workers", str(args.workers)], repo)[0]

        ours_s = dataio_index(REPO, ours)
        if args.baseline:
            shutil.copytree(theirs, Path(tmp) / "baseline")
            baseline_s = dataio_index(args.baseline.resolve(), Path(tmp) / "baseline")
        energon_s = time_energon_prepare(theirs, args.workers)
        size = sum(p.stat().st_size for p in ours.glob("*.tar")) / 1e6
        print(f"{args.shards} shards, {n} samples, {size:.0f} MB, {args.workers} workers")
        print(f"dataio index   : {ours_s:6.2f} s  {n / ours_s:10.0f} samples/s (process start included)")
        print(f"energon prepare: {energon_s:6.2f} s  {n / energon_s:10.0f} samples/s (process start included)")
        if args.baseline:
            print(f"baseline index : {baseline_s:6.2f} s  {n / baseline_s:10.0f} samples/s ({args.baseline})")
        print(
            f"speed-up       : {energon_s / ours_s:.2f}x over energon prepare"
            + (f", {baseline_s / ours_s:.2f}x over the baseline" if args.baseline else "")
        )


if __name__ == "__main__":
    main()
