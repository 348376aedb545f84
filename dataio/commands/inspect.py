"""``dataio inspect DIR``: what a shard directory holds, from its index alone (no tar is opened).

Shards, samples, bytes, audio hours, token count, per-split totals and power-of-two length/duration
histograms, as rich tables or (``--json``) one JSON object. Cost: a few vectorised numpy passes over
the memory-mapped ``samples.npy`` (~10 ms per million samples).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from headrace.dataio.usererror import CommandError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="an indexed shard directory")
    parser.add_argument("--json", action="store_true", help="print one machine-readable JSON object")


def histogram(values: np.ndarray) -> dict:
    """Counts in power-of-two bins ``[2^k, 2^(k+1))`` from the smallest positive value up (zeros
    fall in the first bin)."""
    values = np.asarray(values, dtype=np.float64)
    positive = values[values > 0]
    if len(positive) == 0:
        return {"edges": [], "counts": []}
    lo = math.floor(math.log2(positive.min()))
    hi = math.floor(math.log2(positive.max())) + 1
    bins = np.floor(np.log2(np.maximum(values, 2.0**lo))).astype(np.int64) - lo
    counts = np.bincount(np.clip(bins, 0, hi - lo - 1), minlength=hi - lo)
    return {"edges": [2.0**k for k in range(lo, hi + 1)], "counts": counts.tolist()}


def summarize(root: Path) -> dict:
    """The summary ``--json`` prints (from ``root``'s headrace index)."""
    # imported here, not at the top: `dataio --help` imports every verb's add_arguments, not its work
    from headrace.dataio.shards.index import load_index

    try:
        index = load_index(root)
    except (FileNotFoundError, ValueError) as e:
        raise CommandError(str(e)) from None
    tokens = np.asarray(index.samples["tokens"])
    duration = np.asarray(index.samples["duration"], dtype=np.float64)
    has_tokens, has_duration = tokens >= 0, ~np.isnan(duration)
    shard_of = np.asarray(index.samples["shard"])
    splits: dict[str, dict] = {}
    for i, shard in enumerate(index.shards):
        entry = splits.setdefault(shard.split, {"shards": 0, "samples": 0, "bytes": 0, "audio_hours": 0.0, "tokens": 0})
        entry["shards"] += 1
        entry["samples"] += shard.samples
        entry["bytes"] += shard.bytes
    for name, entry in splits.items():
        ids = [i for i, s in enumerate(index.shards) if s.split == name]
        in_split = np.isin(shard_of, ids)
        entry["audio_hours"] = float(duration[in_split & has_duration].sum() / 3600)
        entry["tokens"] = int(tokens[in_split & has_tokens].sum())
    return {
        "dir": str(root),
        "shards": len(index.shards),
        "samples": len(index),
        "bytes": sum(s.bytes for s in index.shards),
        "audio_hours": float(duration[has_duration].sum() / 3600),
        "tokens": int(tokens[has_tokens].sum()),
        "samples_with_tokens": int(has_tokens.sum()),
        "samples_with_duration": int(has_duration.sum()),
        "extensions": list(index.extensions),
        "splits": splits,
        "histograms": {"tokens": histogram(tokens[has_tokens]), "duration_s": histogram(duration[has_duration])},
    }


def _print_tables(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    overview = Table(title=f"{summary['dir']}", show_header=False)
    for label, key, fmt in (
        ("shards", "shards", "{:,}"),
        ("samples", "samples", "{:,}"),
        ("bytes", "bytes", "{:,}"),
        ("audio hours", "audio_hours", "{:.3f}"),
        ("tokens", "tokens", "{:,}"),
    ):
        overview.add_row(label, fmt.format(summary[key]))
    overview.add_row("members", ", ".join(summary["extensions"]))
    console.print(overview)
    splits = Table("split", "shards", "samples", "bytes", "audio hours", "tokens", title="splits")
    for name, s in summary["splits"].items():
        splits.add_row(
            name,
            f"{s['shards']:,}",
            f"{s['samples']:,}",
            f"{s['bytes']:,}",
            f"{s['audio_hours']:.3f}",
            f"{s['tokens']:,}",
        )
    console.print(splits)
    for key, title in (("tokens", "tokens per sample"), ("duration_s", "audio seconds per sample")):
        h = summary["histograms"][key]
        if not h["counts"]:
            continue
        table = Table("range", "samples", "", title=title)
        peak = max(h["counts"])
        for lo, hi, count in zip(h["edges"], h["edges"][1:], h["counts"]):
            table.add_row(f"[{lo:g}, {hi:g})", f"{count:,}", "#" * round(40 * count / peak))
        console.print(table)


def run(args: argparse.Namespace) -> int:
    summary = summarize(args.dir)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        _print_tables(summary)
    return 0
