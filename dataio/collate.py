"""Plain collation (``packing: none``): decoded samples -> one batch dict with few, large tensors.

Per field (member extension, e.g. ``tokens.npy``):

- tensors of one shape are stacked: ``batch[ext]`` is ``(B, *shape)``;
- 1-D tensors of different lengths (token documents, mono audio) are concatenated into one flat
  tensor ``batch[ext]`` with their lengths in ``batch["__lengths__"][ext]`` (the THD/varlen layout: no
  padding, so a long-tailed batch costs its real size, not ``B * longest``);
- ``Audio`` values collate their waveforms like tensors, sample rates go to ``__sample_rate__``;
- raw member buffers (``memoryview``, e.g. encoded audio left for DALI) become one flat ``uint8``
  tensor with lengths, like token documents;
- anything else (``str``, ``dict`` from JSON, ``bytes``) stays a list.

Bookkeeping fields: ``__key__`` (list of keys), ``__ref__`` (int64 sample references, see
``dataio.loader.make_ref``), ``__valid__`` (bool; False only for the padding sample of a rank that
ran out at the tail of a finite stream), ``__end__`` (the rank-local stream position after this batch).

Inside a DataLoader worker the output tensors are allocated in the worker's shared-memory ring slot
(``dataio.workers.allocate``), so the one ``torch.cat`` / ``torch.stack`` from the page-cache views is
the only copy on the worker side; nothing is pickled but a few offsets.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dataio.decode import Audio
from dataio.workers import allocate


def _as_bytes_tensor(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)


def collate_field(values: list[Any]) -> tuple[Any, torch.Tensor | None]:
    """``(collated, lengths or None)`` of one field's values across a batch."""
    if all(isinstance(v, memoryview) for v in values):  # raw members (e.g. audio left for DALI)
        values = [_as_bytes_tensor(v.cast("B")) for v in values]
    first = values[0]
    if not isinstance(first, torch.Tensor) or not all(isinstance(v, torch.Tensor) for v in values):
        return values, None
    if all(v.shape == first.shape and v.dtype == first.dtype for v in values):
        out = allocate((len(values), *first.shape), first.dtype)
        return torch.stack(values, out=out), None
    if all(v.ndim == 1 for v in values):
        dtype = functools.reduce(torch.promote_types, {v.dtype for v in values})
        lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.int64)
        out = allocate((int(lengths.sum()),), dtype)
        return torch.cat(values, out=out), lengths
    return values, None


def collate(samples: list[dict], keys: list[str], refs: torch.Tensor, valid: torch.Tensor, end: int) -> dict:
    """The batch of decoded ``samples`` (``{ext: value}`` each) with their bookkeeping fields."""
    batch: dict[str, Any] = {"__key__": keys, "__ref__": refs, "__valid__": valid, "__end__": end}
    lengths, rates = {}, {}
    for ext in samples[0] if samples else ():
        values = [s.get(ext) for s in samples]
        if isinstance(values[0], Audio):
            rates[ext] = [v.sample_rate for v in values]
            values = [v.waveform for v in values]
        batch[ext], lens = collate_field(values)
        if lens is not None:
            lengths[ext] = lens
    batch["__lengths__"] = lengths
    if rates:
        batch["__sample_rate__"] = rates
    return batch


__all__ = ["collate", "collate_field"]
