"""Job planning for ``dataio shard``: which sample goes to which split, shard and node.

The plan is a pure function of the inputs and the options, never of ``--workers`` or the number of
nodes, which is what makes shards byte-identical across worker counts and resumable after a crash:

1. Scan every input in command-line order (readers.py) into small entries; bad records and duplicate
   keys are collected with their file and line.
2. Split: ``blake2b(key)`` as a number in [0, 1) against the cumulative ``--split`` fractions, so a
   sample's split depends on its key alone (adding inputs never moves existing samples).
3. Shards: within each split, entries in input order are cut into ``{split}-{NNNNNN}.tar`` whenever the
   next sample would push the estimated size past ``--shard-size`` or the count reaches
   ``--samples-per-shard``. Estimates come from the scan (manifest line length, audio file size), so
   real shard sizes differ from the target by the estimate's error (small for kept audio and text).
4. Nodes: shard ``i`` of the plan (all splits, in order) belongs to node ``i % num_nodes``.

Cost: one pass over the manifests (JSON parse + one ``stat`` per audio file) and ~100 bytes of memory
per sample; every node plans the whole job (no coordination needed) and writes only its shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

from headrace.dataio.prepare.chat_template import tokenizer_fingerprint
from headrace.dataio.prepare.readers import BadRecord, Entry, Input, skip_budget_error


def parse_splits(text: str | None) -> list[tuple[str, float]]:
    """``[("train", 0.98), ("val", 0.02)]`` from ``"train=0.98,val=0.02"``; ``[("train", 1.0)]`` for None."""
    if not text:
        return [("train", 1.0)]
    splits = []
    for part in text.split(","):
        name, _, frac = part.partition("=")
        name = name.strip()
        try:
            value = float(frac)
        except ValueError:
            raise ValueError(f"--split: {part!r} is not NAME=FRACTION (e.g. train=0.98,val=0.02)") from None
        if not re.fullmatch(r"[A-Za-z0-9_]+", name) or value < 0:
            raise ValueError(f"--split: {part!r} needs a name of letters/digits/_ and a fraction >= 0")
        if name in dict(splits):
            raise ValueError(f"--split: {name!r} given twice")
        splits.append((name, value))
    total = sum(v for _, v in splits)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"--split fractions must sum to 1, got {total:g} ({text})")
    return splits


def key_hashes(keys: list[str]) -> np.ndarray:
    """64-bit blake2b of each key (uint64): stable across runs, machines and Python versions."""
    return np.array(
        [int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little") for k in keys], dtype=np.uint64
    )


def assign_splits(hashes: np.ndarray, splits: list[tuple[str, float]]) -> np.ndarray:
    """Index into ``splits`` for each key hash: the hash as a fraction of 2**64 against cumulative bounds."""
    bounds = np.cumsum([v for _, v in splits])
    bounds[-1] = 1.0 + 1e-9  # every hash lands somewhere despite rounding
    unit = hashes.astype(np.float64) / 2.0**64
    return np.searchsorted(bounds, unit, side="right")


def assign_shard_splits(names: list[str], splits: list[tuple[str, float]]) -> list[str]:
    """The split of each whole shard, by ``assign_splits`` with the shard name as the key.

    For tars written elsewhere (``dataio index --split``): their shards mix keys, and energon's
    ``split.yaml`` maps shards, not samples, to splits, so a shard goes whole to one split. The
    fractions are then fractions of shards, and a shard keeps its split when others are added.
    """
    return [splits[i][0] for i in assign_splits(key_hashes(names), splits).tolist()]


@dataclass(kw_only=True)
class PlannedShard:
    name: str  # "{split}-{NNNNNN}.tar"
    split: str
    entries: list[Entry]
    est_bytes: int


@dataclass(kw_only=True)
class Plan:
    shards: list[PlannedShard]
    bad: list[BadRecord] = field(default_factory=list)  # skipped at planning (within the budget)
    samples: int = 0

    def for_node(self, num_nodes: int, rank: int) -> list[PlannedShard]:
        return self.shards[rank::num_nodes]


def _duplicates(entries: list[Entry], hashes: np.ndarray, inputs: list[Input]) -> dict[int, BadRecord]:
    """Later occurrences of a repeated key, as bad records pointing at the first occurrence."""
    order = np.argsort(hashes, kind="stable")
    repeats = np.flatnonzero(hashes[order][1:] == hashes[order][:-1]) + 1
    if len(repeats) == 0:
        return {}
    involved = np.unique(np.concatenate([order[repeats], order[repeats - 1]]))
    bad: dict[int, BadRecord] = {}
    seen: dict[str, Entry] = {}
    for i in involved.tolist():  # in input order, so the first occurrence is the one kept
        e = entries[i]
        if e.key not in seen:
            seen[e.key] = e
            continue
        f = seen[e.key]
        bad[i] = BadRecord(
            path=inputs[e.input_id].path,
            line=e.line,
            reason=f"duplicate key {e.key!r} (first at {inputs[f.input_id].path}:{f.line}); "
            "keys must be unique: give each record an 'id' or use distinct file names",
        )
    return bad


class PlanError(ValueError):
    """Too many bad records for the error budget; the message names the first one."""


def plan_job(
    inputs: list[Input],
    *,
    splits: list[tuple[str, float]],
    shard_bytes: int | None,
    samples_per_shard: int | None,
    skip_errors: int = 0,
    on_scan=None,
) -> Plan:
    """Scan ``inputs`` and lay out every sample's split and shard (see the module docstring).

    Raises PlanError once more than ``skip_errors`` records are bad. ``on_scan(n)`` is called with the
    number of records scanned so far every few thousand records (progress).
    """
    entries: list[Entry] = []
    bad: list[BadRecord] = []

    def reject(record: BadRecord) -> None:
        bad.append(record)
        if (message := skip_budget_error(str(record), len(bad), skip_errors)) is not None:
            raise PlanError(message)

    for input_id, reader in enumerate(inputs):
        for item in reader.scan():
            if isinstance(item, BadRecord):
                reject(item)
                continue
            item.input_id = input_id
            entries.append(item)
            if on_scan is not None and len(entries) % 4096 == 0:
                on_scan(len(entries))

    hashes = key_hashes([e.key for e in entries])
    duplicates = _duplicates(entries, hashes, inputs)
    if duplicates:
        for i in sorted(duplicates):
            reject(duplicates[i])
        keep = np.ones(len(entries), bool)
        keep[list(duplicates)] = False
        entries = [e for e, k in zip(entries, keep) if k]
        hashes = hashes[keep]

    split_of = assign_splits(hashes, splits)
    shards: list[PlannedShard] = []
    for split_id, (split, _) in enumerate(splits):
        current: list[Entry] = []
        size = 0
        number = 0
        for i in np.flatnonzero(split_of == split_id).tolist():
            e = entries[i]
            full = (samples_per_shard is not None and len(current) >= samples_per_shard) or (
                shard_bytes is not None and current and size + e.est_bytes > shard_bytes
            )
            if full:
                shards.append(
                    PlannedShard(name=f"{split}-{number:06d}.tar", split=split, entries=current, est_bytes=size)
                )
                current, size, number = [], 0, number + 1
            current.append(e)
            size += e.est_bytes
        if current:
            shards.append(PlannedShard(name=f"{split}-{number:06d}.tar", split=split, entries=current, est_bytes=size))
    return Plan(shards=shards, bad=bad, samples=len(entries))


# --- nodes and job identity ---------------------------------------------------------------------


def resolve_node(num_nodes: int | None, node_rank: int | None, env: dict | None = None) -> tuple[int, int]:
    """``(num_nodes, node_rank)`` from the flags, else SLURM array / task variables, else ``(1, 0)``."""
    env = os.environ if env is None else env
    if num_nodes is None and node_rank is None:
        if "SLURM_ARRAY_TASK_COUNT" in env and "SLURM_ARRAY_TASK_ID" in env:
            num_nodes = int(env["SLURM_ARRAY_TASK_COUNT"])
            node_rank = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", 0))
        elif int(env.get("SLURM_NTASKS", 1)) > 1 and "SLURM_PROCID" in env:
            num_nodes, node_rank = int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"])
    num_nodes = 1 if num_nodes is None else num_nodes
    node_rank = 0 if node_rank is None else node_rank
    if num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise ValueError(f"node rank {node_rank} is outside 0..{num_nodes - 1} (--num-nodes {num_nodes})")
    return num_nodes, node_rank


def file_identity(path: str) -> dict:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def job_fingerprint(input_paths: list[str], options: dict, tokenizer: str | None) -> dict:
    """What identifies a shard job: inputs (path, size, mtime), output-shaping options and the
    tokenizer's content hash. Worker and node counts are excluded: they never change the output."""
    job = {"writer": "dataio shard/1", "inputs": [file_identity(p) for p in input_paths], "options": options}
    if tokenizer:
        job["tokenizer"] = tokenizer_fingerprint(tokenizer)
    job["id"] = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:16]
    return job
