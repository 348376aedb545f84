"""Megatron-Energon metadatasets (``MetadatasetV2`` YAML) as ``data.datasets[]`` entries.

A metadataset names prepared datasets and how to mix them, per split::

    __module__: megatron.energon
    __class__: MetadatasetV2
    splits:
      train:
        blend:                       # or blend_epochized: [{repetitions: 2, path: ...}, ...]
          - {weight: 2, path: ./web, subflavors: {source: web}}
          - {weight: 1, path: ./code, split_part: val}
          - {weight: 1, path: ./more.yaml}     # a nested metadataset

It is read with ``yaml.safe_load`` (no energon import) and flattened into leaves -- (dataset path,
split, subflavors, share) -- with energon's rules (``megatron/energon/metadataset/metadataset_v2.py``):

- ``blend``: a leaf's weight is ``weight / sum(weights)`` of its entry times its weight inside a nested
  metadataset (a single ``path:`` counts as weight 1); weights must be >= 0, a 0 drops the entry.
- ``blend_epochized``: ``repetitions`` (>= 0, fractional allowed) multiply down the nesting; one
  epoch holds ``floor(repetitions * len)`` samples of each leaf (``headrace.dataio.stream.ordering.epochized``).
  A ``blend`` may not sit inside a ``blend_epochized`` or the other way round (energon's error).
- ``split_part`` of an entry replaces the split it inherits (the ``data.datasets[].split`` at the top),
  also for a nested metadataset, whose ``splits[split_part]`` is then read.
- ``subflavors`` merge downwards with the outer ones winning (``{**inner, **outer}``), and over the
  dataset's own ``.nv-meta/dataset.yaml`` ``subflavors``; every sample carries its leaf's dict
  (``batch["__subflavors__"]``, as energon's ``sample.__subflavors__``).
- ``path`` is relative to the YAML's folder unless absolute or a URL.

Keys energon has and this loader does not implement (``join``, ``subset``, ``aux``, ``dataset_config``,
``split_config``, a ``shuffle_over_epochs_multiplier`` other than 1) and unknown keys are one-line
``ConfigError``s naming the file and the key, as are a wrong ``__class__``, a missing ``path``, a negative
weight and a split the file does not have. Cost: one YAML read per file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from headrace.config import ConfigError

SUFFIXES = (".yaml", ".yml")
UNSUPPORTED = {
    "join": "joined datasets are not supported (blend the datasets, or join them when preparing)",
    "subset": "subset ranges are not supported",
    "aux": "auxiliary datasets are not supported",
    "dataset_config": "only the dataset's own dataset.yaml is read",
    "split_config": "only the dataset's own split.yaml is read",
}
REFERENCE_KEYS = ("path", "split_part", "subflavors", "shuffle_over_epochs_multiplier")


@dataclass(frozen=True, kw_only=True)
class Leaf:
    """One prepared dataset of a metadataset, with what the path to it decided."""

    path: str  # resolved: absolute, or a URL
    split: str
    subflavors: dict = field(default_factory=dict)
    share: float = 1.0  # its normalised weight (blend) or its repetitions (blend_epochized)
    where: str = ""  # "FILE: splits.train.blend[1]" for errors
    split_where: str = ""  # the key its split came from


@dataclass(frozen=True, kw_only=True)
class Metadataset:
    path: str
    epochized: bool
    leaves: list[Leaf]


def is_metadataset(path: str) -> bool:
    """A ``data.datasets[].path`` naming a YAML file (energon's rule: a file ending in ``.yaml``)."""
    return path.rstrip("/").endswith(SUFFIXES)


def read_metadataset(path: str, split: str = "train", storage_options: dict | None = None) -> Metadataset:
    """The leaves of ``splits[split]`` of the metadataset at ``path`` (a local file or an fsspec URL)."""
    epochized, leaves = _read_split(path, split, {}, f"{path}: splits", storage_options, ())
    return Metadataset(path=path, epochized=epochized is True, leaves=leaves)


def _fail(where: str, rule: str) -> ConfigError:
    return ConfigError(f"{where}: {rule}")


def _load(path: str, storage_options: dict | None, where: str) -> dict:
    import yaml

    try:
        if "://" in path:
            import fsspec

            with fsspec.open(path, "rb", **(storage_options or {})) as f:
                doc = yaml.safe_load(f)
        else:
            with open(path, "rb") as f:
                doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise _fail(where, f"{path}: no such metadataset file") from None
    except yaml.YAMLError as e:
        raise _fail(path, f"not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(doc, dict):
        raise _fail(path, "expected a mapping with __class__: MetadatasetV2 and splits")
    module, cls = doc.get("__module__"), doc.get("__class__")
    if cls != "MetadatasetV2" or not str(module).startswith("megatron.energon"):
        raise _fail(
            path,
            f"__class__: {cls!r} (module {module!r}) is not supported; headrace reads "
            "megatron.energon MetadatasetV2 files",
        )
    extra = set(doc) - {"__module__", "__class__", "splits"}
    if extra:
        raise _fail(path, f"unknown key {min(extra)!r} (a MetadatasetV2 has __module__, __class__, splits)")
    if not isinstance(doc.get("splits"), dict):
        raise _fail(path, "splits: expected a mapping of split names to a blend, blend_epochized or path")
    return doc


def _read_split(
    path: str, split: str, inherited: dict, where: str, storage_options: dict | None, stack: tuple[str, ...]
) -> tuple[bool | None, list[Leaf]]:
    """``(epochized, leaves)`` of one split of one file (``epochized`` None: a single ``path:``)."""
    if path in stack:
        raise _fail(where, f"{path} includes itself ({' -> '.join((*stack, path))})")
    doc = _load(path, storage_options, where)
    splits = doc["splits"]
    if split not in splits:
        raise _fail(path, f"splits: no split {split!r} (has {', '.join(map(str, splits)) or 'none'})")
    return _node(path, splits[split], f"{path}: splits.{split}", split, inherited, storage_options, (*stack, path))


def _node(
    file: str, node, key: str, split: str, inherited: dict, storage_options: dict | None, stack: tuple[str, ...]
) -> tuple[bool | None, list[Leaf]]:
    if not isinstance(node, dict):
        raise _fail(key, "expected a mapping with blend, blend_epochized or path")
    for name, reason in UNSUPPORTED.items():
        if name in node:
            raise _fail(f"{key}.{name}", reason)
    mode = [m for m in ("blend", "blend_epochized") if m in node]
    if not mode:
        return _reference(file, node, key, split, inherited, storage_options, stack, extra=())
    if len(node) != 1:
        raise _fail(key, f"unknown key {min(set(node) - set(mode))!r} beside {mode[0]}")
    entries = node[mode[0]]
    if not isinstance(entries, list) or not entries:
        raise _fail(f"{key}.{mode[0]}", "expected a non-empty list of datasets")
    epochized = mode[0] == "blend_epochized"
    amount = "repetitions" if epochized else "weight"
    amounts = [_amount(e, f"{key}.{mode[0]}[{i}]", amount) for i, e in enumerate(entries)]
    total = sum(amounts)
    if total <= 0:
        raise _fail(f"{key}.{mode[0]}", f"every {amount} is 0: nothing to read")
    leaves = []
    for i, (entry, value) in enumerate(zip(entries, amounts)):
        where = f"{key}.{mode[0]}[{i}]"
        inner, sub = _reference(file, entry, where, split, inherited, storage_options, stack, extra=(amount,))
        if inner is not None and inner != epochized:
            raise _fail(where, "cannot mix blend with blend_epochized (energon's rule)")
        if value == 0:
            continue
        scale = value if epochized else value / total
        leaves += [replace(leaf, share=leaf.share * scale) for leaf in sub]
    return epochized, leaves


def _amount(entry, where: str, name: str) -> float:
    value = entry.get(name, 1) if isinstance(entry, dict) else 1
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _fail(f"{where}.{name}", f"must be a finite number >= 0, got {value!r}")
    return float(value)


def _reference(
    file: str,
    entry,
    key: str,
    split: str,
    inherited: dict,
    storage_options: dict | None,
    stack: tuple[str, ...],
    *,
    extra: tuple[str, ...],
) -> tuple[bool | None, list[Leaf]]:
    """A ``path:`` entry: one leaf, or the leaves of the nested metadataset it names."""
    if not isinstance(entry, dict):
        raise _fail(key, "expected a mapping with path")
    for name in entry:
        if name in UNSUPPORTED:
            raise _fail(f"{key}.{name}", UNSUPPORTED[name])
        if name not in (*REFERENCE_KEYS, *extra):
            raise _fail(f"{key}.{name}", f"unknown key (a dataset entry has {', '.join((*REFERENCE_KEYS, *extra))})")
    if not isinstance(entry.get("path"), str) or not entry["path"]:
        raise _fail(f"{key}.path", "missing: every dataset entry needs the path of a prepared dataset or metadataset")
    if entry.get("shuffle_over_epochs_multiplier", 1) != 1:
        raise _fail(
            f"{key}.shuffle_over_epochs_multiplier",
            "only 1 is supported (the order is data.shuffle's: every epoch a permutation)",
        )
    own = entry.get("subflavors") or {}
    if not isinstance(own, dict):
        raise _fail(f"{key}.subflavors", f"expected a mapping, got {own!r}")
    split_part = entry.get("split_part")
    if split_part is not None and not isinstance(split_part, str):
        raise _fail(f"{key}.split_part", f"expected a split name, got {split_part!r}")
    subflavors = {**own, **inherited}  # the outer metadataset wins, as in energon
    target = resolve(file, entry["path"])
    split_where = f"{key}.split_part" if split_part else key
    if is_metadataset(target):
        return _read_split(target, split_part or split, subflavors, f"{key}.path", storage_options, stack)
    if "://" not in target and not Path(target).exists():
        raise _fail(f"{key}.path", f"{target}: no such dataset")
    return None, [
        Leaf(path=target, split=split_part or split, subflavors=subflavors, where=key, split_where=split_where)
    ]


def resolve(file: str, path: str) -> str:
    """``path`` of an entry in ``file``: as it is when absolute or a URL, else relative to the file's folder."""
    if "://" in path or path.startswith("/"):
        return path
    if "://" in file:
        return f"{file.rsplit('/', 1)[0]}/{path}"
    return str(Path(file).resolve().parent / path)


__all__ = ["Leaf", "Metadataset", "is_metadataset", "read_metadataset", "resolve"]
