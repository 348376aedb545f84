"""The packed batching stage (``seq_len`` set): the rank's documents, in stream order, packed into THD
rows by ``headrace.dataio.batching.packing.Packer`` (``packing: none`` puts one document per row).

The stream's plain batches are only chunks of documents here, read in chunks sized for throughput
(``RankStream.read_batch_size``: ~1 MB, at least ``batch_size`` documents), not ``batch_size``: each
document goes into the packer, ``consumed`` moves past it, and full batches of ``batch_size`` rows
come out. The packed stream does not depend on the chunk size (documents enter the packer one by
one in stream order, and the state is per document), so exactly-once and resume are unchanged. At the end of a finite
stream the ranks agree (one all_reduce) on the number of batches and pad with loss-free ones.

Conversations (chat shards: token ids plus a ``trained.npy`` mask) enter the packer with their mask in the
token array and under the ``long_conversations`` rule (``headrace.dataio.batching.conversations``); batches
then carry ``skipped_conversations``, this rank's running count of those left out.

State: ``packing`` (the packer's held document pieces as references, see ``Packer.state_dict``),
``packed_batches`` (batches emitted since the stream began) and ``skipped_conversations``. On resume the
packer re-reads the documents it held (``fetch``); onto another ``dp_size`` the held pieces are dealt
to the new ranks (``reshard_states``).
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch

from headrace.dataio.batching.conversations import conversation_document, fit_conversation
from headrace.dataio.batching.packing import Packer, reshard_states
from headrace.dataio.loader_state import MAX_COUNT, StateError
from headrace.dataio.stream.reading.batches import token_ext
from headrace.dataio.stream.ordering.refs import REF_BITS, split_ref
from headrace.dataio.shards.formats import TRAINED_MASK_MEMBER
from headrace.dataio.stream.reading.decode import decode_sample
from headrace.dataio.usererror import SampleDecodeError
from headrace.dataio.stream.rank import RankStream
from headrace.dataio.stream.ordering.split import same_layout
from headrace.dataio.stagetimes import TIMES, merge_times


class PackedBatches:
    def __init__(self, stream: RankStream):
        cfg = stream.cfg
        self.stream = stream
        self.packed_batches = 0
        self.token_exts = [token_ext(s) for s in stream.sources]
        # conversations' trained-token masks, per dataset (headrace.dataio.batching.conversations)
        self.mask_exts = [
            TRAINED_MASK_MEMBER if TRAINED_MASK_MEMBER in s.index.extensions else None for s in stream.sources
        ]
        self.packer = Packer(cfg.packing_config(), rows_per_batch=cfg.batch_size, masked=any(self.mask_exts))
        self.skipped_conversations = 0  # longer than seq_len under long_conversations: skip
        self.times: dict = {}  # stage seconds of the chunks (and packing) the next packed batch ends
        if None in self.token_exts:
            bad = stream.sources[self.token_exts.index(None)].path  # a leaf, when an entry is a metadataset
            raise ValueError(
                f"packing: {cfg.packing} with seq_len: {cfg.seq_len} needs token members (*.npy); "
                f"{bad} has none (leave seq_len unset for plain batches)"
            )

    def __iter__(self) -> Iterator[dict]:
        for chunk in self.stream.plain(self.stream.read_batch_size()):
            for packed in self._pack(chunk):
                self.packed_batches += 1
                yield packed
        self.packer.flush()
        while (packed := self.packer.pop()) is not None:
            self.packed_batches += 1
            yield self._with_counts(packed)

    def padding_batch(self) -> dict:
        """One batch of padding rows only (``Packer.empty_batch``), for ``even_batches``'s ``empty``."""
        return self.packer.empty_batch()

    def _pack(self, chunk: dict) -> Iterator[dict]:
        """The packed batches ``chunk``'s documents complete; each carries the stage seconds since the last one
        (``headrace.dataio.stagetimes``: its chunks' read / decode / collate and the packing)."""
        start = time.perf_counter()
        merge_times(self.times, chunk.get(TIMES))
        for packed in self._pack_chunk(chunk):
            now = time.perf_counter()
            self.times["pack"] = self.times.get("pack", 0.0) + now - start
            packed[TIMES], self.times = self.times, {}
            yield packed
            start = time.perf_counter()
        self.times["pack"] = self.times.get("pack", 0.0) + time.perf_counter() - start

    def _pack_chunk(self, chunk: dict) -> Iterator[dict]:
        stream = self.stream
        refs, positions = chunk["__ref__"].tolist(), chunk["__pos__"].tolist()
        valid = chunk["__valid__"].tolist()
        docs: dict[str, list] = {}
        # only the members the chunk holds: a chunk whose samples were all bad (skipped, counted) holds none
        for ext in set(self.token_exts + self.mask_exts) & chunk.keys():
            lengths = chunk["__lengths__"].get(ext)
            tokens = chunk[ext].clone()  # the packer keeps documents for long: release the worker's ring bytes
            docs[ext] = list(torch.split(tokens, lengths.tolist())) if lengths is not None else list(tokens)
        for i, (ref, pos) in enumerate(zip(refs, positions)):
            if not valid[i]:
                continue
            d = ref >> REF_BITS
            tokens = docs[self.token_exts[d]][i].numpy()
            if self.mask_exts[d] is not None:
                tokens = self._conversation(d, chunk["__key__"][i], tokens, docs[self.mask_exts[d]][i].numpy())
            if tokens is None:
                self.skipped_conversations += 1
            else:
                self.packer.push(ref, tokens)
            stream.consumed = pos + 1
            while (packed := self.packer.pop()) is not None:
                yield self._with_counts(packed)
        stream.consumed = max(stream.consumed, chunk["__end__"])

    def _conversation(self, d: int, key: str, tokens: np.ndarray, trained: np.ndarray) -> np.ndarray | None:
        """A conversation of dataset ``d`` as the packer's document, or None to skip it (``long_conversations``)."""
        cfg, where = self.stream.cfg, {"shard": self.stream.sources[d].path, "key": key}
        try:
            doc = conversation_document(tokens, trained)
        except ValueError as e:
            raise SampleDecodeError(str(e), member=TRAINED_MASK_MEMBER, **where) from None
        fitted = fit_conversation(doc, cfg.seq_len, cfg.long_conversations)
        if fitted is None and cfg.long_conversations == "error":
            raise SampleDecodeError(
                f"conversation of {len(doc)} tokens is longer than seq_len {cfg.seq_len} "
                "(data.long_conversations: skip or truncate, or a longer seq_len)",
                **where,
            )
        return fitted

    def _with_counts(self, packed: dict) -> dict:
        if self.packer.masked:
            packed["skipped_conversations"] = self.skipped_conversations
        return packed

    def fetch(self, ref: int) -> np.ndarray:
        """The decoded token array of document ``ref`` (for the packer's resume)."""
        d, index = split_ref(ref) if isinstance(ref, int) and 0 <= ref < MAX_COUNT else (-1, -1)
        if not (0 <= d < len(self.stream.sources) and 0 <= index < len(self.stream.sources[d].index.samples)):
            raise StateError(f"packing state: document {ref!r} is not a sample of this data")
        key, shard, members = self.stream.sources[d].read(np.array([index]))[0]
        decoded = decode_sample(members, self.stream.cfg.decode, key=key, shard=shard)
        tokens = decoded[self.token_exts[d]].numpy()
        if self.mask_exts[d] is None:
            return tokens
        doc = self._conversation(d, key, tokens, decoded[self.mask_exts[d]].numpy())
        if doc is None:
            raise StateError(f"packing state: document {ref!r} is a conversation the packer skips (different data?)")
        return doc

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "packing": self.packer.state_dict(),
            "packed_batches": self.packed_batches,
            "skipped_conversations": self.skipped_conversations,
        }

    def load_state_dict(self, old: list[dict | None], dp_rank: int, dp_size: int) -> None:
        for s in old:
            if s is not None and not (
                isinstance(s.get("packed_batches"), int) and 0 <= s["packed_batches"] < MAX_COUNT
            ):
                raise StateError(
                    f"loader state of rank {s['dp_rank']}: 'packed_batches' must be a non-negative "
                    f"integer below 2**62, got {s.get('packed_batches')!r}"
                )
        skipped = [s.get("skipped_conversations", 0) for s in old if s is not None]
        if same_layout(old, dp_rank, dp_size):
            self.packer.load_state_dict(old[dp_rank]["packing"], self.fetch)
            self.packed_batches = old[dp_rank]["packed_batches"]
            self.skipped_conversations = old[dp_rank].get("skipped_conversations", 0)
            return
        self.packer.load_state_dict(reshard_states([s["packing"] for s in old], dp_rank, dp_size), self.fetch)
        self.packed_batches = max(s["packed_batches"] for s in old)
        self.skipped_conversations = sum(skipped) if dp_rank == 0 else 0  # a sum over ranks stays right


__all__ = ["PackedBatches"]
