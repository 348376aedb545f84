"""``dataio index DIR``: index and Megatron-Energon metadata for tar shards written elsewhere.

Finds ``DIR/**/*.tar`` (sorted, as ``energon prepare`` lists them; hidden temp files are ignored).
Shards that already have a ``.nv-meta/parts/<shard>.npz`` sidecar (left by ``dataio shard`` on any
number of nodes, or by an earlier ``dataio index`` run) whose byte count still matches are merged as
they are; the others get one header scan each (``dataio.shards.tarscan``) in ``--workers`` processes, and
leave a sidecar so an interrupted run resumes where it stopped. Then ``dataio.shards.metadata`` writes
energon's ``.nv-meta`` set, the ``.tar.idx`` files and the headrace index in one pass over the rows:
non-interactive, and no tar is read twice.

Splits: a shard keeps the split of its sidecar (``dataio shard --split``), and a scanned one goes to
``train``. ``--split train=0.98,val=0.02`` instead assigns every shard whole, by the hash of its name
(``dataio.prepare.plan.assign_shard_splits``: ``dataio shard``'s per-key rule with the shard name as the
key) and records it in the sidecars. Whole shards, because tars from elsewhere mix keys in every shard
and energon's ``split.yaml`` can only map shards to splits; per-sample splits need ``dataio shard``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from dataio.cli import CommandError
from dataio.commands.progress import track


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="directory holding the .tar shards")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes scanning shards in parallel")
    parser.add_argument("--checksum", action="store_true",
                        help="record each scanned shard's sha256 (reads every byte; `dataio verify` checks it)")
    parser.add_argument("--split", default=None,
                        help="e.g. train=0.98,val=0.02: every shard goes whole to one split, by the hash of its "
                             "name (fractions of shards); default: keep the splits recorded by `dataio shard`, "
                             "else train")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def find_shards(root: Path) -> list[str]:
    """Shard names relative to ``root``, in energon's order; temp files (``.name``) are skipped."""
    found = sorted(p for p in root.glob("**/*.tar") if p.is_file())
    names = [p.relative_to(root) for p in found]
    return [n.as_posix() for n in names if not any(part.startswith(".") for part in n.parts)]


def load_parts(root: Path, names: list[str]) -> dict:
    """The usable sidecar part of each shard: present and recorded for the shard's current size."""
    from dataio.shards.index import PARTS_DIR, ShardPart

    parts = {}
    for name in names:
        path = root / PARTS_DIR / f"{name}.npz"
        if path.is_file():
            part = ShardPart.load(path)
            if part.info.bytes == (root / name).stat().st_size and part.info.name == name:
                parts[name] = part
    return parts


def _scan(root: Path, name: str, split: str, checksum: bool):
    from dataio.shards.tarscan import scan_shard

    part = scan_shard(root, name, split=split, checksum=checksum)
    part.save(root)
    return part


def build_index(root: Path, *, workers: int = 1, checksum: bool = False, quiet: bool = True,
                splits: list[tuple[str, float]] | None = None):
    """Scan what needs scanning, merge all parts, write the metadata; returns (index, parts reused).

    ``splits`` (parsed ``--split``) assigns every shard whole to a split by its name (module docstring).
    """
    from dataio.shards.index import INDEX_DIR, merge_parts
    from dataio.shards.metadata import write_dataset_metadata
    from dataio.prepare.plan import assign_shard_splits
    from dataio.shards.tarscan import TarFormatError

    names = find_shards(root)
    if not names:
        raise CommandError(f"{root}: no .tar shards found")
    split_of = dict(zip(names, assign_shard_splits(names, splits))) if splits else {}
    parts = load_parts(root, names)
    for name, part in parts.items():
        if split_of and part.info.split != split_of[name]:
            part.info.split = split_of[name]
            part.save(root)  # the sidecar remembers it for later runs without --split
    todo = [n for n in names if n not in parts]
    try:
        if workers > 1 and len(todo) > 1:
            with ProcessPoolExecutor(min(workers, len(todo))) as pool:
                futures = [pool.submit(_scan, root, n, split_of.get(n, "train"), checksum) for n in todo]
                done = track(as_completed(futures), total=len(todo), description="indexing", unit="shards", quiet=quiet)
                for future in done:
                    part = future.result()
                    parts[part.info.name] = part
        else:
            for name in track(todo, total=len(todo), description="indexing", unit="shards", quiet=quiet):
                parts[name] = _scan(root, name, split_of.get(name, "train"), checksum)
    except TarFormatError as e:
        raise CommandError(str(e)) from None
    manifest = root / INDEX_DIR / "manifest.json"
    job = json.loads(manifest.read_text()).get("job", {}) if manifest.is_file() else {}
    index = merge_parts([parts[n] for n in names], job=job)
    try:
        write_dataset_metadata(root, index, workers=workers)
    except ValueError as e:
        raise CommandError(str(e)) from None
    return index, len(names) - len(todo)


def run(args: argparse.Namespace) -> int:
    root = args.dir
    if not root.is_dir():
        raise CommandError(f"{root}: not a directory")
    from dataio.prepare.plan import parse_splits

    try:
        splits = parse_splits(args.split) if args.split else None
    except ValueError as e:
        raise CommandError(str(e)) from None
    start = time.perf_counter()
    index, reused = build_index(root, workers=max(1, args.workers), checksum=args.checksum, quiet=args.quiet,
                                splits=splits)
    total_bytes = sum(s.bytes for s in index.shards)
    per_split: dict[str, list[int]] = {}
    for shard in index.shards:
        counts = per_split.setdefault(shard.split, [0, 0])
        counts[0], counts[1] = counts[0] + 1, counts[1] + shard.samples
    print(f"indexed {len(index.shards)} shards ({reused} from parts, {len(index.shards) - reused} scanned), "
          f"{len(index)} samples, {total_bytes / 1e6:.1f} MB in {time.perf_counter() - start:.1f}s "
          f"-> {root / '.nv-meta'}; splits: "
          + ", ".join(f"{name} {n} shards / {samples} samples" for name, (n, samples) in per_split.items()))
    empty = [name for name, fraction in splits or [] if fraction > 0 and name not in per_split]
    if empty:
        print(f"note: no shard fell into {', '.join(empty)} ({len(index.shards)} shards are too few for these "
              "fractions; splits of foreign tars are whole shards)")
    return 0
