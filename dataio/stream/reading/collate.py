"""Plain collation (``packing: none``): decoded samples -> one batch dict with few, large tensors.

Per field (member extension, e.g. ``tokens.npy``):

- tensors of one shape are stacked: ``batch[ext]`` is ``(B, *shape)``;
- 1-D tensors of different lengths (token documents, mono audio) are concatenated into one flat
  tensor ``batch[ext]`` with their lengths in ``batch["__lengths__"][ext]`` (the THD/varlen layout: no
  padding, so a long-tailed batch costs its real size, not ``B * longest``);
- ``NpyView`` values (1-D ``.npy`` members the loader left undecoded) are copied straight from the
  member buffers into the batch tensor, one ``memcpy`` each, laid out exactly as the two rules above
  (stacked when all lengths agree, else flat + lengths); differing dtypes fall back to tensors;
- ``Audio`` values collate their waveforms like tensors, sample rates go to ``__sample_rate__`` (None where a
  sample has no such member: a dataset mixing FLAC and WAV gives each codec's field as a list); waveforms
  that already lie end to end in one buffer (decoded into the batch by ``headrace.dataio.stream.reading.audio_batch``)
  become the batch tensor as they are, no copy;
- raw member buffers (``memoryview``: audio left encoded by ``decode.audio: raw``) are copied into one
  flat ``uint8`` tensor with lengths, like token documents;
- anything else (``str``, ``dict`` from JSON, ``bytes``) stays a list.

Bookkeeping fields: ``__key__`` (list of keys), ``__ref__`` (int64 sample references, see
``headrace.dataio.stream.ordering.refs.make_ref``), ``__valid__`` (bool; False only for the padding sample of a rank that
ran out at the tail of a finite stream), ``__end__`` (the rank-local stream position after this batch).

Output tensors come from the allocator the caller passes (``alloc``): inside a worker process
that is its shared-memory ring (``headrace.dataio.stream.reading.workers.SharedRing.allocate``), so the one copy
from the page cache (``memcpy`` per member, or ``torch.cat`` / ``torch.stack`` of decoded tensors) is
the only copy from shard to trainer; nothing is pickled but a few offsets.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import torch

from headrace.dataio.stream.reading.decode import Audio, NpyView

_TORCH_DTYPE: dict[np.dtype, torch.dtype] = {}

Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # (shape, dtype) -> uninitialised tensor


def plain_memory(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The allocator outside workers: ordinary process memory."""
    return torch.empty(shape, dtype=dtype)


def collate_field(values: list[Any], alloc: Allocator = plain_memory) -> tuple[Any, torch.Tensor | None]:
    """``(collated, lengths or None)`` of one field's values across a batch, in tensors from ``alloc``."""
    if all(isinstance(v, memoryview) for v in values):  # raw members (e.g. audio left encoded)
        lengths = [v.nbytes for v in values]
        return _concat([v.cast("B") for v in values], lengths, torch.uint8, 1, alloc), torch.tensor(lengths)
    deferred = [isinstance(v, NpyView) for v in values]
    if any(deferred):
        if all(deferred) and all(v.dtype == values[0].dtype for v in values):
            return collate_npy(values, alloc)
        values = [v.tensor() if isinstance(v, NpyView) else v for v in values]
    first = values[0]
    if not isinstance(first, torch.Tensor) or not all(isinstance(v, torch.Tensor) for v in values):
        return values, None
    run = adjacent(values)
    if run is not None:  # already laid out end to end in one buffer (audio decoded into the batch)
        lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.int64)
        if all(v.shape[0] == first.shape[0] for v in values):
            return run.view(len(values), first.shape[0]), None
        return run, lengths
    if all(v.shape == first.shape and v.dtype == first.dtype for v in values):
        out = alloc((len(values), *first.shape), first.dtype)
        return torch.stack(values, out=out), None
    if all(v.ndim == 1 for v in values):
        dtypes = {v.dtype for v in values}
        dtype = _common_dtype(dtypes)
        if len(dtypes) > 1:  # torch.cat does not convert uint16 (one copy a value, only for mixed batches)
            values = [v.to(dtype) for v in values]
        lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.int64)
        out = alloc((int(lengths.sum()),), dtype)
        return torch.cat(values, out=out), lengths
    return values, None


def _common_dtype(dtypes: set[torch.dtype]) -> torch.dtype:
    """The dtype that holds every value of ``dtypes``: torch's promotion, except that integer arrays of
    several dtypes (uint16 token ids beside int32 ones, which torch refuses to promote) become int64."""
    if len(dtypes) > 1 and not any(d.is_floating_point or d.is_complex or d == torch.bool for d in dtypes):
        return torch.int64
    return functools.reduce(torch.promote_types, dtypes)


def adjacent(values: list[torch.Tensor]) -> torch.Tensor | None:
    """The one flat tensor that 1-D contiguous ``values`` of one dtype tile end to end in one storage, in
    order (as ``headrace.dataio.stream.reading.audio_batch`` decodes a batch), else None: such a field is collated
    without a copy (~1 us a value to check)."""
    first = values[0]
    storage, dtype, at = first.untyped_storage().data_ptr(), first.dtype, first.data_ptr()
    for v in values:
        if (
            v.data_ptr() != at
            or v.dtype != dtype
            or v.ndim != 1
            or v.stride(0) != 1
            or v.untyped_storage().data_ptr() != storage
        ):
            return None
        at += v.nbytes
    total = (at - first.data_ptr()) // first.element_size()
    return torch.empty(0, dtype=dtype).set_(first.untyped_storage(), first.storage_offset(), (total,))


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (cached: asked once per batch)."""
    return _TORCH_DTYPE.get(dtype) or _TORCH_DTYPE.setdefault(dtype, torch.from_numpy(np.empty(0, dtype)).dtype)


def collate_npy(views: list[NpyView], alloc: Allocator = plain_memory) -> tuple[torch.Tensor, torch.Tensor | None]:
    """1-D ``.npy`` members of one dtype -> ``(flat tensor, lengths)``, or ``((B, L), None)`` when all
    lengths agree (the same bytes: stacking equal rows is concatenating them)."""
    dtype = views[0].dtype
    counts = [v.count for v in views]
    size = dtype.itemsize
    out = _concat(
        [memoryview(v.buf)[v.offset : v.offset + v.count * size] for v in views],
        counts,
        torch_dtype(dtype),
        size,
        alloc,
    )
    if len(set(counts)) == 1:
        return out.view(len(views), counts[0]), None
    return out, torch.tensor(counts, dtype=torch.int64)


def _concat(
    parts: list[memoryview], counts: list[int], dtype: torch.dtype, size: int, alloc: Allocator
) -> torch.Tensor:
    """Byte buffers (``counts[i] * size`` bytes each) copied one after another into one batch tensor:
    a ``memcpy`` per part, no tensor per part."""
    out = alloc((sum(counts),), dtype)
    dst = memoryview(out.view(torch.uint8).numpy())
    pos = 0
    for part in parts:
        end = pos + part.nbytes
        dst[pos:end] = part
        pos = end
    return out


def bookkeeping(keys: list[str], refs: torch.Tensor, valid: torch.Tensor, end: int) -> dict[str, Any]:
    """A batch's bookkeeping fields (see the module docstring), the first keys of every batch dict."""
    return {"__key__": keys, "__ref__": refs, "__valid__": valid, "__end__": end}


def collate(
    samples: list[dict],
    keys: list[str],
    refs: torch.Tensor,
    valid: torch.Tensor,
    end: int,
    alloc: Allocator = plain_memory,
) -> dict:
    """The batch of decoded ``samples`` (``{ext: value}`` each) with their bookkeeping fields."""
    batch = bookkeeping(keys, refs, valid, end)
    lengths, rates = {}, {}
    # The union of the samples' members (blended datasets may name them differently): a member some
    # samples lack is kept as a list with None in their places, never dropped.
    for ext in dict.fromkeys(ext for s in samples for ext in s):
        values = [s.get(ext) for s in samples]
        if any(isinstance(v, Audio) for v in values):  # a dataset may mix codecs: flac here, wav there
            rates[ext] = [v.sample_rate if isinstance(v, Audio) else None for v in values]
            values = [v.waveform if isinstance(v, Audio) else v for v in values]
        batch[ext], lens = collate_field(values, alloc)
        if lens is not None:
            lengths[ext] = lens
    batch["__lengths__"] = lengths
    if rates:
        batch["__sample_rate__"] = rates
    return batch


__all__ = [
    "Allocator",
    "adjacent",
    "bookkeeping",
    "collate",
    "collate_field",
    "collate_npy",
    "plain_memory",
    "torch_dtype",
]
