"""``dataio verify DIR``: re-read every shard and check it against the index and energon's metadata.

Parses the options and runs ``headrace.dataio.verify.verify_dir`` (see there: what is checked, the cost)
with a progress bar; prints the first fault and the others after it (exit status 1), or a summary.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from headrace.dataio.usererror import CommandError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="an indexed shard directory")
    parser.add_argument(
        "--workers", type=int, default=min(8, os.cpu_count() or 1), help="processes reading shards in parallel"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    # imported here, not at the top: `dataio --help` imports every verb's add_arguments, not its work
    from headrace.dataio.commands.progress import track
    from headrace.dataio.shards.index import INDEX_DIR, load_index
    from headrace.dataio.shards.index_check import check_contents
    from headrace.dataio.verify import verify_dir

    root = args.dir
    try:
        index = load_index(root, mmap=False)
        check_contents(index, str(root / INDEX_DIR))  # the index files against each other, before any shard
    except (FileNotFoundError, ValueError) as e:
        raise CommandError(str(e)) from None
    start = time.perf_counter()
    faults = verify_dir(
        root,
        index,
        workers=args.workers,
        track=lambda items, total: track(items, total=total, description="verifying", unit="shards", quiet=args.quiet),
    )
    elapsed = time.perf_counter() - start
    if faults:
        print(f"dataio verify: FAILED: {faults[0]}", file=sys.stderr)
        for fault in faults[1:]:
            print(f"  also: {fault}", file=sys.stderr)
        return 1
    print(
        f"verified {len(index.shards)} shards, {len(index)} samples, {len(index.members)} members in {elapsed:.1f}s: OK"
    )
    return 0
