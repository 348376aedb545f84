"""Token batches made at batch level: a plain batch whose samples are each one 1-D ``.npy`` member
(what ``dataio shard --tokenizer`` writes) read, checked and collated with per-batch numpy work and
one ``memcpy`` per sample, instead of ``SampleReader.read`` + ``collate``'s Python work per sample.

Algorithm, for the ``B`` references of a batch:

1. locate: per dataset, ``ShardSource.spans``: the index rows by fancy indexing over the mmapped
   index, every key checked against its tar header in one gather (see there);
2. npy headers: the first member's header parsed by ``decode.npy_1d_layout`` (the strict canonical
   regex; no pickle, numeric dtypes only); every member's whole header (magic, version, length,
   dict, padding) then compared byte for byte with that header rewritten for the member's own count,
   which its size gives: one ``(B, header bytes)`` gather and compare;
3. copy: the payloads one after another into one tensor from ``alloc`` (a ring slot in a worker);
   a loop of ``memoryview`` slice copies, measured faster than ``np.concatenate`` of array slices
   or numpy slice assignment (0.35 against 0.45 and 0.55 us a 4 KB sample);
4. bookkeeping (``__ref__``, ``__valid__``, lengths) as whole arrays.

Anything outside that case -- several members, mixed extensions or dtypes, a remote dataset, a
non-canonical header, a key that does not match -- returns None, and the batch goes the general way
(``SampleReader.read``), which also names and counts a bad sample. So this path never accepts what
the general path would reject, and yields the same batch dict (tested).

Cost (one process, 2-core machine, ~4 KB documents): see BENCHMARKS.md "Loader per-sample cost".
"""

from __future__ import annotations

import numpy as np
import torch

from dataio.shards.formats import is_token_member
from dataio.stream.collate import Allocator, bookkeeping, torch_dtype
from dataio.stream.decode import npy_1d_layout
from dataio.stream.sources import ShardSource, by_value

REF_MASK = (1 << 40) - 1  # dataio.stream.batches.REF_BITS


def tokens_only(sources: list[ShardSource]) -> bool:
    """Whether every dataset's samples may be single ``.npy`` members (then ``gather_tokens`` is tried)."""
    return all(not s.remote and s.index.extensions and all(is_token_member(e) for e in s.index.extensions)
               for s in sources)


def gather_tokens(sources: list[ShardSource], refs: np.ndarray, end: int, alloc: Allocator) -> dict | None:
    """The collated plain batch of ``refs`` (all valid), or None where the batch-level path does not apply."""
    dataset = refs >> 40
    groups = np.zeros(len(refs), dtype=np.int64)  # which (dataset, shard) map each sample is in
    offsets = np.empty(len(refs), dtype=np.int64)
    sizes = np.empty(len(refs), dtype=np.int64)
    keys: list = [None] * len(refs)
    buffers: list[np.ndarray] = []
    ext = None
    for d, at in by_value(dataset):
        source = sources[d]
        found = source.spans(refs[at] & REF_MASK)
        if found is None or (ext is not None and found[3] != ext):
            return None
        shards, offsets[at], sizes[at], ext, names = found
        for shard, where in by_value(shards):
            groups[np.arange(len(refs))[at][where]] = len(buffers)
            buffers.append(source.array(shard))
        decoded = [k.decode(errors="surrogateescape") for k in names.tolist()]
        if isinstance(at, slice):
            keys = decoded
        else:
            for i, k in zip(at.tolist(), decoded):
                keys[i] = k
    checked = _check_headers(buffers, groups, offsets, sizes)
    if checked is None:
        return None
    dtype, data = checked
    counts = (sizes - data) // dtype.itemsize
    out = alloc((int(counts.sum()),), torch_dtype(dtype))
    dst = memoryview(out.view(torch.uint8).numpy())
    views = [memoryview(b) for b in buffers]
    pos = 0
    for g, start, size in zip(groups.tolist(), (offsets + data).tolist(), (sizes - data).tolist()):
        dst[pos : pos + size] = views[g][start : start + size]
        pos += size
    batch = bookkeeping(keys, torch.from_numpy(refs), torch.from_numpy(np.ones(len(refs), dtype=bool)), end)
    if (counts == counts[0]).all():
        batch[ext], batch["__lengths__"] = out.view(len(refs), int(counts[0])), {}
    else:
        batch[ext], batch["__lengths__"] = out, {ext: torch.from_numpy(counts)}
    return batch


def _check_headers(buffers: list[np.ndarray], groups: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
                   ) -> tuple[np.dtype, int] | None:
    """``(dtype, data offset)`` shared by every member, each header checked exactly; None otherwise."""
    first = buffers[groups[0]][offsets[0] : offsets[0] + min(int(sizes[0]), 4096)]
    layout = npy_1d_layout(first.data)
    if layout is None:
        return None
    dtype, digits, data = layout
    payload = sizes - data
    if (payload < 0).any() or (payload % dtype.itemsize).any():
        return None
    prefix = first[:digits].tobytes()
    expected = b"".join((b"%s%d,), }" % (prefix, c)).ljust(data - 1) + b"\n"
                        for c in (payload // dtype.itemsize).tolist())
    if len(expected) != data * len(offsets):  # a count too long for this header's padding
        return None
    expected = np.frombuffer(expected, dtype=np.uint8).reshape(len(offsets), data)
    columns = np.arange(data)
    for g, buf in enumerate(buffers):
        at = groups == g if len(buffers) > 1 else slice(None)
        if (buf[offsets[at, None] + columns] != expected[at]).any():
            return None
    return dtype, data


__all__ = ["gather_tokens", "tokens_only"]
