"""The index files checked against each other before anything trusts them (``dataio verify``, every load).

``check_layout`` (every ``load_index``, O(1)): each ``.npy`` has the dtype and shape the writer gives it and the
arrays agree in length (``keys.npy`` and ``key_order.npy`` one entry a sample, the shard table one row a name).
``check_contents`` (``dataio verify``, O(n log n) in samples): every sample's shard and member rows exist,
every member's extension is one the manifest names, the shard table's per-shard sample counts are the counts of
``samples.npy``, samples lie in shard order, and ``key_order.npy`` is a permutation of the samples that sorts
``keys.npy`` (a damaged one makes ``dataio get`` call a present key missing). Each rule broken is an
``IndexFormatError`` (a ``ValueError``: one line, exit 2) naming the file and the rule.
"""

from __future__ import annotations

import numpy as np

from headrace.dataio.shards.index_rows import MEMBER_DTYPE, SAMPLE_DTYPE

INDEX_FILES = ("samples.npy", "members.npy", "keys.npy", "key_order.npy", "shard_names.npy", "shards.npy")


class IndexFormatError(ValueError):
    """An index file that does not hold what ``dataio shard`` / ``dataio index`` write (re-index the dataset)."""


def _refuse(where: str, name: str, rule: str) -> IndexFormatError:
    return IndexFormatError(f"{where}/{name}: {rule} (damaged? run `dataio index` on the dataset to rewrite it)")


def check_layout(index, where: str) -> None:
    """O(1) rules: dtypes, dimensions, lengths that agree (``where``: the index folder, for messages)."""
    from headrace.dataio.shards.shardtable import SHARD_DTYPE, ShardTable

    n = len(index.samples) if index.samples.ndim == 1 else -1
    for name, array, dtype in (
        ("samples.npy", index.samples, SAMPLE_DTYPE),
        ("members.npy", index.members, MEMBER_DTYPE),
    ):
        if array.ndim != 1 or array.dtype != dtype:
            raise _refuse(where, name, f"holds {array.dtype} of shape {array.shape}, not a 1-D array of {dtype}")
    if index.keys.ndim != 1 or index.keys.dtype.kind != "S" or len(index.keys) != n:
        raise _refuse(where, "keys.npy", f"holds {index.keys.dtype} of shape {index.keys.shape}, not {n} byte strings")
    order = index.key_order
    if order is not None and (order.ndim != 1 or order.dtype.kind not in "ui" or len(order) != n):
        raise _refuse(where, "key_order.npy", f"holds {order.dtype} of shape {order.shape}, not {n} sample indices")
    if isinstance(index.shards, ShardTable):
        names, rows = index.shards.names, index.shards.rows
        if names.ndim != 1 or names.dtype.kind != "S":
            raise _refuse(where, "shard_names.npy", f"holds {names.dtype} of shape {names.shape}, not byte strings")
        if rows.ndim != 1 or rows.dtype != SHARD_DTYPE or len(rows) != len(names):
            raise _refuse(
                where, "shards.npy", f"holds {rows.dtype} of shape {rows.shape}, not {len(names)} rows of {SHARD_DTYPE}"
            )
        if len(rows) and int(rows["split"].max()) >= len(index.shards.splits):
            raise _refuse(where, "shards.npy", "names a split the manifest does not list")


def check_contents(index, where: str) -> None:
    """O(n log n) rules between the files (module docstring)."""
    from headrace.dataio.shards.shardtable import ShardTable

    samples, members, n_shards = index.samples, index.members, len(index.shards)
    shard = np.asarray(samples["shard"], dtype=np.int64)
    if len(shard) and (int(shard.max()) >= n_shards or (np.diff(shard) < 0).any()):
        raise _refuse(where, "samples.npy", f"names a shard past the {n_shards} of the table, or out of shard order")
    ends = np.asarray(samples["member_start"], dtype=np.uint64) + np.asarray(samples["member_count"], dtype=np.uint64)
    if len(ends) and int(ends.max()) > len(members):
        raise _refuse(where, "samples.npy", f"names member rows past the {len(members)} of members.npy")
    if len(members) and int(members["ext"].max()) >= len(index.extensions):
        raise _refuse(where, "members.npy", f"names an extension past the {len(index.extensions)} the manifest lists")
    counts = np.bincount(shard, minlength=n_shards)
    table = np.array([s.samples for s in index.shards], dtype=np.int64)
    if (bad := np.flatnonzero(counts != table)).size:
        i = int(bad[0])
        name = "shards.npy" if isinstance(index.shards, ShardTable) else "manifest.json"
        raise _refuse(where, name, f"shard {i} is listed with {table[i]} samples, samples.npy holds {counts[i]}")
    order = index.key_order
    if order is None:
        return
    order = np.asarray(order)
    seen = np.zeros(len(samples), dtype=bool)
    if len(order) and (int(order.min()) < 0 or int(order.max()) >= len(samples)):
        raise _refuse(where, "key_order.npy", f"holds a sample index outside 0..{len(samples) - 1}")
    seen[order] = True
    if not seen.all():
        raise _refuse(where, "key_order.npy", "is not a permutation of the samples (an index repeats)")
    keys = np.asarray(index.keys)[order]
    if len(keys) > 1 and (keys[1:] < keys[:-1]).any():
        raise _refuse(where, "key_order.npy", "does not sort keys.npy (a key would be called missing)")


__all__ = ["INDEX_FILES", "IndexFormatError", "check_contents", "check_layout"]
