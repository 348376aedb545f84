"""Packing token documents into rows of ``seq_len`` tokens: the THD layout of flash-attention varlen.

A ``Packer`` is the stage after the per-rank sample stream. It is fed ``(ref, tokens)`` pairs, where
``ref`` is the document's global sample index, and emits batches of ``rows_per_batch`` rows:

- ``input_ids`` / ``labels`` / ``position_ids``: int64 ``(rows, seq_len)``; flatten with ``.view(-1)``
  (or ``.view(1, -1)``) for a THD kernel. ``labels`` is the next token, -100 where the next token
  belongs to another document, is padding, or is not trained (a conversation's, ``masked``). The last token of a piece of a split document is
  labelled with the document's real next token (it sits at the head of the next piece).
- ``cu_seqlens`` (int32) over the flattened micro-batch: one segment per document piece and one per
  row's padding tail, so it always ends at ``rows * seq_len`` and no segment crosses a row.
  ``position_ids`` restart at 0 at every segment; ``max_seqlen`` is the longest segment.
- ``fill`` (non-pad tokens / capacity), ``num_docs`` (document pieces) and ``__docs__`` (per row, the
  ``(ref, offset, length)`` of each piece) for telemetry and debugging.

Algorithms (``packing:``):

- ``none``: one document per row, padded. Simple; fill is mean_len / seq_len (~30% on web text).
- ``greedy``: first-fit over the ``open_rows`` most recent rows; when a piece fits none of them the
  oldest row is closed. O(open_rows) per piece, no look-ahead (torchtitan's scheme uses 8 rows).
- ``best_fit``: best-fit decreasing over a look-ahead buffer of ``packing_buffer`` pieces. Whenever
  the buffer overflows, one row is built: it opens with the longest buffered piece (the oldest of
  equal lengths) and then repeatedly takes the longest piece that still fits the space left (the
  best fit for that gap) until nothing fits. With B = 10,000 on a long-tailed corpus the gaps close
  to a few tokens (>= 99.9% fill, see BENCHMARKS.md). The cost is latency: short documents may wait
  in the buffer for a while.

  The buffer is bucketed by length: a piece is shorter than ``seq_len``, so the buffer is one FIFO
  (oldest first) per length plus the sorted list of lengths that have a piece. Adding a piece is an
  O(1) append (plus a sorted insert into the length list when its bucket was empty); "the longest
  piece <= gap" is one C ``bisect`` over the length list and an O(1) ``popleft``. The length list
  holds at most min(B, seq_len) entries and changes only when a bucket fills or empties, so the
  per-document cost no longer grows with B (a list of B sorted keys paid an O(B) shift per insert
  and per removal).

Batches are assembled with whole-array operations: ``input_ids`` is one ``np.concatenate`` of the
pieces' slices and the rows' padding, ``labels`` is ``input_ids`` shifted by one with each piece's
last label (the split document's next token, or -100) and the padding scattered in, ``position_ids``
comes from the segment starts; the Python work per batch is O(pieces), not O(tokens).

A document longer than ``seq_len`` is cut into full rows plus one remainder piece, which is packed
like any document; a document that fits in a row is never split, and nothing is truncated or dropped.
Everything is deterministic in the input order.

Resume: ``state_dict()`` holds only ``(ref, offset, length)`` of the pieces waiting in the packer
(closed rows not yet emitted, open rows, the buffer) plus counters, never tokens;
``load_state_dict(state, fetch)`` re-reads those documents with ``fetch(ref)`` and continues
exactly. The buffered pieces' state entries are built once, when a piece enters the buffer, so
``state_dict()`` is a C-level copy of B references, cheap enough to call after every batch (the
returned lists share those entries, which are never modified). Elastic resume (a different
dp_size): ``reshard_states(old_states, dp_rank, dp_size)`` takes the union of every old rank's
pieces and deals whole documents round-robin (sorted by ref) to the new ranks, so nothing is lost or
repeated; the pieces are re-packed on load. The loader counts those documents as consumed from its
sample stream.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np
import torch

from headrace.dataio.batching.conversations import split_untrained
from headrace.dataio.config import PACKING_ALGORITHMS, PackingConfig
from headrace.kernels.loss import IGNORE_INDEX  # labels where no loss is taken: the loss kernels' convention

STATE_VERSION = 1
_bucket_entries = operator.itemgetter(0)  # of a best_fit bucket (state entries, pieces)


class Piece(NamedTuple):
    """``doc[offset : offset + length]`` of document ``ref``; ``doc`` is the whole token array."""

    ref: int
    offset: int
    length: int
    doc: np.ndarray


@dataclass(kw_only=True)
class FillTotals:
    """Running totals since the start of training (they survive resume)."""

    batches: int = 0
    rows: int = 0
    tokens: int = 0  # non-pad tokens emitted
    capacity: int = 0  # rows * seq_len emitted
    docs: int = 0  # document pieces emitted
    split_docs: int = 0  # documents longer than seq_len (cut into pieces)
    empty_docs: int = 0  # zero-length documents seen (nothing to pack)

    @property
    def fill(self) -> float:
        return self.tokens / self.capacity if self.capacity else 0.0


class Packer:
    """Packs a document stream into THD batches; see the module docstring.

    Feed it with ``push(ref, tokens)`` and drain it with ``pop()`` after every push (one push may make
    several batches ready); at the end of a finite stream call ``flush()`` and drain again (the last
    batch is padded with empty rows so every batch has the same shape)::

        for ref, tokens in stream:
            packer.push(ref, tokens)
            while (batch := packer.pop()) is not None:
                yield batch
    """

    def __init__(self, cfg: PackingConfig, *, rows_per_batch: int, masked: bool = False):
        if rows_per_batch < 1:
            raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
        self.cfg = cfg
        self.rows_per_batch = rows_per_batch
        # documents may carry untrained tokens (conversations: headrace.dataio.batching.conversations)
        self.masked = masked
        # batch assembly slices these: a row's padding tail, a segment's position_ids
        self._pad_row = np.full(cfg.seq_len, cfg.pad_id, dtype=np.int64)
        self._positions = np.arange(cfg.seq_len, dtype=np.int64)
        self._reset()

    def _reset(self) -> None:
        self.totals = FillTotals()
        self._ready: deque[list[Piece]] = deque()  # closed rows, in emission order
        self._open: list[list[Piece]] = []  # greedy
        self._open_used: list[int] = []
        # best_fit buffer: per length, the state entries [ref, offset, length, arrival] and the pieces,
        # oldest first (two parallel deques, so state_dict() copies entries without touching pieces);
        # _lengths: the lengths with a non-empty bucket, ascending
        self._buckets: dict[int, tuple[deque[list[int]], deque[Piece]]] = {}
        self._lengths: list[int] = []
        self._buffered = 0
        self._arrival = 0
        self._flushed = False

    # -- feeding -------------------------------------------------------------------------------
    def push(self, ref: int, tokens) -> None:
        """Add document ``ref`` (a 1-D integer array of token ids)."""
        doc = np.asarray(tokens)
        if doc.ndim != 1 or doc.dtype.kind not in "iu":
            raise ValueError(
                f"document {ref}: expected a 1-D integer token array, got {doc.dtype} of shape {doc.shape}"
            )
        if self._flushed:
            raise RuntimeError("Packer.push after flush(): the stream has ended")
        if len(doc) == 0:
            self.totals.empty_docs += 1
            return
        if len(doc) > self.cfg.seq_len:
            self.totals.split_docs += 1
        self._admit(int(ref), doc, 0, len(doc))

    def flush(self) -> None:
        """End of the stream: close every open row and empty the buffer into rows."""
        while self._open:
            self._close_open_row(0)
        while self._buffered:
            self._ready.append(self._build_best_fit_row())
        self._flushed = True

    def pop(self) -> dict | None:
        """The next full batch, or None if not enough rows are closed yet (after ``flush``: the
        remaining rows, padded with empty rows, until none is left)."""
        if len(self._ready) < self.rows_per_batch and not (self._flushed and self._ready):
            return None
        rows = [self._ready.popleft() for _ in range(min(self.rows_per_batch, len(self._ready)))]
        return self._materialize(rows)

    def empty_batch(self) -> dict:
        """A batch of padding rows only (labels all ignored, no document), outside the totals: what a rank whose
        share of a finite stream was empty runs while the others still have batches."""
        totals = dataclasses.replace(self.totals)
        batch = self._materialize([])
        self.totals = totals
        return batch

    # -- placement -----------------------------------------------------------------------------
    def _admit(self, ref: int, doc: np.ndarray, offset: int, length: int) -> None:
        """Cut ``doc[offset:offset+length]`` into full rows plus a remainder and place each piece."""
        seq_len = self.cfg.seq_len
        while length >= seq_len:
            self._ready.append([Piece(ref, offset, seq_len, doc)])
            offset += seq_len
            length -= seq_len
        if length:
            self._place(Piece(ref, offset, length, doc))

    def _place(self, piece: Piece) -> None:
        if self.cfg.packing == "none":
            self._ready.append([piece])
        elif self.cfg.packing == "greedy":
            self._place_first_fit(piece)
        else:
            self._insert_buffer(piece, self._arrival)
            self._arrival += 1
            if self._buffered > self.cfg.packing_buffer:
                self._ready.append(self._build_best_fit_row())

    def _place_first_fit(self, piece: Piece) -> None:
        seq_len = self.cfg.seq_len
        for i, used in enumerate(self._open_used):
            if used + piece.length <= seq_len:
                self._open[i].append(piece)
                self._open_used[i] = used + piece.length
                if self._open_used[i] == seq_len:
                    self._close_open_row(i)
                return
        if len(self._open) >= self.cfg.open_rows:
            self._close_open_row(0)
        self._open.append([piece])
        self._open_used.append(piece.length)

    def _close_open_row(self, i: int) -> None:
        self._ready.append(self._open.pop(i))
        self._open_used.pop(i)

    def _insert_buffer(self, piece: Piece, arrival: int) -> None:
        """Append ``piece`` to its length's bucket; arrivals must come in increasing order per length."""
        bucket = self._buckets.get(piece.length)
        if bucket is None:
            bucket = self._buckets[piece.length] = (deque(), deque())
            bisect.insort(self._lengths, piece.length)
        entries, pieces = bucket
        entries.append([piece.ref, piece.offset, piece.length, arrival])
        pieces.append(piece)
        self._buffered += 1

    def _take_buffered(self, i: int) -> Piece:
        """Remove and return the oldest piece of the ``i``-th shortest buffered length."""
        length = self._lengths[i]
        entries, pieces = self._buckets[length]
        entries.popleft()
        piece = pieces.popleft()
        if not pieces:
            del self._buckets[length]
            del self._lengths[i]
        self._buffered -= 1
        return piece

    def _build_best_fit_row(self) -> list[Piece]:
        row = [self._take_buffered(-1)]  # the longest piece opens the row
        gap = self.cfg.seq_len - row[0].length
        while gap and self._lengths:
            i = bisect.bisect_right(self._lengths, gap) - 1  # the longest length <= gap
            if i < 0:
                break
            piece = self._take_buffered(i)
            row.append(piece)
            gap -= piece.length
        return row

    # -- output --------------------------------------------------------------------------------
    def _materialize(self, rows: list[list[Piece]]) -> dict:
        seq_len, n_rows = self.cfg.seq_len, self.rows_per_batch
        parts: list[np.ndarray] = []  # every piece's tokens and every row's padding, in order
        segments: list[int] = []
        last_labels: list[int] = []  # per segment: the label of its last token
        pads: list[tuple[int, int]] = []  # (start, end) of each row's padding tail
        docs: list[list[tuple[int, int, int]]] = []
        tokens = num_docs = 0
        for r in range(n_rows):
            row = rows[r] if r < len(rows) else []
            used = 0
            for _, offset, length, doc in row:
                end = offset + length
                parts.append(doc[offset:end])
                segments.append(length)
                # a split document's last piece-token is labelled with its real next token
                last_labels.append(int(doc[end]) if end < len(doc) else IGNORE_INDEX)
                used += length
            if used < seq_len:
                parts.append(self._pad_row[used:])
                segments.append(seq_len - used)
                last_labels.append(IGNORE_INDEX)
                pads.append((r * seq_len + used, (r + 1) * seq_len))
            tokens += used
            num_docs += len(row)
            docs.append([(p.ref, p.offset, p.length) for p in row])
        input_ids = np.concatenate(parts, dtype=np.int64, casting="unsafe")
        seg = np.asarray(segments, dtype=np.int64)
        ends = np.cumsum(seg)
        labels = np.empty_like(input_ids)
        labels[:-1] = input_ids[1:]
        labels[ends - 1] = last_labels
        if self.masked:
            split_untrained(input_ids, labels)
        for start, end in pads:
            labels[start:end] = IGNORE_INDEX
        position_ids = np.concatenate([self._positions[:n] for n in segments])
        cu_seqlens = np.zeros(len(seg) + 1, dtype=np.int32)
        cu_seqlens[1:] = ends
        capacity = n_rows * seq_len
        t = self.totals
        t.batches += 1
        t.rows += n_rows
        t.tokens += tokens
        t.capacity += capacity
        t.docs += num_docs
        shape = (n_rows, seq_len)
        return {
            "input_ids": torch.from_numpy(input_ids).view(shape),
            "labels": torch.from_numpy(labels).view(shape),
            "position_ids": torch.from_numpy(position_ids).view(shape),
            "cu_seqlens": torch.from_numpy(cu_seqlens),
            "max_seqlen": int(seg.max()),
            "fill": tokens / capacity,
            "num_docs": num_docs,
            "__docs__": docs,
        }

    # -- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Document references of every piece held, plus counters; no tokens (JSON-serialisable)."""

        def refs(row):
            return [[p.ref, p.offset, p.length] for p in row]

        return {
            "version": STATE_VERSION,
            "seq_len": self.cfg.seq_len,
            "packing": self.cfg.packing,
            "ready": [refs(row) for row in self._ready],
            "open": [refs(row) for row in self._open],
            # by length, newest first among equal lengths (the order of the version-1 format)
            "buffer": list(
                itertools.chain.from_iterable(
                    map(reversed, map(_bucket_entries, map(self._buckets.__getitem__, self._lengths)))
                )
            ),
            "pending": [],
            "next_arrival": self._arrival,
            "flushed": self._flushed,
            "totals": dataclasses.asdict(self.totals),
        }

    def load_state_dict(self, state: dict, fetch: Callable[[int], np.ndarray]) -> None:
        """Restore from ``state_dict()`` (or ``reshard_states``); ``fetch(ref)`` returns the tokens of
        document ``ref``. Same seq_len and algorithm: exact continuation. Otherwise every held piece
        is re-packed under the new settings (nothing lost)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"packing state version {state.get('version')!r}, expected {STATE_VERSION}")
        self._reset()
        self.totals = FillTotals(**state["totals"])
        docs: dict[int, np.ndarray] = {}

        def piece(ref, offset, length) -> Piece:
            if ref not in docs:
                docs[ref] = np.asarray(fetch(ref))
            doc = docs[ref]
            if offset + length > len(doc):
                raise ValueError(
                    f"packing state: document {ref} has {len(doc)} tokens, the state "
                    f"holds a piece at {offset}..{offset + length} (different data?)"
                )
            return Piece(ref, offset, length, doc)

        same = state["seq_len"] == self.cfg.seq_len and state["packing"] == self.cfg.packing
        if same:
            self._ready.extend([piece(*p) for p in row] for row in state["ready"])
            for row in state["open"]:
                self._open.append([piece(*p) for p in row])
                self._open_used.append(sum(p[2] for p in row))
            for ref, offset, length, arrival in sorted(state["buffer"], key=lambda b: b[3]):
                self._insert_buffer(piece(ref, offset, length), arrival)
            self._arrival = state["next_arrival"]
            pending = state["pending"]
        else:
            pending = _all_pieces(state)
        for ref, offset, length in pending:
            p = piece(ref, offset, length)
            self._admit(p.ref, p.doc, p.offset, p.length)
        self._flushed = state["flushed"]


def _all_pieces(state: dict) -> list[list[int]]:
    rows = state["ready"] + state["open"] + [[b[:3] for b in state["buffer"]], state["pending"]]
    return [list(p) for row in rows for p in row]


def reshard_states(states: list[dict], dp_rank: int, dp_size: int) -> dict:
    """The packing state of new DP rank ``dp_rank`` of ``dp_size`` from every old rank's state.

    Same layout (``len(states) == dp_size``): that rank's own state, for an exact continuation.
    Otherwise the union of all held pieces, whole documents dealt round-robin in ``ref`` order, as
    ``pending`` pieces re-packed on load; the summed running totals go to rank 0 (so a sum over
    ranks stays right)."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_size - 1}")
    if len(states) == dp_size:
        return states[dp_rank]
    pieces = sorted(tuple(p) for s in states for p in _all_pieces(s))
    refs = sorted({p[0] for p in pieces})
    mine = set(refs[dp_rank::dp_size])
    totals = FillTotals()
    if dp_rank == 0:
        for s in states:
            for k, v in s["totals"].items():
                setattr(totals, k, getattr(totals, k) + v)
    first = states[0]
    return {
        "version": STATE_VERSION,
        "seq_len": first["seq_len"],
        "packing": first["packing"],
        "ready": [],
        "open": [],
        "buffer": [],
        "pending": [list(p) for p in pieces if p[0] in mine],
        "next_arrival": 0,
        "flushed": all(s["flushed"] for s in states),
        "totals": dataclasses.asdict(totals),
    }


def pack(documents: Iterable[tuple[int, np.ndarray]], packer: Packer) -> Iterator[dict]:
    """Generator stage: batches of ``packer`` over a finite ``(ref, tokens)`` stream, flushed at the end."""
    for ref, tokens in documents:
        packer.push(ref, tokens)
        while (batch := packer.pop()) is not None:
            yield batch
    packer.flush()
    while (batch := packer.pop()) is not None:
        yield batch


__all__ = [
    "PACKING_ALGORITHMS",
    "IGNORE_INDEX",
    "FillTotals",
    "Packer",
    "PackingConfig",
    "Piece",
    "pack",
    "reshard_states",
]
