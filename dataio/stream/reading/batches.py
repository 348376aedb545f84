"""What a worker runs: sample references -> decoded samples (``SampleReader``) and batch number ->
collated plain batch (``BatchMaker``). Both are picklable and keep no state but a bad-sample count,
so a batch is a pure function of its number and the rank's layout.

Sample references (``__ref__``, packing ``ref``): ``headrace.dataio.stream.ordering.refs``.
Cost: one vectorised read per dataset per batch (``ShardSource.read``); a read that fails is retried
sample by sample only to name the bad ones. Token batches (one ``.npy`` member a sample) take the
batch-level path of ``headrace.dataio.stream.reading.gather`` first.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from headrace.dataio.config import DataConfig
from headrace.dataio.shards.formats import is_token_member
from headrace.dataio.stream.reading.audio_batch import decode_pending
from headrace.dataio.stream.ordering.blend import BlendSchedule
from headrace.dataio.stream.reading.collate import Allocator, bookkeeping, collate
from headrace.dataio.stream.reading.dali import BatchAudio
from headrace.dataio.stream.reading.decode import (
    TOKEN_ID_LIMIT,
    SampleDecodeError,
    check_fits_int64,
    check_token_document,
    decode_sample,
    member_error,
)
from headrace.dataio.stream.ordering.epochized import EpochizedSchedule
from headrace.dataio.stream.reading.gather import gather_tokens, tokens_only
from headrace.dataio.stream.ordering.epoch_order import EpochOrder
from headrace.dataio.stream.ordering.refs import REF_BITS, REF_MASK, make_ref
from headrace.dataio.stream.ordering.seeding import SeedSchedule
from headrace.dataio.stream.sources.shard_source import ShardSource, by_value
from headrace.dataio.stream.ordering.split import Layout
from headrace.dataio.stagetimes import TIMES, add_time

log = logging.getLogger(__name__)


def token_ext(source: ShardSource) -> str | None:
    """The token member (``*.npy``) of a source's samples, if any."""
    return next((e for e in source.index.extensions if is_token_member(e)), None)


def check_documents(sample: dict, token: str | None, *, key: str, shard: str) -> None:
    """SampleDecodeError naming the member unless ``sample`` has its dataset's ``token`` member and every
    token member of it is a document."""
    if token is not None and token not in sample:
        raise SampleDecodeError(
            f"no {token} member: packing needs one in every sample of this dataset", shard=shard, key=key, member=token
        )
    for ext, value in sample.items():
        if is_token_member(ext):
            try:
                check_token_document(value)
            except ValueError as e:
                raise member_error(e, shard=shard, key=key, member=ext) from None


def check_id_range(sample: dict, *, key: str, shard: str) -> None:
    """SampleDecodeError naming the member when a token member holds a uint64 id that does not fit int64."""
    for ext, value in sample.items():
        if is_token_member(ext):
            try:
                check_fits_int64(value)
            except ValueError as e:
                raise member_error(e, shard=shard, key=key, member=ext) from None


class SampleReader:
    """Decoded samples of sample references, bad ones skipped and counted against ``max_bad_samples``."""

    def __init__(self, cfg: DataConfig, sources: list[ShardSource], *, bad_so_far: int):
        self.cfg, self.sources = cfg, sources
        self.bad = bad_so_far  # this process's count; the main process keeps the rank's total
        self.token_exts = [token_ext(s) for s in sources]
        self.read_seconds = 0.0  # time in the sources' reads, so far (the rest of ``read`` is decoding)
        self.batch_audio = None  # decode.audio: dali decodes each batch's audio at once (reading.dali)
        if cfg.decode.audio == "dali":
            self.batch_audio = BatchAudio(cfg.decode)

    @property
    def fork_safe(self) -> bool:
        """Whether a batch may be made in the main process before it forks workers."""
        return self.batch_audio is None or self.batch_audio.fork_safe

    def read(
        self, refs: np.ndarray, *, defer_npy: bool = False, alloc: Allocator | None = None, padding: bool = False
    ) -> tuple[list[dict], list[str], np.ndarray, int]:
        """``(samples, keys, kept, bad)``: decoded samples of ``refs`` in order, skipping (and counting)
        bad ones; ``kept`` are the positions in ``refs`` of the samples returned (``defer_npy``: 1-D token
        arrays as ``NpyView`` for ``headrace.dataio.stream.reading.collate`` to copy straight into the batch; ``alloc``:
        soundfile audio decoded straight into one tensor from it, ``headrace.dataio.stream.reading.audio_batch``; ``padding``:
        a bad sample is dropped uncounted, as it is counted where it is read as itself)."""
        samples, keys, shards, kept, bad = [], [], [], [], 0
        pending = alloc is not None
        start = time.perf_counter()
        raw = self._raw(refs)
        self.read_seconds += time.perf_counter() - start
        for i, item in enumerate(raw):
            if not isinstance(item, SampleDecodeError):
                key, shard, members = item
                try:
                    sample = decode_sample(
                        members, self.cfg.decode, key=key, shard=shard, defer_npy=defer_npy, defer_audio=pending
                    )
                    if self.cfg.thd:  # packing takes every .npy member for a document of token ids
                        check_documents(sample, self.token_exts[int(refs[i]) >> REF_BITS], key=key, shard=shard)
                    else:  # plain batches: token ids must still fit the int64 the trainer reads them as
                        check_id_range(sample, key=key, shard=shard)
                    samples.append(sample)
                    keys.append(key)
                    shards.append(shard)
                    kept.append(i)
                    continue
                except SampleDecodeError as e:
                    item = e
            if padding:
                continue
            self._skip(item)
            bad += 1
        failed = {}
        if self.batch_audio is not None and samples:  # the audio decode_sample left raw, per batch
            failed = self.batch_audio(samples, keys, shards)
        elif pending and samples:  # the audio decode_sample left pending, into one tensor per member
            failed = decode_pending(samples, keys, shards, self.cfg.decode, alloc)
        if failed:
            for s in sorted(failed) if not padding else ():
                self._skip(failed[s])
            bad += len(failed) if not padding else 0
            good = [s for s in range(len(samples)) if s not in failed]
            samples, keys, kept = [samples[s] for s in good], [keys[s] for s in good], [kept[s] for s in good]
        return samples, keys, np.asarray(kept, dtype=np.int64), bad

    def _raw(self, refs: np.ndarray) -> list[tuple[str, str, dict] | SampleDecodeError]:
        """``(key, shard, members)`` of each of ``refs``, or the error of an unreadable one."""
        dataset, index = refs >> REF_BITS, refs & REF_MASK
        raw: list = [None] * len(refs)
        for d, at in by_value(dataset):
            at = np.arange(len(refs))[at]
            source = self.sources[d]
            try:
                for i, item in zip(at, source.read(index[at])):
                    raw[i] = item
            except SampleDecodeError:  # find which samples are bad, one by one
                for i in at:
                    try:
                        raw[i] = source.read(index[i : i + 1])[0]
                    except SampleDecodeError as e:
                        raw[i] = e
        return raw

    def _skip(self, error: SampleDecodeError) -> None:
        """Count a bad sample; past ``max_bad_samples`` its error is raised, with the budget named."""
        self.bad += 1
        if self.bad > self.cfg.max_bad_samples:
            budget = f" (more than max_bad_samples={self.cfg.max_bad_samples} bad samples on this rank)"
            raise type(error)(
                error.reason + budget * bool(self.cfg.max_bad_samples),
                shard=error.shard,
                key=error.key,
                member=error.member,
            ) from error
        log.warning("skipping bad sample (%d of max_bad_samples=%d): %s", self.bad, self.cfg.max_bad_samples, error)


class BatchMaker:
    """Plain batch ``b`` of one rank's stream (the rank-local positions after ``first_local``)."""

    def __init__(
        self,
        *,
        reader: SampleReader,
        blend: BlendSchedule | EpochizedSchedule,
        seed: int | SeedSchedule,
        layout: Layout,
        dp_rank: int,
        first_local: int,
        batch_size: int,
        subflavors: list[dict] | None = None,
    ):
        cfg = reader.cfg
        self.subflavors = subflavors  # per dataset: energon's __subflavors__ (sources.metadataset)
        self.reader, self.sources, self.blend, self.layout, self.dp_rank = (
            reader,
            reader.sources,
            blend,
            layout,
            dp_rank,
        )
        self.first_local, self.batch_size = first_local, batch_size
        self.local_end = layout.local_count(dp_rank, blend.end)
        self.orders = [
            EpochOrder(
                s.shard_starts,
                s.shard_sizes,
                seed=seed,
                dataset=i,
                shuffle=cfg.shuffle,
                window=cfg.shuffle_window,
                window_shards=cfg.shuffle_window_shards,
            )
            for i, s in enumerate(self.sources)
        ]
        self.tokens_only = tokens_only(self.sources)

    def refs(self, positions: np.ndarray) -> np.ndarray:
        """Sample references at global ``positions`` (ascending, as a batch's are)."""
        dataset, draw = self.blend.locate(positions)
        if len(self.sources) == 1:  # dataset 0: a reference is its sample index
            return self._indices(0, draw)
        index = np.empty(len(positions), dtype=np.int64)
        for d, at in by_value(dataset):
            index[at] = self._indices(d, draw[at])
        return make_ref(dataset, index)

    def _indices(self, d: int, draw: np.ndarray) -> np.ndarray:
        """Dataset ``d``'s sample indices of its draws ``draw`` (ascending: their epochs are runs)."""
        epoch, pos = np.divmod(draw, len(self.orders[d]))  # (a source's len is a sum)
        if not len(epoch) or epoch[0] == epoch[-1]:  # the usual case: one epoch
            return self.orders[d].indices(int(epoch[0]) if len(epoch) else 0, pos)
        within = np.empty(len(pos), dtype=np.int64)
        for e, sel in by_value(epoch):
            within[sel] = self.orders[d].indices(e, pos[sel])
        return within

    def _span(self, b: int) -> tuple[int, np.ndarray, np.ndarray]:
        """``(end, local, positions)`` of batch ``b``: the rank-local position after it, and the rank-local
        and global positions of its samples (those a re-layout skips left out)."""
        lo = self.first_local + b * self.batch_size
        hi = lo + self.batch_size if self.local_end is None else min(lo + self.batch_size, self.local_end)
        local = np.arange(lo, max(lo, hi), dtype=np.int64)
        positions = self.layout.positions(self.dp_rank, local)
        keep = ~self.layout.skipped(positions) if self.layout.skips else slice(None)
        return max(lo, hi), local[keep], positions[keep]

    def __call__(self, b: int, alloc: Allocator) -> dict:
        """The plain (collated) batch ``b`` in tensors from ``alloc``, with ``__pos__`` (rank-local
        positions), ``__bad__`` (samples skipped while making it) and ``__end__`` (the position after it)
        for the main process, and its read / decode / collate seconds (``__times__``)."""
        start = time.perf_counter()
        end, local, positions = self._span(b)
        refs = self.refs(positions)
        batch = gather_tokens(self.sources, refs, end, alloc) if self.tokens_only and len(refs) else None
        if batch is not None and _has_refused_id(batch, packing=self.reader.cfg.thd):
            batch = None  # the general path names and counts the samples that packing cannot take
        if batch is not None:  # token batches: read, checked and collated per batch (reading.gather)
            batch["__pos__"], batch["__bad__"] = torch.from_numpy(local), 0
            add_time(batch, "read", start)
            return self._with_subflavors(batch)
        read_before, reading = self.reader.read_seconds, time.perf_counter()
        samples, keys, kept, bad = self.reader.read(refs, defer_npy=True, alloc=alloc)
        if not samples and bad:  # every sample bad (each counted): a batch of none, which no stage delivers
            return self._with_subflavors(no_samples(end, bad))
        valid = torch.ones(len(samples), dtype=torch.bool)
        if not samples:  # a rank left without a sample at the tail: one flagged padding sample
            refs = self.refs(np.array([self.layout.start]))
            samples, keys, kept, _ = self.reader.read(refs, defer_npy=True, alloc=alloc, padding=True)
            valid = torch.zeros(len(samples), dtype=torch.bool)
            local = np.full(len(samples), -1)
        collating = time.perf_counter()
        batch = collate(samples, keys, torch.from_numpy(refs[kept]), valid, end=end, alloc=alloc)
        batch["__pos__"] = torch.from_numpy(local[kept])
        batch["__bad__"] = bad
        read = self.reader.read_seconds - read_before
        batch[TIMES] = {"read": reading - start + read, "decode": collating - reading - read}
        add_time(batch, "collate", collating)
        return self._with_subflavors(batch)

    def task(self, first: int, count: int, alloc: Allocator) -> list[dict] | None:
        """Batches ``first .. first+count-1``, each as ``self(b, alloc)`` makes it, from one
        ``gather_tokens`` over all their samples (a worker's task: the fixed cost of a batch -- the
        lookups, the shard checks, the bookkeeping -- paid once a task): every tensor, its small ones
        included, is a view of one per-field tensor from ``alloc``. None where that does not apply (not
        token batches, a batch without samples, a sample the general path must name): the caller then
        makes them one by one."""
        if not self.tokens_only:
            return None
        start = time.perf_counter()
        spans = [self._span(b) for b in range(first, first + count)]
        if min(len(local) for _, local, _ in spans) == 0:
            return None
        local = np.concatenate([local for _, local, _ in spans])
        refs = self.refs(np.concatenate([positions for _, _, positions in spans]))
        union = gather_tokens(self.sources, refs, 0, alloc)
        if union is None or _has_refused_id(union, packing=self.reader.cfg.thd):
            return None
        ext = next(k for k in union if is_token_member(k))
        tokens, lengths = union[ext], union["__lengths__"].get(ext)
        counts = [tokens.shape[1]] * len(refs) if lengths is None else lengths.tolist()
        tokens = tokens.view(-1)
        if lengths is None:
            lengths = torch.full((len(refs),), counts[0], dtype=torch.int64)
        small = [_into(alloc, t) for t in (union["__ref__"], union["__valid__"], lengths, torch.from_numpy(local))]
        ref, valid, lengths, pos = small
        subflavors = None if self.subflavors is None else [self.subflavors[d] for d in (refs >> REF_BITS).tolist()]
        out, at, offset = [], 0, 0
        read = (time.perf_counter() - start) / len(spans)  # one read for all: an equal share each
        for end, part, _ in spans:
            n = len(part)
            own = counts[at : at + n]
            size = sum(own)
            batch = bookkeeping(union["__key__"][at : at + n], ref[at : at + n], valid[at : at + n], end)
            if min(own) == max(own):
                batch[ext], batch["__lengths__"] = tokens[offset : offset + size].view(n, own[0]), {}
            else:
                batch[ext], batch["__lengths__"] = tokens[offset : offset + size], {ext: lengths[at : at + n]}
            batch["__pos__"], batch["__bad__"], batch[TIMES] = pos[at : at + n], 0, {"read": read}
            if subflavors is not None:
                batch["__subflavors__"] = subflavors[at : at + n]
            out.append(batch)
            at, offset = at + n, offset + size
        return out

    def _with_subflavors(self, batch: dict) -> dict:
        if self.subflavors is not None:
            batch["__subflavors__"] = [self.subflavors[d] for d in (batch["__ref__"] >> REF_BITS).tolist()]
        return batch


def no_samples(end: int, bad: int) -> dict:
    """The batch of a read whose every sample was bad (``bad`` of them, counted): bookkeeping only, so the stage
    advances its position past it and delivers nothing in its place (no other sample repeats, no empty batch)."""
    empty = torch.zeros(0, dtype=torch.int64)
    batch = bookkeeping([], empty, torch.zeros(0, dtype=torch.bool), end)
    batch.update({"__pos__": empty, "__bad__": bad, "__lengths__": {}})
    return batch


def _into(alloc: Allocator, t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in a tensor from ``alloc`` (a worker's ring: sent as a view, not pickled)."""
    out = alloc(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def _has_refused_id(batch: dict, *, packing: bool) -> bool:
    """Whether a gathered token batch holds a uint64 id that does not fit int64, or with ``packing`` anything else
    packing refuses (``decode.check_token_document``): floats, a negative id (one reduction, signed and 64-bit
    unsigned dtypes only)."""
    tokens = next(v for k, v in batch.items() if is_token_member(k))
    if tokens.dtype.is_floating_point:  # not token ids at all
        return packing
    if tokens.numel() == 0:
        return False
    if tokens.dtype == torch.uint64:  # torch has no max of uint64: numpy's, over the same memory
        return int(tokens.numpy().max()) >= TOKEN_ID_LIMIT
    return packing and tokens.dtype.is_signed and int(tokens.min()) < 0


__all__ = ["BatchMaker", "SampleReader", "no_samples", "token_ext"]
