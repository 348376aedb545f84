"""Property tests of headrace.dataio.batching.packing: the THD batch invariants, splitting, determinism, exact resume."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headrace.dataio.batching.packing import IGNORE_INDEX, Packer, pack, reshard_states
from headrace.dataio.config import PackingConfig

ALGOS = ["none", "greedy", "best_fit"]


def make_docs(lengths):
    """Documents whose token ids encode (document, position) so any misplacement is visible."""
    return {ref: (np.arange(n, dtype=np.int64) + 1000 * ref).astype(np.int32) for ref, n in enumerate(lengths)}


def run(docs, algo, seq_len, rows, buffer=4):
    packer = Packer(
        PackingConfig(seq_len=seq_len, packing=algo, packing_buffer=buffer, open_rows=3), rows_per_batch=rows
    )
    return list(pack(docs.items(), packer)), packer


def check_batch(batch, seq_len, rows):
    ids, labels, pos = (batch[k].reshape(-1) for k in ("input_ids", "labels", "position_ids"))
    cu = batch["cu_seqlens"]
    assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == rows * seq_len
    seg = (cu[1:] - cu[:-1]).long()
    assert (seg > 0).all() and batch["max_seqlen"] == int(seg.max())
    # no segment crosses a row boundary
    row_of_start, row_of_end = cu[:-1].long() // seq_len, (cu[1:].long() - 1) // seq_len
    assert torch.equal(row_of_start, row_of_end)
    # position_ids restart at 0 at each segment and count up
    starts = torch.repeat_interleave(cu[:-1].long(), seg)
    assert torch.equal(pos, torch.arange(rows * seq_len) - starts)
    # labels: next token inside a segment; at a segment end only a split document's true next token
    seg_id = torch.repeat_interleave(torch.arange(len(seg)), seg)
    same_seg_next = torch.zeros_like(labels, dtype=torch.bool)
    same_seg_next[:-1] = seg_id[1:] == seg_id[:-1]
    inside = same_seg_next & (labels != IGNORE_INDEX)
    assert torch.equal(labels[inside], ids[1:][inside[:-1]])
    # an attention mask from cu_seqlens: token i may see j iff same segment and j <= i; it never sees
    # another document (ids encode the document as id // 1000)
    mask = (seg_id[:, None] == seg_id[None, :]) & torch.tril(torch.ones(len(ids), len(ids), dtype=torch.bool))
    real = labels.new_zeros(len(ids), dtype=torch.bool)
    for r, row in enumerate(batch["__docs__"]):
        at = r * seq_len
        for ref, offset, length in row:
            assert torch.equal(ids[at : at + length] // 1000, torch.full((length,), ref))
            real[at : at + length] = True
            at += length
    doc_of = ids // 1000
    crossing = mask & real[:, None] & real[None, :] & (doc_of[:, None] != doc_of[None, :])
    assert not crossing.any()
    assert batch["fill"] == pytest.approx(int(real.sum()) / (rows * seq_len))
    assert batch["num_docs"] == sum(len(r) for r in batch["__docs__"])


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 70), min_size=1, max_size=30),
    algo=st.sampled_from(ALGOS),
    seq_len=st.integers(2, 24),
    rows=st.integers(1, 3),
    buffer=st.integers(1, 6),
)
def test_every_token_once_and_batch_invariants(lengths, algo, seq_len, rows, buffer):
    docs = make_docs(lengths)
    batches, packer = run(docs, algo, seq_len, rows, buffer)
    seen = {ref: [] for ref in docs}
    for batch in batches:
        assert batch["input_ids"].shape == (rows, seq_len)
        check_batch(batch, seq_len, rows)
        for r, row in enumerate(batch["__docs__"]):
            at = r * seq_len
            for ref, offset, length in row:
                seen[ref].append(
                    (
                        offset,
                        batch["input_ids"].reshape(-1)[at : at + length].numpy(),
                        batch["labels"].reshape(-1)[at : at + length].numpy(),
                    )
                )
                at += length
    for ref, doc in docs.items():
        pieces = sorted(seen[ref], key=lambda p: p[0])
        # split documents reassemble exactly; every token appears once
        got = np.concatenate([p[1] for p in pieces]) if pieces else np.zeros(0)
        assert np.array_equal(got, doc)
        # labels reassemble into the document shifted by one, -100 only after its last token
        lab = np.concatenate([p[2] for p in pieces]) if pieces else np.zeros(0)
        assert np.array_equal(lab, np.append(doc[1:], IGNORE_INDEX)[: len(doc)])
        if len(doc) <= seq_len:  # a document that fits is never split
            assert len(pieces) == (1 if len(doc) else 0)
        else:  # full rows plus at most one remainder
            assert [len(p[1]) for p in pieces].count(seq_len) == len(doc) // seq_len
    t = packer.totals
    assert t.tokens == sum(lengths) and t.split_docs == sum(n > seq_len for n in lengths)
    assert t.empty_docs == lengths.count(0)


def test_deterministic_and_algorithms_rank_by_fill():
    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.lognormal(np.log(60), 1.2, 400).astype(int) + 1, 2000)
    docs = make_docs(lengths)
    fills = {}
    for algo in ALGOS:
        a, pa = run(docs, algo, 256, 1, buffer=64)
        b, _ = run(docs, algo, 256, 1, buffer=64)
        assert [x["__docs__"] for x in a] == [x["__docs__"] for x in b]
        fills[algo] = pa.totals.fill
    assert fills["none"] < fills["greedy"] < fills["best_fit"]


def test_best_fit_closes_gaps():
    # rows of 8: each row opens with the longest piece (oldest first among equals) and takes the
    # longest piece that fits its gap, so 6+2, 6+2, 5+3 fill every row exactly
    docs = make_docs([6, 5, 6, 3, 2, 2])
    batches, packer = run(docs, "best_fit", 8, 1, buffer=10)
    rows = [[ref for ref, _, _ in b["__docs__"][0]] for b in batches]
    assert rows == [[0, 4], [2, 5], [1, 3]]
    assert packer.totals.fill == 1.0


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=2, max_size=40),
    algo=st.sampled_from(ALGOS),
    cut=st.integers(0, 40),
    rows=st.integers(1, 3),
)
def test_state_round_trip_mid_stream(lengths, algo, cut, rows):
    docs = make_docs(lengths)
    cfg = PackingConfig(seq_len=16, packing=algo, packing_buffer=5, open_rows=2)
    reference = Packer(cfg, rows_per_batch=rows)
    straight = list(pack(docs.items(), reference))

    cut = min(cut, len(lengths))
    first = Packer(cfg, rows_per_batch=rows)
    head = []
    items = list(docs.items())
    for ref, tokens in items[:cut]:
        first.push(ref, tokens)
        while (b := first.pop()) is not None:
            head.append(b)
    state = json.loads(json.dumps(first.state_dict()))  # plain data: no tokens, no arrays
    fetched = []
    resumed = Packer(cfg, rows_per_batch=rows)
    resumed.load_state_dict(state, lambda ref: fetched.append(ref) or docs[ref])
    tail = list(pack(items[cut:], resumed))
    got = head + tail
    assert len(got) == len(straight)
    for x, y in zip(got, straight):
        for k in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(x[k], y[k])
        assert x["__docs__"] == y["__docs__"]
    assert resumed.totals == reference.totals  # running telemetry survives the restart
    assert len(fetched) == len(set(fetched))  # each buffered document read once


@pytest.mark.parametrize("old,new", [(4, 2), (2, 3), (3, 1)])
def test_elastic_reshard_loses_nothing(old, new):
    rng = np.random.default_rng(old * 10 + new)
    lengths = rng.integers(1, 50, 60)
    docs = make_docs(lengths)
    cfg = PackingConfig(seq_len=32, packing="best_fit", packing_buffer=6)
    served = []
    states = []
    for r in range(old):  # old rank r packs documents r, r+old, ... and stops mid-stream
        packer = Packer(cfg, rows_per_batch=2)
        for ref in range(r, 40, old):
            packer.push(ref, docs[ref])
            while (b := packer.pop()) is not None:
                served += [p for row in b["__docs__"] for p in row]
        states.append(packer.state_dict())
    for r in range(new):  # new rank r: its share of the old buffers, then the rest of the stream
        packer = Packer(cfg, rows_per_batch=2)
        packer.load_state_dict(reshard_states(states, r, new), docs.__getitem__)
        rest = [(ref, docs[ref]) for ref in range(40 + r, 60, new)]
        for b in pack(rest, packer):
            served += [p for row in b["__docs__"] for p in row]
    tokens = {}
    for ref, offset, length in served:
        tokens.setdefault(ref, []).append((offset, length))
    assert sorted(tokens) == list(range(60))
    for ref, pieces in tokens.items():  # each document covered exactly once
        pieces.sort()
        assert pieces[0][0] == 0 and sum(n for _, n in pieces) == lengths[ref]
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))


def test_reshard_same_layout_is_identity_and_config_errors():
    state = Packer(PackingConfig(seq_len=8), rows_per_batch=1).state_dict()
    assert reshard_states([state, state], 1, 2) is state
    with pytest.raises(ValueError, match="packing must be one of"):
        PackingConfig(packing="first_fit")
    with pytest.raises(ValueError, match="1-D integer"):
        Packer(PackingConfig(seq_len=8), rows_per_batch=1).push(0, np.zeros(3, np.float32))


# -- wired into the loader -------------------------------------------------------------------------


def loader_cfg(root, algo, workers=0):
    return {
        "datasets": [{"path": str(root)}],
        "seed": 3,
        "shuffle_window": 16,
        "epochs": 1,
        "batch_size": 2,
        "num_workers": workers,
        "packing": algo,
        "seq_len": 24,
        "packing_buffer": 8,
    }


def served_pieces(batches):
    return [tuple(p) for b in batches for row in b["__docs__"] for p in row]


@pytest.mark.parametrize("algo", ["greedy", "best_fit"])
def test_loader_resume_mid_epoch_with_packing_gives_the_same_stream(tmp_path, algo):
    from headrace.dataio import build_loader
    from tests.loader_util import make_text_dataset

    make_text_dataset(tmp_path / "ds", [37, 23, 41])
    straight = list(build_loader(loader_cfg(tmp_path / "ds", algo), dp_rank=0, dp_size=1))
    first = build_loader(loader_cfg(tmp_path / "ds", algo), dp_rank=0, dp_size=1)
    it = iter(first)
    head = [next(it) for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = build_loader(loader_cfg(tmp_path / "ds", algo, workers=1), dp_rank=0, dp_size=1)
    resumed.load_state_dict(state)
    got = head + list(resumed)
    assert len(got) == len(straight)
    for x, y in zip(got, straight):
        assert x["__docs__"] == y["__docs__"]
        for k in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(x[k], y[k])
    # every document of the epoch, whole, exactly once
    pieces = sorted(served_pieces(straight))
    assert len({p[0] for p in pieces}) == 101 and len(set(pieces)) == len(pieces)


def test_loader_elastic_resume_with_packing_loses_nothing(tmp_path):
    from headrace.dataio import build_loader
    from tests.loader_util import make_text_dataset

    make_text_dataset(tmp_path / "ds", [30, 30, 19])
    cfg = loader_cfg(tmp_path / "ds", "best_fit")
    old = [build_loader(cfg, dp_rank=r, dp_size=2) for r in range(2)]
    served = []
    for loader in old:
        it = iter(loader)
        served += served_pieces([next(it) for _ in range(3)])
    states = [loader.state_dict() for loader in old]
    for r in range(3):
        loader = build_loader(cfg, dp_rank=r, dp_size=3)
        loader.load_state_dict(states)
        served += served_pieces(loader)
    by_doc = {}
    for ref, offset, length in served:
        by_doc.setdefault(ref, []).append((offset, length))
    assert len(by_doc) == 79
    for pieces in by_doc.values():  # each document whole and once: contiguous pieces from 0
        pieces.sort()
        assert pieces[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
    assert len(served) == len(set(served))


# -- the fast paths against straightforward references ---------------------------------------------


def reference_best_fit_rows(lengths, seq_len, buffer):
    """Best-fit decreasing written the obvious way: rows of (ref, offset, length), and the buffer
    after each document as version-1 state entries (by length, newest first among equals)."""
    buf, rows, buffers = [], [], []  # buf: (length, arrival, ref, offset)

    def take(candidates):
        piece = max(candidates, key=lambda p: (p[0], -p[1]))  # longest, then oldest
        buf.remove(piece)
        return piece

    def build_row():
        row = [take(buf)]
        gap = seq_len - row[0][0]
        while gap and (fits := [p for p in buf if p[0] <= gap]):
            row.append(take(fits))
            gap -= row[-1][0]
        rows.append([(ref, offset, n) for n, _, ref, offset in row])

    arrival = 0
    for ref, n in enumerate(lengths):
        offset = 0
        while n >= seq_len:
            rows.append([(ref, offset, seq_len)])
            offset, n = offset + seq_len, n - seq_len
        if n:
            buf.append((n, arrival, ref, offset))
            arrival += 1
            if len(buf) > buffer:
                build_row()
        buffers.append([[ref, offset, n, a] for n, a, ref, offset in sorted(buf, key=lambda p: (p[0], -p[1]))])
    while buf:
        build_row()
    return rows, buffers


def reference_batch(docs, rows, seq_len, rows_per_batch, pad_id):
    """The THD tensors of ``rows`` built token by token."""
    ids, labels, pos, cu = [], [], [], [0]
    for r in range(rows_per_batch):
        row = rows[r] if r < len(rows) else []
        for ref, offset, length in row:
            doc = docs[ref]
            for k in range(offset, offset + length):
                ids.append(int(doc[k]))
                labels.append(int(doc[k + 1]) if k + 1 < len(doc) else IGNORE_INDEX)
                pos.append(k - offset)
            cu.append(cu[-1] + length)
        pad = seq_len - sum(length for _, _, length in row)
        ids += [pad_id] * pad
        labels += [IGNORE_INDEX] * pad
        pos += list(range(pad))
        if pad:
            cu.append(cu[-1] + pad)
    shape = (rows_per_batch, seq_len)
    return {
        "input_ids": torch.tensor(ids).view(shape),
        "labels": torch.tensor(labels).view(shape),
        "position_ids": torch.tensor(pos).view(shape),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
    }


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=60),
    seq_len=st.integers(2, 20),
    buffer=st.integers(1, 12),
    rows=st.integers(1, 3),
    pad_id=st.integers(0, 5),
)
def test_best_fit_rows_state_and_tensors_match_references(lengths, seq_len, buffer, rows, pad_id):
    # short lengths make many ties, so the oldest-first order among equal lengths is exercised
    docs = make_docs(lengths)
    want_rows, want_buffers = reference_best_fit_rows(lengths, seq_len, buffer)
    packer = Packer(
        PackingConfig(seq_len=seq_len, packing="best_fit", packing_buffer=buffer, pad_id=pad_id), rows_per_batch=rows
    )
    got_rows = []
    for ref, tokens in docs.items():
        packer.push(ref, tokens)
        assert packer.state_dict()["buffer"] == want_buffers[ref]
        while (batch := packer.pop()) is not None:
            got_rows += batch["__docs__"]
    packer.flush()
    batches = []
    while (batch := packer.pop()) is not None:
        batches.append(batch)
        got_rows += batch["__docs__"]
    assert [row for row in got_rows if row] == want_rows
    for batch in batches:
        want = reference_batch(docs, batch["__docs__"], seq_len, rows, pad_id)
        for k, v in want.items():
            assert batch[k].dtype == (torch.int32 if k == "cu_seqlens" else torch.int64)
            assert torch.equal(batch[k], v), k


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 50), min_size=1, max_size=30),
    algo=st.sampled_from(ALGOS),
    seq_len=st.integers(2, 16),
    rows=st.integers(1, 3),
    pad_id=st.integers(0, 5),
    dtype=st.sampled_from([np.int32, np.uint16, np.int64]),
)
def test_batches_match_token_by_token_reference(lengths, algo, seq_len, rows, pad_id, dtype):
    docs = {ref: d.astype(dtype) for ref, d in make_docs([min(n, 60) for n in lengths]).items()}
    packer = Packer(
        PackingConfig(seq_len=seq_len, packing=algo, packing_buffer=3, open_rows=2, pad_id=pad_id), rows_per_batch=rows
    )
    for batch in pack(docs.items(), packer):
        want = reference_batch(docs, batch["__docs__"], seq_len, rows, pad_id)
        for k, v in want.items():
            assert torch.equal(batch[k], v), k
