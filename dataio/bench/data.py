"""What ``dataio bench`` measures: one indexed shard directory.

``describe(cfg, work)`` resolves the ``data:`` section's (single) dataset into a ``BenchData``: the
tar files of its split, their sample count and bytes, its kind (``text`` when it has a token member
such as ``npy`` / ``tokens.npy``, ``audio`` when it has an audio member), the member that is counted
(tokens or audio) and the output contract every loader produces for it (``headrace.dataio.bench.contract``).
Peers write their own formats under ``work``.

``count_full`` counts a batch in headrace's own full layout (``headrace.dataio.stream.reading.collate``: keys,
flat tensors plus lengths), the ``headrace-full`` row's.

Audio-bytes mode (``decode.audio: raw``, ``dataio bench --audio-bytes``): no loader decodes audio; each
hands the encoded member bytes over as one ``uint8`` tensor plus lengths, and the counted unit is MB of
encoded audio, so every loader moves the same bytes and the page-cache limit is a like-for-like ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from headrace.dataio.bench.contract import contract_kind
from headrace.dataio.config import DataConfig
from headrace.dataio.shards.formats import is_audio_member, is_token_member
from headrace.dataio.config import DecodeConfig
from headrace.dataio.stream.sources.shard_source import ShardSource


@dataclass(kw_only=True)
class BenchData:
    cfg: DataConfig  # the data: section (headrace's loader reads it as it is)
    root: Path  # the dataset directory
    split: str
    kind: Literal["text", "audio"]
    field: str  # the member counted: token ids (text) or audio (audio)
    members: list[str]  # every member extension of the dataset
    shards: list[Path]  # the split's tar files, in index order
    samples: int
    bytes: int  # bytes of those tars
    work: Path  # where peers write their own formats

    @property
    def decode(self) -> DecodeConfig:
        return self.cfg.decode

    @property
    def contract(self) -> str:
        """The output contract's kind: "text", "audio" (decoded) or "bytes" (``headrace.dataio.bench.contract``)."""
        return contract_kind(self.kind, self.audio_bytes)

    @property
    def audio_bytes(self) -> bool:
        """Audio left encoded by every loader (``decode.audio: raw``): units are MB of encoded audio."""
        return self.kind == "audio" and self.decode.audio == "raw"


def describe(cfg: DataConfig, work: Path) -> BenchData:
    """The ``BenchData`` of ``cfg``'s one local dataset (ValueError when there are several or it is remote)."""
    if len(cfg.datasets) != 1:
        raise ValueError(f"the bench compares loaders on one dataset; the config lists {len(cfg.datasets)}")
    spec = cfg.datasets[0]
    if "://" in spec.path:
        raise ValueError(f"the bench reads a local dataset directory; got {spec.path}")
    source = ShardSource(spec.path, split=spec.split)
    exts = list(source.index.extensions)
    token = next((e for e in exts if is_token_member(e)), None)
    audio = next((e for e in exts if is_audio_member(e)), None)
    if audio is None and token is None:
        raise ValueError(f"{spec.path}: no token (.npy) or audio member to benchmark (members: {exts})")
    root = Path(spec.path)
    shards = [root / s.name for s in source.index.shards if s.split == spec.split]
    return BenchData(
        cfg=cfg,
        root=root,
        split=spec.split,
        kind="audio" if audio else "text",
        field=audio or token,
        members=exts,
        shards=shards,
        samples=len(source),
        bytes=sum(p.stat().st_size for p in shards),
        work=work,
    )


def count_full(batch: dict, data: BenchData) -> tuple[int, float]:
    """(samples, units) of one batch in that layout: tokens for text, seconds of audio for audio, MB of
    encoded audio in audio-bytes mode."""
    n = len(batch["__key__"])
    values = batch.get(data.field)
    if not isinstance(values, torch.Tensor):
        return n, 0.0
    if data.kind == "text":
        return n, float(values.numel())
    if data.audio_bytes:
        return n, values.numel() * values.element_size() / 1e6
    rate = batch.get("__sample_rate__", {}).get(data.field, [data.decode.sample_rate or 1])[0]
    return n, values.numel() / rate


__all__ = ["BenchData", "count_full", "describe"]
