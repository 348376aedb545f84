"""The demo corpus builder: deterministic, long-tailed real text, consistent audio manifest, exact tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from headrace.dataio.bench import documents
from tools import demo_corpus
from tools.demo_corpus import CorpusConfig

SMALL = dict(docs=400, utterances=10, vocab_size=800)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> tuple[Path, Path]:
    """Two independent builds of the reduced corpus: one through the CLI, one through build()."""
    root = tmp_path_factory.mktemp("corpus")
    a, b = root / "a", root / "b"
    argv = ["--out", str(a)] + [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    assert demo_corpus.main(argv) == 0
    demo_corpus.build(CorpusConfig(**SMALL), b)
    return a, b


def test_two_builds_are_byte_identical(builds):
    a, b = builds
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    assert {"text.jsonl", "audio_manifest.jsonl", "tokenizer.json", "corpus_info.json"} <= {str(p) for p in files_a}
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    # Built in a hidden sibling and renamed into place: nothing half-built is left beside it.
    assert sorted(p.name for p in a.parent.iterdir()) == ["a", "b"]


def test_text_is_real_documentation_with_long_tailed_lengths(builds):
    rows = _read_jsonl(builds[0] / "text.jsonl")
    assert len(rows) == SMALL["docs"]
    assert all(r["text"].strip() and r["source"] for r in rows)
    assert len({r["text"] for r in rows}) == len(rows), "duplicate documents"
    assert [r["source"] for r in rows] == sorted(r["source"] for r in rows)
    kinds = {r["source"].split(":")[0] for r in rows}
    assert kinds == {"pypi", "python-stdlib"}

    lengths = np.array([len(r["text"]) for r in rows])
    p50, p90, p99 = np.quantile(lengths, [0.5, 0.9, 0.99])
    # Long tail: the top percent is more than 10x the median, the longest over 50x, and the mean is
    # pulled above the median (right skew), as in real corpora.
    assert p99 > 10 * p50 and lengths.max() > 50 * p50
    assert lengths.mean() > p50 and p90 > 2 * p50
    # English prose, not binary or code dumps: mostly letters and spaces.
    text = "".join(r["text"] for r in rows)
    assert sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.75


def test_manifest_durations_match_audio_files(builds):
    manifest = builds[0] / "audio_manifest.jsonl"
    rows = _read_jsonl(manifest)
    assert len(rows) == SMALL["utterances"]
    engine = json.loads((builds[0] / "corpus_info.json").read_text())["speech"]
    for row in rows:
        path = manifest.parent / row["audio_filepath"]  # NeMo style: relative to the manifest
        info = sf.info(path)
        assert (info.format, info.samplerate, info.channels) == ("FLAC", 16_000, 1)
        assert row["duration"] == pytest.approx(info.frames / info.samplerate, abs=1e-9)
        assert 0.5 < row["duration"] < 30
        assert row["text"].split() and row["synthetic"] == (engine == "synthetic")
        audio, _ = sf.read(path, dtype="float32")
        assert np.abs(audio).max() > 0.05, f"{path} is silent"


def test_longer_sentences_give_longer_audio(builds):
    rows = _read_jsonl(builds[0] / "audio_manifest.jsonl")
    chars = np.array([len(r["text"]) for r in rows])
    durations = np.array([r["duration"] for r in rows])
    # Speaking rate varies by utterance (140-190 wpm), so the relation is strong but not exact.
    assert np.corrcoef(chars, durations)[0, 1] > 0.6


def test_tokenizer_round_trips_text(builds):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(builds[0] / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == SMALL["vocab_size"]
    assert [tokenizer.token_to_id(t) for t in demo_corpus.SPECIAL_TOKENS] == [0, 1, 2]
    texts = [r["text"] for r in _read_jsonl(builds[0] / "text.jsonl")]
    texts += ["Unseen: naïve café, 東京, emoji \U0001f600, tabs\tand\nnewlines  "]
    n_tokens = 0
    for text in texts:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        n_tokens += len(ids)
    # The merges learned something: well under one token per character.
    assert sum(map(len, texts)) / n_tokens > 2.0


def test_synthetic_fallback_is_labelled_and_consistent(tmp_path):
    sentences = [("Return the relative path to another path.", "x"), ("Close the transport.", "y")]
    rows = demo_corpus.synthesize(sentences, tmp_path, "synthetic", workers=2)
    assert [r["text"] for r in rows] == [s for s, _ in sentences]
    assert all(r["synthetic"] and r["speaker"].startswith("synthetic") for r in rows)
    for row in rows:
        info = sf.info(tmp_path / row["audio_filepath"])
        assert row["duration"] == info.frames / info.samplerate
    assert rows[0]["duration"] > rows[1]["duration"]  # longer sentence, longer signal


def test_sentence_picker_keeps_plain_prose_only():
    docs = [
        demo_corpus.Document(
            "s",
            "Return the value. >>> x = 1\n\nThe path e.g. foo is used. "
            "Open the file_name now. This one is plain and fine!",
        )
    ]
    picked = [s for s, _ in demo_corpus.pick_sentences(docs, 10)]
    assert sorted(picked) == ["This one is plain and fine!"]


def test_readmes_come_from_our_dependency_tree_only():
    """Only headrace's runtime dependency tree feeds the corpus, so extra packages in an environment
    (dev tools, DALI) do not change it."""
    names = {d.metadata["Name"].lower().replace("_", "-") for d in documents.dependency_closure()}
    assert {"torch", "transformers", "numpy", "tokenizers", "huggingface-hub"} <= names
    assert not names & {"headrace", "pytest", "hypothesis", "nvidia-dali-cuda130"}


def test_without_espeak_auto_falls_back_and_espeak_is_refused(monkeypatch):
    monkeypatch.setattr(demo_corpus, "espeak_binary", lambda: None)
    assert demo_corpus.resolve_engine("auto") == "synthetic"
    with pytest.raises(SystemExit, match="espeak-ng is not on PATH"):
        demo_corpus.resolve_engine("espeak")
