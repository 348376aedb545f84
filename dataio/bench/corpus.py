"""Synthetic benchmark corpora: speech-like FLAC, long-tailed documents, token shards, all seeded.

One home for the data every benchmark generates, so that figures from different drivers describe the
same kind of input:

- ``speech_like(rng, seconds)``: voiced harmonics (12, gliding pitch 90-220 Hz) under a ~4 Hz syllable
  envelope plus breath noise, 16 kHz float32; as FLAC (``flac_bytes``) ~20 KB per second, like real
  utterances (a 4.5 s one is ~90 KB). Cost: ~5 ms per second of audio to synthesise and encode.
- ``longtail_lengths(rng, n, median=, sigma=)``: log-normal document lengths, the shape of real text
  corpora (most documents short, a long tail); ``simulated_token_documents`` turns them into token
  arrays (views into one random pool, so 100M+ tokens cost one pool's memory).
- ``demo_token_documents(n)``: the demo corpus's real documents (``headrace.dataio.bench.documents``),
  byte-level tokenised to int32.
- ``write_bpe_tokenizer(path, texts, vocab_size)``: a whitespace-split BPE ``tokenizer.json`` trained
  on ``texts`` (what ``dataio shard --tokenizer`` takes).
- ``write_indexed_shards(root, samples)``: samples -> ``webdataset.ShardWriter`` tars (the peer
  ecosystem's writer) -> ``dataio index``'s scanner and metadata (headrace index + energon ``.nv-meta``).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from headrace.dataio.bench.extra import bench_import

RATE = 16000


def speech_like(rng: np.random.Generator, seconds: float, rate: int = RATE) -> np.ndarray:
    """Voiced harmonics with a gliding pitch under a ~4 Hz syllable envelope, plus breath noise."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = rng.uniform(90, 220) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.3, 1.0) * t))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 13))
    envelope = np.abs(np.sin(2 * np.pi * rng.uniform(3, 5) * t + rng.uniform(0, np.pi))) ** 2
    wave = 0.25 * voiced * envelope + 0.0015 * rng.standard_normal(len(t))
    return (wave / np.max(np.abs(wave)) * 0.8).astype(np.float32)


def flac_bytes(wave: np.ndarray, rate: int = RATE) -> bytes:
    """``wave`` encoded as 16-bit FLAC."""
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, wave, rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


def longtail_lengths(rng: np.random.Generator, n: int, *, median: float, sigma: float) -> np.ndarray:
    """``n`` log-normal lengths (int64, >= 1) with the given median and log-space ``sigma``."""
    return np.maximum(1, rng.lognormal(np.log(median), sigma, n).astype(np.int64))


def simulated_token_documents(
    n: int, *, median: float = 718, sigma: float = 1.664, vocab: int = 50_000, seed: int = 0
) -> list[np.ndarray]:
    """``n`` int32 token documents of ``longtail_lengths``: views into one random pool."""
    rng = np.random.default_rng(seed)
    lengths = longtail_lengths(rng, n, median=median, sigma=sigma)
    pool = rng.integers(0, vocab, int(lengths.max()) + 1, dtype=np.int32)
    starts = rng.integers(0, len(pool) - lengths + 1)
    return [pool[s : s + k] for s, k in zip(starts.tolist(), lengths.tolist())]


def byte_tokens(text: str) -> np.ndarray:
    """Byte-level tokens of ``text`` (int32, vocabulary 256): tokenisation without a tokenizer."""
    return np.frombuffer(text.encode(), np.uint8).astype(np.int32)


def demo_token_documents(count: int) -> list[np.ndarray]:
    """``count`` byte-tokenised demo-corpus documents; the installed ones repeated when they run out."""
    from headrace.dataio.bench.documents import select_documents  # here: drivers that only synthesise audio skip it

    docs = [byte_tokens(d.text) for d in select_documents(count)]
    return [docs[i % len(docs)] for i in range(count)]


def write_bpe_tokenizer(path: Path, texts: Iterable[str], vocab_size: int) -> Path:
    """A BPE tokenizer (whitespace pre-tokenizer, ``[UNK]``) trained on ``texts``, saved at ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"]))
    tok.save(str(path))
    return path


def write_indexed_shards(
    root: Path,
    samples: Iterable[dict],
    *,
    pattern: str = "train-%06d.tar",
    maxcount: int = 10**9,
    maxsize: float = 3e9,
    workers: int = 1,
) -> int:
    """Write ``samples`` (webdataset dicts) as tars under ``root`` and index them; returns the shard count."""
    from headrace.dataio.prepare.indexing import build_index  # here: the shard writer loads only for real shards

    wds = bench_import("webdataset", "write_indexed_shards")

    root.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(root / pattern), maxcount=maxcount, maxsize=maxsize, verbose=0) as sink:
        for sample in samples:
            sink.write(sample)
        shards = sink.shard
    build_index(root, workers=workers)  # what `dataio index ROOT` does
    return shards


__all__ = [
    "RATE",
    "byte_tokens",
    "demo_token_documents",
    "flac_bytes",
    "longtail_lengths",
    "simulated_token_documents",
    "speech_like",
    "write_bpe_tokenizer",
    "write_indexed_shards",
]
