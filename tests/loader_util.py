"""Test data for the loader tests: WebDataset tars written by ``webdataset.ShardWriter``, indexed
with ``headrace.dataio.shards.tarscan`` + ``headrace.dataio.shards.index.merge_parts`` (exactly what ``dataio index`` does)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import webdataset as wds

from headrace.dataio.shards.index import INDEX_DIR, META_DIR, merge_parts
from headrace.dataio.shards.tarscan import scan_shard


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def make_text_dataset(
    root: Path, shard_sizes: list[int], *, prefix: str = "doc", seed: int = 0, extra: dict | None = None
) -> list[str]:
    """Shards of ``{key}.tokens.npy`` (int32, length 1..40, first token = sample number) plus
    ``{key}.json``; returns the keys in index order."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    keys = []
    n = 0
    for shard, size in enumerate(shard_sizes):
        with wds.TarWriter(str(root / f"{prefix}-{shard:06d}.tar")) as w:
            for _ in range(size):
                key = f"{prefix}{n:07d}"
                tokens = rng.integers(0, 1000, size=int(rng.integers(1, 40)), dtype=np.int32)
                tokens[0] = n
                sample = {"__key__": key, "tokens.npy": npy_bytes(tokens), "json": f'{{"n": {n}}}'.encode()}
                sample.update(extra or {})
                w.write(sample)
                keys.append(key)
                n += 1
    index_dir(root)
    return keys


def energon_prepared(
    root: Path,
    shard_sizes: list[int],
    *,
    keep_index: bool = False,
    subflavors: dict | None = None,
    prefix: str = "doc",
    **split,
) -> list[str]:
    """Text shards (``make_text_dataset``) prepared by energon's own ``WebdatasetPreparator`` with ``split``
    (``split_parts_ratio`` / ``split_parts_patterns``) and a CrudeWebdataset ``dataset.yaml`` (with
    ``subflavors``), so ``megatron.energon`` loads it; without ``keep_index`` the headrace index is removed
    (the loader then reads energon's sqlite). Returns the keys."""
    import shutil

    import yaml
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    keys = make_text_dataset(root, shard_sizes, prefix=prefix)
    if not keep_index:
        shutil.rmtree(root / INDEX_DIR)
    WebdatasetPreparator.prepare_dataset(root, sorted(p.name for p in root.glob("*.tar")), workers=1, **split)
    dataset = {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
    (root / META_DIR / "dataset.yaml").write_text(
        yaml.safe_dump({**dataset, **({"subflavors": subflavors} if subflavors else {})})
    )
    return keys


def index_dir(root: Path) -> None:
    names = sorted(p.name for p in root.glob("*.tar"))
    merge_parts([scan_shard(root, name) for name in names]).save(root)
