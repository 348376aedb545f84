"""``dataio shard INPUT... --output DIR``: corpora in, indexed WebDataset shards out.

Parses the options and runs ``headrace.dataio.prepare.job.shard_corpus`` (the plan, the output-directory claim,
the writer processes, the final index and metadata) with a progress bar, then prints its summary.
Re-running the same command resumes: complete shards are kept, the rest are written again.
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial
from pathlib import Path

from headrace.dataio.outpath import refuse_input
from headrace.dataio.usererror import CommandError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="NeMo audio manifests / text JSONL (.jsonl[.gz]), .txt, lhotse cuts (.jsonl[.gz]), .parquet",
    )
    p.add_argument("--output", "-o", required=True, help="output directory")
    p.add_argument(
        "--kind",
        choices=["auto", "text", "audio"],
        default="auto",
        help="auto: per input, from its suffix and first record",
    )
    p.add_argument("--tokenizer", help="Hugging Face tokenizer.json; adds token ids as .npy")
    p.add_argument(
        "--shard-size",
        default=None,
        help="target shard size (e.g. 512MB, 1GiB); default 512MB unless --samples-per-shard is given",
    )
    p.add_argument("--samples-per-shard", type=int, default=None)
    p.add_argument("--workers", type=int, default=1, help="writer processes on this node")
    p.add_argument("--num-nodes", type=int, default=None, help="default: SLURM array/task variables, else 1")
    p.add_argument("--node-rank", type=int, default=None)
    p.add_argument("--split", default=None, help="e.g. train=0.98,val=0.02 (by key hash); default: all train")
    p.add_argument("--text-field", default="text", help="JSONL/parquet field holding the text")
    p.add_argument(
        "--audio-format",
        choices=["flac", "wav", "opus"],
        default=None,
        help="re-encode audio to this codec (default: keep bytes as given)",
    )
    p.add_argument(
        "--skip-errors",
        type=int,
        default=0,
        metavar="N",
        help="skip up to N bad samples (listed in DIR/skipped.jsonl); fail beyond N",
    )
    p.add_argument(
        "--checksum",
        action="store_true",
        help="record each shard's sha256 in the index (hashed on a background thread while writing; "
        "costs ~1 s of CPU per 0.1-0.5 GB)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    # imported here, not at the top: `dataio --help` imports every verb's add_arguments, not its work
    from headrace.dataio.commands.progress import progress_bar
    from headrace.dataio.prepare.job import PrepareError, ShardOptions, shard_corpus

    refuse_input(args.output, args.inputs, "--output")
    fields = {f.name for f in dataclasses.fields(ShardOptions)}
    opts = ShardOptions(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        r = shard_corpus(opts, progress=partial(progress_bar, quiet=args.quiet))
    except PrepareError as e:
        raise CommandError(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None

    root = Path(args.output)
    who = f"node {r.node_rank}/{r.num_nodes}: " if r.num_nodes > 1 else ""
    line = (
        f"{who}wrote {r.written} shards, {r.samples:,} samples, {r.bytes / 1e6:,.1f} MB "
        f"in {r.seconds:.1f} s ({r.bytes / 1e6 / max(r.seconds, 1e-9):,.1f} MB/s)"
    )
    if r.already_complete:
        line += f"; {r.already_complete} shards were already complete"
    print(line)
    if r.pending:
        print(
            f"{r.pending} shards of other nodes are still missing; the last node to finish "
            f"(or `dataio index {root}`) writes the dataset metadata"
        )
        return 0
    print(
        f"dataset {root}: {r.total_samples:,} samples in {sum(r.shards_per_split.values())} shards "
        f"({', '.join(f'{k} {v}' for k, v in r.shards_per_split.items())})"
        + (f"; skipped {r.skipped} bad samples, listed in {root / 'skipped.jsonl'}" if r.skipped else "")
    )
    return 0
