"""The packing stage on the loader's stream: every token once, also across an elastic resume."""

import itertools
from collections import Counter

import pytest
import torch

from headrace.dataio import build_loader
from headrace.dataio.stream.ordering.refs import split_ref

from tests.loader_util import make_text_dataset


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    root = tmp_path_factory.mktemp("packtext")
    make_text_dataset(root, [9, 4, 7])
    return root


def doc_tokens(batches):
    """Tokens served per document ref (pieces summed)."""
    served = Counter()
    for batch in batches:
        for row in batch["__docs__"]:
            for ref, _offset, length in row:
                served[ref] += length
    return served


def test_packed_stream_covers_every_token_once_and_resumes_elastically(text):
    cfg = {
        "datasets": [{"path": str(text)}],
        "batch_size": 2,
        "epochs": 1,
        "num_workers": 0,
        "packing": "best_fit",
        "seq_len": 16,
        "packing_buffer": 4,
        "shuffle_window": 5,
    }
    loader = build_loader(cfg)
    full = list(loader)
    lengths = doc_tokens(full)
    assert len(lengths) == 20
    for batch in full:
        assert batch["input_ids"].shape == (2, 16)

    # Two ranks stop after unequal numbers of packed batches; three ranks take over.
    heads, states = [], []
    for r, n in enumerate([2, 1]):
        rank_loader = build_loader(cfg, dp_rank=r, dp_size=2)
        heads += list(itertools.islice(rank_loader, n))
        states.append(rank_loader.state_dict())
    rest = []
    for r in range(3):
        resumed = build_loader({**cfg, "num_workers": 1}, dp_rank=r, dp_size=3)
        resumed.load_state_dict(states)
        rest += list(resumed)
    assert doc_tokens(heads + rest) == lengths

    # Same layout: the continuation equals the straight run.
    loader = build_loader(cfg)
    head = list(itertools.islice(loader, 3))
    again = build_loader(cfg)
    again.load_state_dict(loader.state_dict())
    tail = list(again)
    assert [b["__docs__"] for b in head + tail] == [b["__docs__"] for b in full]
    assert all(split_ref(ref)[0] == 0 for ref in lengths)


def test_packing_none_with_seq_len_gives_one_padded_document_per_row(text):
    """``packing: none`` + ``seq_len``: the trainer's THD layout, one document (piece) per row, padded
    with ``pad_id``; without ``seq_len`` the plain collate (flat tokens + lengths)."""
    base = {"datasets": [{"path": str(text)}], "batch_size": 3, "epochs": 1, "num_workers": 0, "shuffle": False}
    plain = list(build_loader(base))
    documents = [d for b in plain for d in torch.split(b["tokens.npy"], b["__lengths__"]["tokens.npy"].tolist())]
    assert "input_ids" not in plain[0] and len(documents) == 20
    seq_len = 24  # the documents have 1..39 tokens: some are split into two rows
    rows = []
    for batch in build_loader({**base, "seq_len": seq_len, "pad_id": 7, "num_workers": 2}):
        assert batch["input_ids"].shape == batch["labels"].shape == (3, seq_len)
        for r in range(3):
            assert len(batch["__docs__"][r]) <= 1  # one piece per row (an empty row ends the stream)
            if batch["__docs__"][r]:
                ((ref, offset, length),) = batch["__docs__"][r]
                rows.append((ref, offset, length))
                assert batch["input_ids"][r, length:].eq(7).all() and batch["labels"][r, length:].eq(-100).all()
                assert batch["position_ids"][r, :length].tolist() == list(range(length))
                assert torch.equal(
                    batch["input_ids"][r, :length], documents[split_ref(ref)[1]][offset : offset + length]
                )
    # every document whole and in order: pieces of a document are consecutive and cover it
    served = Counter()
    for ref, offset, length in rows:
        assert offset == served[ref]
        served[ref] += length
    assert [served[ref] for ref in sorted(served)] == [len(d) for d in documents]
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)


def test_seq_len_defaults_and_limits(text):
    from headrace.dataio.config import DEFAULT_SEQ_LEN, DataConfig, DatasetSpec

    spec = [DatasetSpec(path=str(text))]
    assert DataConfig(datasets=spec).seq_len is None and not DataConfig(datasets=spec).thd
    assert DataConfig(datasets=spec, packing="greedy").seq_len == DEFAULT_SEQ_LEN
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        DataConfig(datasets=spec, seq_len=1)
