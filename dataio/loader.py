"""``build_loader``: the resumable, rank-aware stream of batches the trainer iterates.

The whole stream is a pure function of position, composed of small stages:

1. ``dataio.stream.blend``: global position ``p`` -> (dataset ``d``, its draw number ``k``), closed form.
2. ``dataio.stream.order``: draw ``k`` -> position ``k % N_d`` of epoch ``k // N_d`` of dataset ``d``, shuffled
   by shard order and in-window permutation from the seed -> a global sample index.
3. ``dataio.stream.split``: DP rank ``r`` takes positions ``start + r + n*j``; batch ``b`` is ``j`` in
   ``[j0 + b*B, j0 + (b+1)*B)``.
4. ``dataio.stream.sources`` reads the samples by offset, ``dataio.stream.decode`` decodes them (``.npy`` tokens are
   only checked: ``dataio.stream.collate`` copies them straight into the batch; with ``decode.audio: dali``
   ``dataio.stream.dali`` decodes the batch's audio at once), and ``dataio.stream.collate`` makes the plain batch.
5. ``dataio.stream.workers`` computes batches in DataLoader worker processes, read back in batch order.
6. With ``seq_len`` set, the main process feeds the rank's documents to ``dataio.batching.packing`` for THD
   rows (``packing: none``: one document per row; ``greedy`` / ``best_fit``: packed).

So the state is tiny -- the layout (a start position and, rarely, a few skip ranges), the rank-local
position ``j`` the trainer has consumed, the bad-sample count, the seed, and the packer's document
references -- and restoring it in a new process with any ``dp_size`` / ``num_workers`` continues the
stream with nothing lost or repeated (see ``dataio.stream.split`` for the re-layout rule). Memory is bounded
by the index (memory-mapped) plus one shuffle window per worker, independent of the epoch length.

Sample references (``__ref__``, packing ``ref``): ``dataset << 40 | global sample index``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from dataio.stream.blend import BlendSchedule
from dataio.stream.collate import collate
from dataio.config import DataConfig
from configtree import from_dict
from dataio.stream.decode import SampleDecodeError, decode_sample
from dataio.stream.order import EpochOrder
from dataio.stream.seeding import fresh_seed
from dataio.stream.sources import ShardSource
from dataio.stream.split import Layout, relayout
from dataio.stream.workers import RankBatches, iterate

log = logging.getLogger(__name__)

STATE_VERSION = 1
REF_BITS = 40


def make_ref(dataset: int | np.ndarray, index: int | np.ndarray):
    """The int64 reference of sample ``index`` of dataset ``dataset`` (vectorised)."""
    return (np.asarray(dataset, dtype=np.int64) << REF_BITS) | np.asarray(index, dtype=np.int64)


def split_ref(ref: int) -> tuple[int, int]:
    return int(ref) >> REF_BITS, int(ref) & ((1 << REF_BITS) - 1)


def _token_ext(source: ShardSource) -> str | None:
    from dataio.shards.tarscan import is_token_member

    return next((e for e in source.index.extensions if is_token_member(e)), None)


class BatchMaker:
    """Batch ``b`` of one rank's stream; picklable and stateless except for its bad-sample count."""

    def __init__(self, *, cfg: DataConfig, sources: list[ShardSource], blend: BlendSchedule, seed: int,
                 layout: Layout, dp_rank: int, first_local: int, bad_so_far: int):
        self.cfg, self.sources, self.blend, self.layout, self.dp_rank = cfg, sources, blend, layout, dp_rank
        self.first_local, self.batch_size = first_local, cfg.batch_size
        self.local_end = layout.local_count(dp_rank, blend.end)
        self.orders = [EpochOrder(s.shard_starts, s.shard_sizes, seed=seed, dataset=i, shuffle=cfg.shuffle,
                                  window=cfg.shuffle_window) for i, s in enumerate(sources)]
        self.bad = bad_so_far  # this process's count; the main process keeps the rank's total
        self._dali, self._dali_pid = None, None  # decode.audio: dali, see _dali_decoder

    def refs(self, positions: np.ndarray) -> np.ndarray:
        """Sample references at global ``positions``."""
        dataset, draw = self.blend.locate(positions)
        index = np.empty(len(positions), dtype=np.int64)
        for d in np.unique(dataset):
            at = np.flatnonzero(dataset == d)
            epoch, pos = np.divmod(draw[at], len(self.sources[d]))
            for e in np.unique(epoch):
                sel = epoch == e
                index[at[sel]] = self.orders[d].indices(int(e), pos[sel])
        return make_ref(dataset, index)

    def __call__(self, b: int) -> dict:
        """The plain (collated) batch ``b``, with ``__pos__`` (rank-local positions), ``__bad__`` (samples
        skipped while making it) and ``__end__`` (the position after it) for the main process."""
        lo = self.first_local + b * self.batch_size
        hi = lo + self.batch_size if self.local_end is None else min(lo + self.batch_size, self.local_end)
        local = np.arange(lo, max(lo, hi), dtype=np.int64)
        positions = self.layout.positions(self.dp_rank, local)
        keep = ~self.layout.skipped(positions) if self.layout.skips else slice(None)
        local, positions = local[keep], positions[keep]
        refs = self.refs(positions)
        samples, keys, kept, bad = self._read(refs, defer_npy=True)
        valid = torch.ones(len(samples), dtype=torch.bool)
        if not samples:  # a rank left without a sample at the tail: one flagged padding sample
            refs = self.refs(np.array([self.layout.start]))
            samples, keys, kept, _ = self._read(refs, defer_npy=True)
            valid = torch.zeros(len(samples), dtype=torch.bool)
            local = np.full(len(samples), -1)
        batch = collate(samples, keys, torch.from_numpy(refs[kept]), valid, end=max(lo, hi))
        batch["__pos__"] = torch.from_numpy(local[kept])
        batch["__bad__"] = bad
        return batch

    def _read(self, refs: np.ndarray, *, defer_npy: bool = False) -> tuple[list[dict], list[str], np.ndarray, int]:
        """Decoded samples of ``refs`` in order, skipping (and counting) bad ones (``defer_npy``: 1-D
        token arrays as ``NpyView`` for ``dataio.stream.collate`` to copy straight into the batch)."""
        samples, keys, shards, kept, bad = [], [], [], [], 0
        for i, item in enumerate(self._raw(refs)):
            if not isinstance(item, SampleDecodeError):
                key, shard, members = item
                try:
                    samples.append(decode_sample(members, self.cfg.decode, key=key, shard=shard, defer_npy=defer_npy))
                    keys.append(key)
                    shards.append(shard)
                    kept.append(i)
                    continue
                except SampleDecodeError as e:
                    item = e
            self._skip(item)
            bad += 1
        if self.cfg.decode.audio == "dali" and samples:  # the audio decode_sample left raw, per batch
            from dataio.stream.dali import decode_audio_members

            failed = decode_audio_members(self._dali_decoder(), samples, keys, shards)
            for s in sorted(failed):
                self._skip(failed[s])
            if failed:
                bad += len(failed)
                good = [s for s in range(len(samples)) if s not in failed]
                samples, keys, kept = [samples[s] for s in good], [keys[s] for s in good], [kept[s] for s in good]
        return samples, keys, np.asarray(kept, dtype=np.int64), bad

    def _raw(self, refs: np.ndarray) -> list[tuple[str, str, dict] | SampleDecodeError]:
        """``(key, shard, members)`` of each of ``refs``, or the error of an unreadable one."""
        dataset, index = refs >> REF_BITS, refs & ((1 << REF_BITS) - 1)
        raw: list = [None] * len(refs)
        for d in np.unique(dataset):
            at = np.flatnonzero(dataset == d)
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
            raise type(error)(error.reason + budget * bool(self.cfg.max_bad_samples), shard=error.shard,
                              key=error.key, member=error.member) from error
        log.warning("skipping bad sample (%d of max_bad_samples=%d): %s", self.bad, self.cfg.max_bad_samples, error)

    def _dali_decoder(self):
        """This process's ``DaliAudioDecoder``, built on first use (in the worker: a DALI pipeline and
        its threads do not survive a fork, and are never pickled)."""
        if self._dali_pid != os.getpid():
            from dataio.stream.dali import DaliAudioDecoder

            self._dali, self._dali_pid = DaliAudioDecoder(self.cfg.decode), os.getpid()
        return self._dali

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_dali": None, "_dali_pid": None}


class Loader:
    """Iterable of batches for one DP rank; ``state_dict()`` / ``load_state_dict()`` for exact resume."""

    def __init__(self, cfg: DataConfig, *, dp_rank: int, dp_size: int):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_size - 1}")
        self.cfg, self.dp_rank, self.dp_size = cfg, dp_rank, dp_size
        self.sources = [open_source(d) for d in cfg.datasets]
        self.blend = BlendSchedule([d.weight for d in cfg.datasets], [len(s) for s in self.sources],
                                   epochs=cfg.epochs, stop_on_first_exhausted=cfg.stop_on_first_exhausted)
        self.seed = _resolve_seed(cfg.seed, dp_size)
        self.layout = Layout(start=0, dp_size=dp_size)
        self.consumed = 0  # rank-local positions handed to the trainer (or to the packer)
        self.bad_samples = 0
        self.packer = None
        self.packed_batches = 0  # with packing: batches emitted since the stream began (equal on all ranks)
        if cfg.thd:  # THD rows: packed (greedy / best_fit) or one document per row (none)
            from dataio.batching.packing import Packer, PackingConfig

            self.packer = Packer(PackingConfig(seq_len=cfg.seq_len, packing=cfg.packing, pad_id=cfg.pad_id,
                                               packing_buffer=cfg.packing_buffer), rows_per_batch=cfg.batch_size)
            self._token_exts = [_token_ext(s) for s in self.sources]
            if None in self._token_exts:
                bad = cfg.datasets[self._token_exts.index(None)].path
                raise ValueError(f"packing: {cfg.packing} with seq_len: {cfg.seq_len} needs token members (*.npy); "
                                 f"{bad} has none (leave seq_len unset for plain batches)")
        if cfg.bucketing is not None and (len(self.sources) != 1 or self.packer is not None):
            raise ValueError("bucketing: needs exactly one dataset, packing: none and no seq_len (bucketing makes "
                             "the batches)")
        # Bucketing: the epoch, the earlier layouts of this epoch ([dp_size, steps done] each), and the
        # steps of the current plan consumed.
        self.bucket_epoch, self.bucket_history, self.bucket_step = 0, [], 0
        self._fingerprint = self._make_fingerprint()

    # -- iteration -----------------------------------------------------------------------------
    def _batch_maker(self) -> BatchMaker:
        return BatchMaker(cfg=self.cfg, sources=self.sources, blend=self.blend, seed=self.seed, layout=self.layout,
                          dp_rank=self.dp_rank, first_local=self.consumed, bad_so_far=self.bad_samples)

    def _iterate(self, batches: RankBatches, slot_bytes: int = 0) -> Iterator[dict]:
        cfg = self.cfg
        return iterate(batches, num_workers=cfg.num_workers, prefetch=cfg.prefetch, pin_memory=cfg.pin_memory,
                       timeout=cfg.worker_timeout if cfg.num_workers else 0, slot_bytes=slot_bytes,
                       first_here=cfg.decode.audio != "dali")  # a DALI pipeline's threads must not be forked

    @property
    def end(self) -> int | None:
        """The global position where a finite stream (``epochs: N``) ends; None when endless."""
        return self.blend.end

    def __len__(self) -> int:
        """Batches left in a finite stream (``packing: none``); the same on every DP rank."""
        n = self.layout.num_batches(self.end, self.consumed, self.cfg.batch_size)
        if n is None or self.packer is not None:
            raise TypeError("len() of an endless (epochs: null) or packed stream")
        return n

    def __iter__(self) -> Iterator[dict]:
        if self.cfg.bucketing is not None:
            yield from self._iter_bucketed()
            return
        start_pos = int(self.layout.positions(self.dp_rank, np.array([self.consumed]))[0])
        batches = RankBatches(self._batch_maker(), first=0, seed=self.seed, dp_rank=self.dp_rank,
                              last=self.layout.num_batches(self.end, self.consumed, self.cfg.batch_size),
                              epoch=self.blend.epoch_at(start_pos))
        last = None  # the last packed batch: the template of loss-free padding batches at the tail
        for batch in self._iterate(batches, self._slot_bytes()):
            self._count_bad(batch.pop("__bad__"))
            if self.packer is None:
                self.consumed = batch.pop("__end__")
                yield batch
                del batch  # a worker's ring slot comes back once the consumer drops the batch too
            else:
                for packed in self._pack(batch):
                    self.packed_batches += 1
                    last = packed
                    yield packed
        if self.packer is not None:
            self.packer.flush()
            while (packed := self.packer.pop()) is not None:
                last = packed
                self.packed_batches += 1
                yield packed
            yield from self._pad_packed_tail(last)

    def _pad_packed_tail(self, last: dict | None) -> Iterator[dict]:
        """End of a finite packed stream: ranks packed different numbers of batches, so with a process
        group they agree on the most (one all_reduce) and the others add loss-free batches (labels all
        -100, fill 0), so that no rank leaves a collective hanging."""
        dist = torch.distributed
        if self.dp_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return
        most = torch.tensor([self.packed_batches])
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        if int(most) > self.packed_batches and last is None:
            raise RuntimeError(f"DP rank {self.dp_rank} packed no batch at all while others did: too little data "
                               f"for dp_size={self.dp_size}")
        from dataio.batching.packing import IGNORE_INDEX

        for _ in range(int(most) - self.packed_batches):
            self.packed_batches += 1
            yield {**last, "labels": torch.full_like(last["labels"], IGNORE_INDEX), "fill": 0.0, "num_docs": 0,
                   "__docs__": [[] for _ in last["__docs__"]]}

    def _slot_bytes(self) -> int:
        """Shared slot size per batch: twice the mean stored bytes of a batch (decoded tokens take the
        bytes they are stored in), 1 MiB .. 256 MiB; a bigger batch takes the slower default path."""
        mean = max(float(np.mean(s.index.samples["size"])) if len(s) else 0.0 for s in self.sources)
        return int(min(256 << 20, max(1 << 20, 2 * mean * self.cfg.batch_size)))

    def _count_bad(self, bad: int) -> None:
        self.bad_samples += bad
        if self.bad_samples > self.cfg.max_bad_samples:  # the workers' counts together
            raise SampleDecodeError(f"more than max_bad_samples={self.cfg.max_bad_samples} bad samples on DP rank "
                                    f"{self.dp_rank} (see the warnings above for which)")

    def _bucket_plan(self, epoch: int, history: list[list[int]]):
        """This rank's batches of ``epoch``: the plan over the samples the earlier layouts of this
        epoch (``history``: ``[dp_size, steps done]`` each) left, for the current dp_size."""
        from dataio.batching.bucketing import consumed_indices, plan_epoch

        source = self.sources[0]
        indices = np.concatenate([np.arange(a, a + n) for a, n in zip(source.shard_starts, source.shard_sizes)])
        durations = np.asarray(source.index.samples["duration"], dtype=np.float64)
        edges = None
        for dp_size, steps in [*history, [self.dp_size, 0]]:
            plan = plan_epoch(indices, durations[indices], seed=self.seed, epoch=epoch, dp_size=dp_size,
                              cfg=self.cfg.bucketing, edges=edges)
            edges = plan.edges  # the same buckets for the whole epoch
            indices = np.setdiff1d(indices, consumed_indices(plan, steps))
        return plan.rank_batches(self.dp_rank)

    def _iter_bucketed(self) -> Iterator[dict]:
        """Duration-bucketed batches (``dataio.batching.bucketing``), epoch by epoch, each rank-synced."""
        from dataio.batching.bucketing import collate_audio
        from dataio.shards.formats import is_audio_member

        exts = self.sources[0].index.extensions
        audio_ext = next((e for e in exts if is_audio_member(e)), None)
        if audio_ext is None:
            raise ValueError(f"bucketing: {self.cfg.datasets[0].path} has no audio members ({', '.join(exts)})")
        token_ext = _token_ext(self.sources[0])
        maker = self._batch_maker()
        while self.cfg.epochs is None or self.bucket_epoch < self.cfg.epochs:
            batches = self._bucket_plan(self.bucket_epoch, self.bucket_history)

            def make(b: int, batches=batches) -> dict:
                refs = make_ref(0, batches[b])
                samples, keys, kept, bad = maker._read(refs)
                rows = [{"audio": s[audio_ext].waveform, "__key__": k,
                         **({"tokens": s[token_ext]} if token_ext else {}),
                         **({"text": s["json"].get("text")} if isinstance(s.get("json"), dict) else {})}
                        for s, k in zip(samples, keys)]
                return {**collate_audio(rows, tokens_key="tokens" if token_ext else None),
                        "__ref__": torch.from_numpy(refs[kept]), "__bad__": bad}

            stream = self._iterate(RankBatches(make, first=self.bucket_step, last=len(batches), seed=self.seed,
                                               dp_rank=self.dp_rank, epoch=self.bucket_epoch))
            for batch in stream:
                self._count_bad(batch.pop("__bad__"))
                self.bucket_step += 1
                yield batch
            self.bucket_epoch, self.bucket_history, self.bucket_step = self.bucket_epoch + 1, [], 0

    def _pack(self, chunk: dict) -> Iterator[dict]:
        refs, positions = chunk["__ref__"].tolist(), chunk["__pos__"].tolist()
        valid = chunk["__valid__"].tolist()
        docs: dict[str, list] = {}
        for ext in set(self._token_exts):
            lengths = chunk["__lengths__"].get(ext)
            tokens = chunk[ext].clone()  # the packer keeps documents for long: release the worker's ring slot
            docs[ext] = list(torch.split(tokens, lengths.tolist())) if lengths is not None else list(tokens)
        for i, (ref, pos) in enumerate(zip(refs, positions)):
            if not valid[i]:
                continue
            self.packer.push(ref, docs[self._token_exts[ref >> REF_BITS]][i].numpy())
            self.consumed = pos + 1
            while (packed := self.packer.pop()) is not None:
                yield packed
        self.consumed = max(self.consumed, chunk["__end__"])

    def fetch(self, ref: int) -> Any:
        """The decoded token array of document ``ref`` (for the packer's resume)."""
        d, index = split_ref(ref)
        key, shard, members = self.sources[d].read(np.array([index]))[0]
        decoded = decode_sample(members, self.cfg.decode, key=key, shard=shard)
        return decoded[self._token_exts[d]].numpy()

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Positions and counters (JSON-serialisable, a few hundred bytes plus the packer's references)."""
        state = {"version": STATE_VERSION, "fingerprint": self._fingerprint, "seed": self.seed,
                 "dp_rank": self.dp_rank, "dp_size": self.dp_size, "layout": self.layout.to_dict(),
                 "consumed": self.consumed, "bad_samples": self.bad_samples}
        if self.packer is not None:
            state["packing"] = self.packer.state_dict()
            state["packed_batches"] = self.packed_batches
        if self.cfg.bucketing is not None:
            state["bucketing"] = {"epoch": self.bucket_epoch, "history": self.bucket_history, "step": self.bucket_step}
        return state

    def load_state_dict(self, states: dict | list[dict]) -> None:
        """Restore from every old rank's ``state_dict()`` (or just this rank's, same layout)."""
        states = [states] if isinstance(states, dict) else list(states)
        if not states:
            raise ValueError("load_state_dict: no state given")
        for s in states:
            if s.get("version") != STATE_VERSION:
                raise ValueError(f"loader state version {s.get('version')!r}, expected {STATE_VERSION}")
            if s["fingerprint"] != self._fingerprint:
                raise ValueError("loader state comes from other data (datasets, weights, shuffle, shuffle_window "
                                 "or epochs differ); positions would mean other samples")
        old_size = states[0]["dp_size"]
        by_rank = {s["dp_rank"]: s for s in states}
        self.seed = states[0]["seed"]
        if old_size == self.dp_size and self.dp_rank in by_rank:  # same layout: exact continuation
            own = by_rank[self.dp_rank]
            self.layout, self.consumed = Layout.from_dict(own["layout"]), own["consumed"]
            self.bad_samples = own["bad_samples"]
            if self.packer is not None:
                self.packer.load_state_dict(own["packing"], self.fetch)
                self.packed_batches = own["packed_batches"]
            if self.cfg.bucketing is not None:  # the same plan: continue at the step
                b = own["bucketing"]
                self.bucket_epoch, self.bucket_history, self.bucket_step = b["epoch"], b["history"], b["step"]
            return
        if sorted(by_rank) != list(range(old_size)):
            raise ValueError(f"changing dp_size {old_size} -> {self.dp_size} needs the state of every old rank, "
                             f"got ranks {sorted(by_rank)}")
        old = [by_rank[r] for r in range(old_size)]
        self.layout = relayout(Layout.from_dict(old[0]["layout"]), [s["consumed"] for s in old])
        self.layout.dp_size = self.dp_size
        self.consumed = 0
        self.bad_samples = max(s["bad_samples"] for s in old)
        if self.cfg.bucketing is not None:  # re-plan what the old layout left of the epoch
            b = old[0]["bucketing"]
            if any(s["bucketing"] != b for s in old):
                raise ValueError("bucketing states of the old ranks differ (ranks must step together)")
            self.bucket_epoch, self.bucket_step = b["epoch"], 0
            self.bucket_history = [*b["history"], [old_size, b["step"]]]
        if self.packer is not None:
            from dataio.batching.packing import reshard_states

            self.packer.load_state_dict(reshard_states([s["packing"] for s in old], self.dp_rank, self.dp_size),
                                        self.fetch)
            self.packed_batches = max(s["packed_batches"] for s in old)

    def _make_fingerprint(self) -> str:
        what = {"data": [(d.path, d.split, d.weight, len(s)) for d, s in zip(self.cfg.datasets, self.sources)],
                "shuffle": self.cfg.shuffle, "window": self.cfg.shuffle_window, "epochs": self.cfg.epochs,
                "stop_on_first_exhausted": self.cfg.stop_on_first_exhausted}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def open_source(spec) -> ShardSource:
    """The sample source of one ``datasets:`` entry: a headrace-indexed directory or URL, else (see
    ``dataio.stream.interop``) an energon-prepared directory, a Lhotse cuts manifest or a Lhotse Shar directory."""
    from dataio.stream import interop
    from dataio.shards.index import INDEX_DIR

    if "://" in spec.path or (Path(spec.path) / INDEX_DIR).exists():
        return ShardSource(spec.path, split=spec.split)
    if interop.is_lhotse_manifest(spec.path):
        return interop.LhotseCutSource(spec.path)
    if interop.is_energon_dir(spec.path):
        return ShardSource(spec.path, split=spec.split, index=interop.energon_index(spec.path))
    if interop.is_lhotse_shar(spec.path):
        return interop.SharSource(spec.path, split=spec.split)
    return ShardSource(spec.path, split=spec.split)  # raises: no index, with the `dataio index` hint


def _resolve_seed(seed: int | str, dp_size: int) -> int:
    if seed != "randomized":
        return int(seed)
    value = fresh_seed()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)  # every rank must shuffle alike
        value = box[0]
    elif dp_size > 1:
        raise ValueError("seed: randomized with dp_size > 1 needs an initialised process group (to share the seed)")
    log.info("data seed: randomized -> %d (stored in the loader state)", value)
    return value


def build_loader(data_cfg: dict | DataConfig, dp_rank: int | None = None, dp_size: int | None = None) -> Loader:
    """The loader of one DP rank from the ``data:`` section (dict or ``DataConfig``).

    ``dp_rank``/``dp_size`` default to the default process group's rank and world size when
    torch.distributed is initialised (pass them explicitly when TP/PP/CP peers share a DP index)."""
    cfg = from_dict(DataConfig, data_cfg, "data")
    if dp_rank is None or dp_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            dp_rank, dp_size = dist.get_rank(), dist.get_world_size()
        else:
            dp_rank, dp_size = 0, 1
    return Loader(cfg, dp_rank=dp_rank, dp_size=dp_size)


__all__ = ["BatchMaker", "Loader", "build_loader", "make_ref", "split_ref"]
