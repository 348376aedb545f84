"""``dataio index DIR``: index and Megatron-Energon metadata for tar shards written elsewhere.

Parses the options and runs ``headrace.dataio.prepare.indexing.build_index`` (see there: which shards are
scanned, how splits are assigned) with a progress bar, then prints a summary.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from headrace.dataio.usererror import CommandError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="directory holding the .tar shards")
    parser.add_argument(
        "--workers", type=int, default=min(8, os.cpu_count() or 1), help="processes scanning shards in parallel"
    )
    parser.add_argument(
        "--checksum",
        action="store_true",
        help="record each scanned shard's sha256 (reads every byte; `dataio verify` checks it)",
    )
    parser.add_argument(
        "--split",
        default=None,
        help="e.g. train=0.98,val=0.02: every shard goes whole to one split, by the hash of its "
        "name (fractions of shards); default: keep the splits recorded by `dataio shard`, "
        "else train",
    )
    parser.add_argument(
        "--num-nodes",
        type=int,
        default=1,
        help="index on many machines: each scans every N-th shard (e.g. $SLURM_ARRAY_TASK_COUNT); then one "
        "plain `dataio index DIR` merges their sidecars",
    )
    parser.add_argument(
        "--node-rank", type=int, default=0, help="this machine's part, 0..N-1 (e.g. $SLURM_ARRAY_TASK_ID)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    root = args.dir
    if not root.is_dir():
        raise CommandError(f"{root}: not a directory")
    # imported here, not at the top: `dataio --help` imports every verb's add_arguments, not its work
    from functools import partial

    from headrace.dataio.commands.progress import progress_bar
    from headrace.dataio.prepare.indexing import build_index
    from headrace.dataio.prepare.job import PrepareError
    from headrace.dataio.prepare.plan import parse_splits

    try:
        splits = parse_splits(args.split) if args.split else None
    except ValueError as e:
        raise CommandError(str(e)) from None
    start = time.perf_counter()
    try:
        index, reused = build_index(
            root,
            workers=max(1, args.workers),
            checksum=args.checksum,
            splits=splits,
            progress=partial(progress_bar, quiet=args.quiet),
            num_nodes=args.num_nodes,
            node_rank=args.node_rank,
        )
    except PrepareError as e:
        raise CommandError(str(e)) from None
    if index is None:
        print(
            f"node {args.node_rank}/{args.num_nodes}: {reused} shards already had sidecars, the others scanned in "
            f"{time.perf_counter() - start:.1f}s; when every node is done, `dataio index {root}` merges them"
        )
        return 0
    total_bytes = sum(s.bytes for s in index.shards)
    per_split: dict[str, list[int]] = {}
    for shard in index.shards:
        counts = per_split.setdefault(shard.split, [0, 0])
        counts[0], counts[1] = counts[0] + 1, counts[1] + shard.samples
    print(
        f"indexed {len(index.shards)} shards ({reused} from parts, {len(index.shards) - reused} scanned), "
        f"{len(index)} samples, {total_bytes / 1e6:.1f} MB in {time.perf_counter() - start:.1f}s "
        f"-> {root / '.nv-meta'}; splits: "
        + ", ".join(f"{name} {n} shards / {samples} samples" for name, (n, samples) in per_split.items())
    )
    empty = [name for name, fraction in splits or [] if fraction > 0 and name not in per_split]
    if empty:
        print(
            f"note: no shard fell into {', '.join(empty)} ({len(index.shards)} shards are too few for these "
            "fractions; splits of foreign tars are whole shards)"
        )
    return 0
