"""``dataio get DIR KEY``: one sample by key, from the mapped index (``headrace.dataio.shards.lookup``).

Without ``--member``: a JSON object of the sample's shard, offset and members (extension and size).
With ``--member EXT``: that member's bytes, to stdout or ``--out FILE``. A key the dataset does not
hold, or a member the sample does not have, is a one-line error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from headrace.dataio.outpath import refuse_input, write_file
from headrace.dataio.usererror import CommandError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="an indexed shard directory")
    parser.add_argument("key", help="the sample's __key__")
    parser.add_argument("--member", metavar="EXT", help="write this member's bytes (e.g. tokens.npy, flac, json)")
    parser.add_argument("--out", type=Path, metavar="FILE", help="write the member here instead of stdout")


def run(args: argparse.Namespace) -> int:
    from headrace.dataio.shards.lookup import IndexMismatch, SampleNotFound, open_dataset

    if args.out is not None and args.member is None:
        raise CommandError("--out needs --member EXT (which member to write)")
    try:
        dataset = open_dataset(args.dir)  # no directory, no index, an index format it cannot read
        shard, offset = dataset.locate(args.key)
        members = dataset[args.key]
    except (SampleNotFound, IndexMismatch, FileNotFoundError, ValueError) as e:
        raise CommandError(str(e)) from None
    if args.member is None:
        print(
            json.dumps(
                {
                    "key": args.key,
                    "shard": shard,
                    "offset": offset,
                    "members": {ext: len(data) for ext, data in members.items()},
                }
            )
        )
        return 0
    if args.member not in members:
        raise CommandError(
            f"{args.dir}: sample {args.key!r} has no member {args.member!r} (it has: {', '.join(sorted(members))})"
        )
    if args.out is not None:
        shards = [dataset.root / s.name for s in dataset.index.shards]  # a shard may be a link out of dir
        refuse_input(args.out, [args.dir, *shards], "--out")
        write_file(args.out, members[args.member], "--out")
    else:
        sys.stdout.buffer.write(members[args.member])
    return 0
