"""``data.datasets[]`` -> the loader's sources, their schedule and per-source subflavors.

Each entry is one source (``open_source``: a headrace-indexed directory or URL, an energon-prepared
directory or URL, a Lhotse manifest or Shar directory) or an energon metadataset
(``headrace.dataio.stream.sources.metadataset``), which stands for its leaves. With ``blend`` metadatasets (and plain
entries) the leaves are blended by weight -- a leaf's weight is its entry's weight times its share in
the metadataset -- through ``headrace.dataio.stream.ordering.blend``; a ``blend_epochized`` metadataset must be the only
entry, and its leaves' ``floor(repetitions * len)`` make each epoch (``headrace.dataio.stream.ordering.epochized``).
Everything after this (order, rank split, resume) is the same for both, so are the guarantees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from headrace.config import ConfigError
from headrace.dataio.config import DataConfig, DatasetSpec
from headrace.dataio.shards.index import INDEX_DIR
from headrace.dataio.stream.sources import interop, metadataset
from headrace.dataio.stream.ordering.blend import BlendSchedule
from headrace.dataio.stream.ordering.epochized import EpochizedSchedule
from headrace.dataio.stream.sources.openshards import OpenShards
from headrace.dataio.stream.sources.shardcache import ShardCache
from headrace.dataio.stream.sources.shard_source import ShardSource, SplitError


def open_source(
    spec: DatasetSpec,
    cache: ShardCache | None = None,
    open_shards: OpenShards | None = None,
) -> ShardSource:
    """The sample source of one ``datasets:`` entry: a headrace-indexed directory or URL, else (see
    ``headrace.dataio.stream.sources.interop``) an energon-prepared directory or URL, a Lhotse cuts manifest or a Lhotse
    Shar directory. A URL's shards go through ``cache`` (``data.cache_dir``) when given; every source's
    maps and files through ``open_shards`` (the loader's one bounded set; None: the source's own)."""
    options = spec.storage_options
    if "://" in spec.path:
        index = None
        if not interop.Folder(spec.path, options).exists(f"{INDEX_DIR}/manifest.json") and interop.is_energon_dir(
            spec.path, options
        ):
            index = interop.energon_index(spec.path, options)
        return ShardSource(
            spec.path, split=spec.split, index=index, storage_options=options, cache=cache, open_shards=open_shards
        )
    if (Path(spec.path) / INDEX_DIR).exists():
        return ShardSource(spec.path, split=spec.split, open_shards=open_shards)
    if interop.is_lhotse_manifest(spec.path):
        return interop.LhotseCutSource(spec.path)
    if interop.is_energon_dir(spec.path):
        return ShardSource(spec.path, split=spec.split, index=interop.energon_index(spec.path), open_shards=open_shards)
    if interop.is_lhotse_shar(spec.path):
        return interop.SharSource(spec.path, split=spec.split, open_shards=open_shards)
    return ShardSource(spec.path, split=spec.split)  # raises: no index, with the `dataio index` hint


@dataclass(kw_only=True)
class Datasets:
    """What the loader reads: one source per leaf, the schedule over them, and for the fingerprint one
    ``(split, weight)`` per source (``weight``: repetitions when epochized)."""

    sources: list
    schedule: BlendSchedule | EpochizedSchedule
    entries: list[tuple[str, float]]
    subflavors: list[dict] | None  # per source; None when no entry is a metadataset

    @property
    def epochized(self) -> bool:
        return isinstance(self.schedule, EpochizedSchedule)


def open_datasets(cfg: DataConfig) -> Datasets:
    leaves, epochized = [], False
    cache = ShardCache(cfg.cache_dir, cfg.cache_limit) if cfg.cache_dir else None  # one for all the datasets
    open_shards = OpenShards(cfg.max_open_shards)  # likewise: the descriptor and map budget is per process
    for i, spec in enumerate(cfg.datasets):
        if not metadataset.is_metadataset(spec.path):
            leaves.append((spec, spec.weight, None))
            continue
        mds = metadataset.read_metadataset(spec.path, spec.split, spec.storage_options)
        if mds.epochized:
            if len(cfg.datasets) > 1:
                raise ConfigError(
                    f"data.datasets[{i}]: {spec.path} is a blend_epochized metadataset: it must be the "
                    "only dataset (its repetitions make the epoch, weights do not apply)"
                )
            if cfg.stop_on_first_exhausted:
                raise ConfigError(
                    "data.stop_on_first_exhausted: a blend_epochized metadataset ends its epochs as a "
                    "whole; leave it false"
                )
            epochized = True
        for leaf in mds.leaves:
            leaf_spec = DatasetSpec(path=leaf.path, split=leaf.split, storage_options=spec.storage_options)
            leaves.append((leaf_spec, leaf.share if epochized else spec.weight * leaf.share, leaf))
    sources, subflavors = [], []
    for spec, _, leaf in leaves:
        sources.append(_open_leaf(spec, leaf, cache, open_shards))
        subflavors.append(
            {} if leaf is None else {**interop.energon_subflavors(spec.path, spec.storage_options), **leaf.subflavors}
        )
    entries = [(spec.split, share) for spec, share, _ in leaves]
    if epochized:
        counts = [math.floor(share * len(s)) for (_, share), s in zip(entries, sources)]
        keep = [d for d, c in enumerate(counts) if c > 0]  # energon reads nothing of them either
        if not keep:
            raise ConfigError(f"{cfg.datasets[0].path}: every dataset's repetitions x length rounds to 0 samples")
        sources, subflavors = [sources[d] for d in keep], [subflavors[d] for d in keep]
        entries = [entries[d] for d in keep]
        schedule = EpochizedSchedule([counts[d] for d in keep], epochs=cfg.epochs)
    else:
        schedule = BlendSchedule(
            [w for _, w in entries],
            [len(s) for s in sources],
            epochs=cfg.epochs,
            stop_on_first_exhausted=cfg.stop_on_first_exhausted,
        )
    meta = any(leaf is not None for *_, leaf in leaves)
    return Datasets(sources=sources, schedule=schedule, entries=entries, subflavors=subflavors if meta else None)


def _open_leaf(
    spec: DatasetSpec, leaf: metadataset.Leaf | None, cache: ShardCache | None, open_shards: OpenShards
) -> ShardSource:
    """``open_source``; a leaf's failure names its metadataset entry (file and key) in one line."""
    try:
        return open_source(spec, cache, open_shards)
    except (ValueError, FileNotFoundError) as e:
        if leaf is None:
            raise
        where = leaf.split_where if isinstance(e, SplitError) else leaf.where
        raise ConfigError(f"{where}: {' '.join(str(e).split())}") from e


__all__ = ["Datasets", "open_datasets", "open_source"]
