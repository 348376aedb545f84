"""Token batches made at batch level: a plain batch whose samples are each one 1-D ``.npy`` member
(what ``dataio shard --tokenizer`` writes) read and collated with a few numpy operations and one
``memcpy`` per sample, instead of ``SampleReader.read`` + ``collate``'s Python work per sample.

Checks, once per sample per loader (its worker processes share the results), the samples a batch
reads that no process has checked yet, when that batch first reads them (``CheckedTokens``; lazy: the
first batch costs its own samples, whatever the dataset's size, and start-up checks nothing):

1. the index: one member, the dataset's ``.npy`` extension;
2. the tar: every key compared with its ustar name field, one ``(samples, key width + 1)`` gather per
   shard (the check ``ShardSource.read`` does per sample: an index that disagrees with its tar);
3. the ``.npy`` header: the first header parsed by ``decode.npy_1d_layout`` (the strict
   canonical regex; numeric dtypes only, never pickle), then every header (magic, version, length,
   dict, padding) compared byte for byte with that header rewritten for the member's own count,
   which its size gives: one ``(samples, header bytes)`` gather and compare.

What passes is kept per sample (shard, data offset, count, dtype); a sample that fails any check is
marked, and a batch holding one goes the general way (``SampleReader.read``), which names and
counts it. So this path accepts nothing the general path would reject, and yields the same batch
dict (tested). Per batch then: the kept arrays at the batch's indices, the keys, one ``memcpy`` a
sample into one tensor from ``alloc`` (a loop of ``memoryview`` slice copies: 0.35 us a 4 KB sample,
against 0.45 for ``np.concatenate`` of array slices and 0.55 for numpy slice assignment), bookkeeping
as whole arrays. Checking costs ~1-2 us a sample once. The fixed cost per batch, once a process has
seen every sample of the batch's ``BLOCK``-sample blocks checked: a few gathers, no lock and no numpy reduction (BENCHMARKS.md "Loader:
per-batch fixed cost": 0.55x the instructions of the locked version at batch 8).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import weakref

import numpy as np
import torch

from headrace.dataio.shards.formats import is_token_member
from headrace.dataio.stream.reading.collate import Allocator, bookkeeping, torch_dtype
from headrace.dataio.stream.reading.decode import NPY_1D_DTYPES, npy_1d_layout
from headrace.dataio.stream.ordering.refs import REF_BITS, REF_MASK
from headrace.dataio.stream.sources.shard_source import TAR_NAME_FIELD, ShardSource, by_value

BLOCK_BITS = 10
BLOCK = 1 << BLOCK_BITS
SHAPE_END = b",), }"  # after the count in a canonical 1-D header
UNCHECKED, GENERAL, FIRST_DTYPE_CODE = 0, 1, 2  # ``CheckedTokens.code``: 0 is what fresh pages hold
TOKEN_DTYPES = tuple(NPY_1D_DTYPES.values())  # a code's dtype, the same in every process
SHARD_BITS = 32  # a batch's shard key: dataset << SHARD_BITS | shard
SHARD_MASK = (1 << SHARD_BITS) - 1


def tokens_only(sources: list[ShardSource]) -> bool:
    """Whether every dataset is a mapped (local or disk-cached) indexed one (not a foreign format,
    ``headrace.dataio.stream.sources.interop``) with only ``.npy`` members (then ``gather_tokens`` is tried)."""
    return all(
        isinstance(s, ShardSource)
        and not s.ranged
        and len(s.index.extensions) == 1
        and is_token_member(s.index.extensions[0])
        for s in sources
    )


class CheckedTokens:
    """One dataset's samples as checked token payloads (see the module docstring), in shared memory: the
    processes forked after it is made (the loader's workers, every epoch's) check each sample once
    between them instead of once each -- with two workers taking turns at batches, each would otherwise
    check every sample.

    A process checks the samples of its batch that no process has published yet (two processes whose
    batches share a sample, rare, may both check it and publish the same values), so no process ever
    waits for another's check (nor hangs on one that died mid-check). A POSIX record lock on the
    table's memfd (held only to read and publish, never while checking) orders the writes and reads
    between processes; it dies with its holder. Blocks of ``BLOCK`` samples found all checked are
    remembered per process, so a batch inside such blocks is read without the lock."""

    def __init__(self, source: ShardSource):
        n, blocks = len(source.index.samples), -(-len(source.index.samples) // BLOCK)
        self.ext = source.index.extensions[0]  # no reference to the source: it keys this table weakly
        size = max(1, 25 * n)
        self._fd = os.memfd_create("headrace-checked-tokens", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self._fd)  # the map keeps its own descriptor
        os.ftruncate(self._fd, size)  # zero-filled, pages touched only as blocks are checked
        self._map = mmap.mmap(self._fd, size)
        self.start = np.frombuffer(self._map, dtype=np.int64, count=n)  # byte offset of the data in its shard
        self.count = np.frombuffer(self._map, dtype=np.int64, count=n, offset=8 * n)
        self.shard = np.frombuffer(self._map, dtype=np.int64, count=n, offset=16 * n)
        self.code = np.frombuffer(self._map, dtype=np.int8, count=n, offset=24 * n)  # 0: UNCHECKED
        # this process's own: blocks it has seen finished (copied into the processes it forks)
        self._known = np.zeros(blocks, dtype=bool)
        self.uniform: int | None = None  # the one dtype code of every sample, once all are known here

    def lookup(
        self, source: ShardSource, index: np.ndarray
    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]:
        """``(code, shard, start, count)`` of ``index`` in ``source``, checking first what no process has;
        ``code`` is None when every sample of the dataset holds one token dtype, ``self.uniform``.

        Without the lock once this process has seen (under the lock) every block of ``index`` finished:
        a finished row is never written again but with the same values (a process that checked it for
        its batch alone), and the lock's acquire ordered its publication before this read. Then a
        lookup is a few gathers; once every block is known, no per-sample code test either."""
        if self.uniform is None and not self._known[index >> BLOCK_BITS].all():
            return self._lookup_locked(source, index)
        return (
            None if self.uniform is not None else self.code[index],
            self.shard[index],
            self.start[index],
            self.count[index],
        )

    def _lookup_locked(self, source: ShardSource, index: np.ndarray) -> tuple[np.ndarray, ...]:
        with self._locked():
            code = self.code[index]
            unchecked = index[code == UNCHECKED]
            if not len(unchecked):  # checked by another process: one lock, one read
                self._learn(index)
                return code, self.shard[index], self.start[index], self.count[index]
        # only the samples this batch reads: the first batch costs its own samples, not whole blocks
        rows, code, shard, start, count = self._check(source, np.sort(unchecked))
        with self._locked():
            self.start[rows], self.count[rows], self.shard[rows] = start, count, shard
            self.code[rows] = code
            self._learn(index)
            return self.code[index], self.shard[index], self.start[index], self.count[index]

    def _learn(self, index: np.ndarray) -> None:
        """Under the lock: mark the blocks of ``index`` that every process has finished as known here,
        and once all are, whether the whole dataset holds one token dtype (``uniform``)."""
        for b in sorted(set((index >> BLOCK_BITS).tolist())):
            if not self._known[b]:
                self._known[b] = bool((self.code[b * BLOCK : (b + 1) * BLOCK] != UNCHECKED).all())
        if self._known.all():
            low, high = int(self.code.min()), int(self.code.max())
            self.uniform = low if low == high and low >= FIRST_DTYPE_CODE else None

    @contextlib.contextmanager
    def _locked(self):
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def _check(self, source: ShardSource, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """``(rows, code, shard, start, count)`` of samples ``rows`` (ascending)."""
        samples = source.index.samples[rows]
        members = source.index.members[np.minimum(samples["member_start"], len(source.index.members) - 1)]
        shards = samples["shard"].astype(np.int64)
        offsets, sizes = members["offset"].astype(np.int64), members["size"].astype(np.int64)
        keys = source.index.keys[rows]
        ok = (samples["member_count"] == 1) & (members["ext"] == 0) & (offsets >= 512) & (offsets % 8 == 0)
        if keys.dtype.kind != "S" or keys.dtype.itemsize >= TAR_NAME_FIELD:  # long names: the general path
            ok[:] = False
        code = np.full(len(rows), GENERAL, dtype=np.int8)
        start, count = np.zeros(len(rows), dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
        if ok.any():
            ok[ok] = _keys_match(source, shards[ok], offsets[ok], keys[ok])
        if ok.any():
            layout = _headers(source, shards[ok], offsets[ok], sizes[ok])
            if layout is not None:
                dtype, data, good = layout
                ok[ok] = good
                code[ok] = dtype_code(dtype)
                start, count = offsets + data, (sizes - data) // dtype.itemsize
        return rows, code, shards, start, count


def dtype_code(dtype: np.dtype) -> int:
    return FIRST_DTYPE_CODE + TOKEN_DTYPES.index(dtype)


def _keys_match(source: ShardSource, shards: np.ndarray, offsets: np.ndarray, keys: np.ndarray) -> np.ndarray:
    width = keys.dtype.itemsize
    expected = np.zeros((len(keys), width + 1), dtype=np.uint8)  # key + "." (NUL-padded keys)
    expected[:, :width] = np.ascontiguousarray(keys).view(np.uint8).reshape(len(keys), width)
    lengths = np.count_nonzero(expected, axis=1)
    expected[np.arange(len(keys)), lengths] = ord(".")
    compared = np.arange(width + 1) <= lengths[:, None]
    # the ustar name field opens the 512-byte header before the payload
    return _match(source, shards, offsets - 512, expected, compared)


def _match(
    source: ShardSource,
    shards: np.ndarray,
    offsets: np.ndarray,
    expected: np.ndarray,
    compared: np.ndarray | None = None,
) -> np.ndarray:
    """Whether the bytes at ``offsets`` (multiples of 8) of each sample's shard equal its row of
    ``expected`` where ``compared`` (None: everywhere): compared as 8-byte words, one fancy-index
    gather per shard (8x fewer elements than bytes)."""
    n, length = expected.shape
    words = -(-length // 8)
    padded = np.zeros((n, words * 8), dtype=np.uint8)
    padded[:, :length] = expected
    mask = np.zeros((n, words * 8), dtype=np.uint8)
    mask[:, :length] = 0xFF if compared is None else compared * np.uint8(0xFF)
    padded, mask = padded.view(np.uint64), mask.view(np.uint64)
    match = np.zeros(n, dtype=bool)
    for shard, at in by_value(shards):
        array = source.array(shard)
        array = array[: len(array) // 8 * 8].view(np.uint64)
        first = offsets[at] // 8
        inside = np.flatnonzero(first + words <= len(array))  # a sample at the very end: the general path
        rows = np.arange(n)[at][inside]
        found = array[first[inside, None] + np.arange(words)]
        match[rows] = ~((found ^ padded[rows]) & mask[rows]).any(axis=1)
    return match


def _headers(
    source: ShardSource, shards: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
) -> tuple[np.dtype, int, np.ndarray] | None:
    """``(dtype, data offset, which headers match)`` with the first header as the template."""
    first = source.array(int(shards[0]))[offsets[0] : offsets[0] + min(int(sizes[0]), 4096)]
    layout = npy_1d_layout(first.data)
    if layout is None:
        return None
    dtype, digits, data = layout
    payload = sizes - data
    good = (payload >= 0) & (payload % dtype.itemsize == 0)
    expected, fits = _expected_headers(first[:digits].tobytes(), payload // dtype.itemsize, data)
    good &= fits
    sel = np.flatnonzero(good)
    good[sel] = _match(source, shards[sel], offsets[sel], expected[sel])
    return dtype, data, good


def _expected_headers(prefix: bytes, counts: np.ndarray, data: int) -> tuple[np.ndarray, np.ndarray]:
    """``(headers, fits)``: each count's canonical header, ``prefix`` + its digits + ``",), }"`` padded
    with spaces to ``data - 1`` bytes + a newline, as a ``(len(counts), data)`` array; the variable part
    (digits, then the closing bytes) is one table lookup: row ``i`` reads its right-aligned decimal
    digits followed by the closing bytes from ``digits`` columns before the end of its digits. ``fits``
    is False where the count is too long for this padding (or negative)."""
    negative = counts < 0
    counts = np.maximum(counts, 0)
    width = len(str(int(counts.max(initial=0))))
    lengths = 1 + (counts[:, None] >= 10 ** np.arange(1, width, dtype=np.int64)).sum(axis=1)  # digits per count
    start, closing = len(prefix), np.frombuffer(SHAPE_END + b" ", dtype=np.uint8)  # after the digits: padding
    fits = (start + lengths + len(SHAPE_END) <= data - 1) & ~negative
    table = np.empty((len(counts), width + len(closing)), dtype=np.uint8)  # right-aligned digits, closing bytes
    table[:, :width] = ord("0") + counts[:, None] // 10 ** np.arange(width - 1, -1, -1, dtype=np.int64) % 10
    table[:, width:] = closing
    span = min(width + len(SHAPE_END), data - 1 - start)  # the columns the digits and closing bytes can reach
    columns = np.minimum(np.arange(span) + (width - lengths)[:, None], table.shape[1] - 1)  # past the table: padding
    headers = np.full((len(counts), data), ord(" "), dtype=np.uint8)
    headers[:, :start] = np.frombuffer(prefix, dtype=np.uint8)
    headers[:, start : start + span] = np.take_along_axis(table, columns, axis=1)
    headers[:, data - 1] = ord("\n")
    return headers, fits


_checked: weakref.WeakKeyDictionary[ShardSource, CheckedTokens] = weakref.WeakKeyDictionary()


def checked(source: ShardSource) -> CheckedTokens:
    """The source's ``CheckedTokens`` (one per source, shared with the processes forked after it is made)."""
    table = _checked.get(source)
    if table is None:
        table = _checked[source] = CheckedTokens(source)
    return table


def gather_tokens(sources: list[ShardSource], refs: np.ndarray, end: int, alloc: Allocator) -> dict | None:
    """The collated plain batch of ``refs`` (all valid), or None where the batch-level path does not apply.

    Per dataset of the batch: its table's rows (``CheckedTokens.lookup``) and its keys; then the copy,
    one ``memcpy`` a sample, shard by shard (``_copy_by_shard``): each distinct shard's map is checked to
    still hold the bytes the index places in it (``ShardSource.indexed_array``: one ``fstat`` a shard)
    and released before the next shard's is taken, so a batch touching more shards than the open-shard
    budget never holds more than one map beyond it. Per batch that is a handful of numpy calls and no
    reduction beyond the dtype test of samples not yet known (see ``CheckedTokens.uniform``)."""
    n = len(refs)
    if len(sources) == 1:  # dataset 0: a reference is its sample index
        parts = [(0, slice(None), refs)]
    else:
        parts = [(d, at, refs[at] & REF_MASK) for d, at in by_value(refs >> REF_BITS)]
    shards, starts, counts = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    keys: list = [None] * n
    ext = dtype = None
    for d, at, index in parts:
        source, table = sources[d], checked(sources[d])
        code, shard, start, count = table.lookup(source, index)
        first = table.uniform if code is None else int(code[0])
        if (
            first < FIRST_DTYPE_CODE
            or (code is not None and (code != first).any())
            or ext not in (None, table.ext)
            or dtype not in (None, TOKEN_DTYPES[first - FIRST_DTYPE_CODE])
        ):
            return None
        ext, dtype = table.ext, TOKEN_DTYPES[first - FIRST_DTYPE_CODE]
        shards[at], starts[at], counts[at] = (d << SHARD_BITS) | shard, start, count
        decoded = [k.decode(errors="surrogateescape") for k in source.index.keys[index].tolist()]
        if len(parts) == 1:
            keys = decoded
            continue
        for i, k in zip(np.arange(n)[at].tolist(), decoded):
            keys[i] = k
    size = dtype.itemsize
    out = alloc((int(counts.sum()),), torch_dtype(dtype))
    _copy_by_shard(sources, shards, starts, counts * size, memoryview(out.view(torch.uint8).numpy()))
    batch = bookkeeping(keys, torch.from_numpy(refs), torch.ones(n, dtype=torch.bool), end)
    if counts.min() == counts.max():
        batch[ext], batch["__lengths__"] = out.view(n, int(counts[0])), {}
    else:
        batch[ext], batch["__lengths__"] = out, {ext: torch.from_numpy(counts)}
    return batch


def _copy_by_shard(
    sources: list[ShardSource], shards: np.ndarray, starts: np.ndarray, sizes: np.ndarray, dst: memoryview
) -> None:
    """Copy byte range ``[starts[i], starts[i] + sizes[i])`` of shard ``shards[i]`` (``dataset << SHARD_BITS |
    shard``) to its place in ``dst`` (the samples laid end to end, in batch order), visiting the samples
    grouped by shard and holding one shard's view at a time: a map the budget closes is unmapped as soon
    as it is evicted, not when the batch ends."""
    ends = np.cumsum(sizes)
    places = (ends - sizes).tolist()
    order = range(len(shards)) if shards.min() == shards.max() else np.argsort(shards, kind="stable").tolist()
    shards, starts, sizes = shards.tolist(), starts.tolist(), sizes.tolist()
    current, view = None, None
    for i in order:
        if shards[i] != current:
            current, view = shards[i], None  # the previous view dropped before the next map is taken
            view = memoryview(sources[current >> SHARD_BITS].indexed_array(current & SHARD_MASK))
        a, c, p = starts[i], sizes[i], places[i]
        dst[p : p + c] = view[a : a + c]


__all__ = ["BLOCK", "CheckedTokens", "checked", "gather_tokens", "tokens_only"]
