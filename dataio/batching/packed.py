"""The packed batching stage (``seq_len`` set): the rank's documents, in stream order, packed into THD
rows by ``headrace.dataio.batching.packing.Packer`` (``packing: none`` puts one document per row).

The stream's plain batches are only chunks of documents here, read in chunks sized for throughput
(``RankStream.read_batch_size``: ~1 MB, at least ``batch_size`` documents), not ``batch_size``: each
document goes into the packer, ``consumed`` moves past it, and full batches of ``batch_size`` rows
come out. The packed stream does not depend on the chunk size (documents enter the packer one by
one in stream order, and the state is per document), so exactly-once and resume are unchanged. At the end of a finite
stream the ranks agree (one all_reduce) on the number of batches and pad with loss-free ones.

State: ``packing`` (the packer's held document pieces as references, see ``Packer.state_dict``) and
``packed_batches`` (batches emitted since the stream began). On resume the
packer re-reads the documents it held (``fetch``); onto another ``dp_size`` the held pieces are dealt
to the new ranks (``reshard_states``).
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch

from headrace.dataio.batching.packing import Packer, reshard_states
from headrace.dataio.loader_state import MAX_COUNT, StateError
from headrace.dataio.stream.batches import token_ext
from headrace.dataio.stream.refs import REF_BITS, split_ref
from headrace.dataio.stream.decode import decode_sample
from headrace.dataio.stream.rank import RankStream
from headrace.dataio.stream.split import same_layout
from headrace.dataio.stagetimes import TIMES, merge_times


class PackedBatches:
    def __init__(self, stream: RankStream):
        cfg = stream.cfg
        self.stream = stream
        self.packer = Packer(cfg.packing_config(), rows_per_batch=cfg.batch_size)
        self.packed_batches = 0
        self.token_exts = [token_ext(s) for s in stream.sources]
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
            yield packed

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
        for ext in set(self.token_exts) & chunk.keys():
            lengths = chunk["__lengths__"].get(ext)
            tokens = chunk[ext].clone()  # the packer keeps documents for long: release the worker's ring bytes
            docs[ext] = list(torch.split(tokens, lengths.tolist())) if lengths is not None else list(tokens)
        for i, (ref, pos) in enumerate(zip(refs, positions)):
            if not valid[i]:
                continue
            self.packer.push(ref, docs[self.token_exts[ref >> REF_BITS]][i].numpy())
            stream.consumed = pos + 1
            while (packed := self.packer.pop()) is not None:
                yield packed
        stream.consumed = max(stream.consumed, chunk["__end__"])

    def fetch(self, ref: int) -> np.ndarray:
        """The decoded token array of document ``ref`` (for the packer's resume)."""
        d, index = split_ref(ref) if isinstance(ref, int) and 0 <= ref < MAX_COUNT else (-1, -1)
        if not (0 <= d < len(self.stream.sources) and 0 <= index < len(self.stream.sources[d].index.samples)):
            raise StateError(f"packing state: document {ref!r} is not a sample of this data")
        key, shard, members = self.stream.sources[d].read(np.array([index]))[0]
        decoded = decode_sample(members, self.stream.cfg.decode, key=key, shard=shard)
        return decoded[self.token_exts[d]].numpy()

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"packing": self.packer.state_dict(), "packed_batches": self.packed_batches}

    def load_state_dict(self, old: list[dict | None], dp_rank: int, dp_size: int) -> None:
        for s in old:
            if s is not None and not (
                isinstance(s.get("packed_batches"), int) and 0 <= s["packed_batches"] < MAX_COUNT
            ):
                raise StateError(
                    f"loader state of rank {s['dp_rank']}: 'packed_batches' must be a non-negative "
                    f"integer below 2**62, got {s.get('packed_batches')!r}"
                )
        if same_layout(old, dp_rank, dp_size):
            self.packer.load_state_dict(old[dp_rank]["packing"], self.fetch)
            self.packed_batches = old[dp_rank]["packed_batches"]
            return
        self.packer.load_state_dict(reshard_states([s["packing"] for s in old], dp_rank, dp_size), self.fetch)
        self.packed_batches = max(s["packed_batches"] for s in old)


__all__ = ["PackedBatches"]
