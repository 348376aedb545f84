"""Index and Megatron-Energon metadata for tar shards written elsewhere (``dataio index DIR``).

Finds ``DIR/**/*.tar`` (sorted, as ``energon prepare`` lists them; hidden temp files are ignored).
Shards that already have a ``.nv-meta/parts/<shard>.npz`` sidecar (left by ``dataio shard`` on any
number of nodes, or by an earlier ``dataio index`` run) whose byte count still matches are merged as
they are; the others get one header scan each (``headrace.dataio.shards.tarscan``) in ``--workers`` processes, and
leave a sidecar so an interrupted run resumes where it stopped. Then ``headrace.dataio.shards.metadata`` writes
energon's ``.nv-meta`` set, the ``.tar.idx`` files and the headrace index in one pass over the rows:
non-interactive, and no tar is read twice.

Many machines: ``--num-nodes N --node-rank R`` scans (and leaves the sidecars of) only every N-th shard
from the R-th, under a lock on that node's part of the directory, and writes no index; one plain
``dataio index DIR`` afterwards merges all the sidecars (scanning only shards no node covered), as
``dataio shard`` does across nodes.

Splits: a shard keeps the split of its sidecar (``dataio shard --split``), and a scanned one goes to
``train``. ``--split train=0.98,val=0.02`` instead assigns every shard whole, by the hash of its name
(``headrace.dataio.prepare.plan.assign_shard_splits``: ``dataio shard``'s per-key rule with the shard name as the
key) and records it in the sidecars. Whole shards, because tars from elsewhere mix keys in every shard
and energon's ``split.yaml`` can only map shards to splits; per-sample splits need ``dataio shard``.
"""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from headrace.dataio.prepare.job import PrepareError, Progress, silent
from headrace.dataio.prepare.plan import assign_shard_splits
from headrace.dataio.shards.index import INDEX_DIR, PARTS_DIR, ShardPart, merge_parts
from headrace.dataio.shards.metadata import write_dataset_metadata
from headrace.dataio.shards.outdir import lock_output, remove_temps
from headrace.dataio.shards.tarscan import TarFormatError, scan_shard
from headrace.dataio.interrupts import leave_interrupt_to_parent


def find_shards(root: Path) -> list[str]:
    """Shard names relative to ``root``, in energon's order; temp files (``.name``) are skipped."""
    found = sorted(p for p in root.glob("**/*.tar") if p.is_file())
    names = [p.relative_to(root) for p in found]
    return [n.as_posix() for n in names if not any(part.startswith(".") for part in n.parts)]


def load_parts(root: Path, names: list[str]) -> dict:
    """The usable sidecar part of each shard: present and recorded for the shard's current size."""
    parts = {}
    for name in names:
        path = root / PARTS_DIR / f"{name}.npz"
        if path.is_file():
            part = ShardPart.load(path)
            if part.info.bytes == (root / name).stat().st_size and part.info.name == name:
                parts[name] = part
    return parts


def _scan(root: Path, name: str, split: str, checksum: bool):
    part = scan_shard(root, name, split=split, checksum=checksum)
    part.save(root)
    return part


def build_index(
    root: Path,
    *,
    workers: int = 1,
    checksum: bool = False,
    progress: Progress = silent,
    splits: list[tuple[str, float]] | None = None,
    num_nodes: int = 1,
    node_rank: int = 0,
):
    """Scan what needs scanning, merge all parts, write the metadata; returns (index, parts reused).

    ``splits`` (parsed ``--split``) assigns every shard whole to a split by its name (module docstring).
    With ``num_nodes`` > 1: only this node's shards are scanned and the index is None (not merged).
    """
    if num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise PrepareError(f"node rank {node_rank} is outside 0..{num_nodes - 1} (--num-nodes {num_nodes})")
    node = node_rank if num_nodes > 1 else None
    lock = lock_output(root, node=node, command="dataio index")  # noqa: F841 (held until we return)
    if node is None:
        remove_temps(root)  # a killed earlier run's: nobody else writes here while we hold the lock
    names = find_shards(root)
    if not names:
        raise PrepareError(f"{root}: no .tar shards found")
    split_of = dict(zip(names, assign_shard_splits(names, splits))) if splits else {}
    names_here = names[node_rank::num_nodes]
    parts = load_parts(root, names_here)
    for name, part in parts.items():
        if split_of and part.info.split != split_of[name]:
            part.info.split = split_of[name]
            part.save(root)  # the sidecar remembers it for later runs without --split
    todo = [n for n in names_here if n not in parts]
    try:
        with progress("indexing", total=len(todo), unit="shards") as advance:
            if workers > 1 and len(todo) > 1:
                with ProcessPoolExecutor(min(workers, len(todo)), initializer=leave_interrupt_to_parent) as pool:
                    futures = [pool.submit(_scan, root, n, split_of.get(n, "train"), checksum) for n in todo]
                    for future in as_completed(futures):
                        part = future.result()
                        parts[part.info.name] = part
                        advance(1)
            else:
                for name in todo:
                    parts[name] = _scan(root, name, split_of.get(name, "train"), checksum)
                    advance(1)
    except TarFormatError as e:
        raise PrepareError(str(e)) from None
    if node is not None:  # the merge is the plain run's, once every node's sidecars are there
        return None, len(names_here) - len(todo)
    manifest = root / INDEX_DIR / "manifest.json"
    job = json.loads(manifest.read_text()).get("job", {}) if manifest.is_file() else {}
    index = merge_parts([parts[n] for n in names], job=job)
    try:
        write_dataset_metadata(root, index, workers=workers)
    except ValueError as e:
        raise PrepareError(str(e)) from None
    return index, len(names) - len(todo)


__all__ = ["build_index", "find_shards", "load_parts"]
