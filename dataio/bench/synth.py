"""A larger benchmark corpus: >= 1 GB of text tokens and >= 3 h of speech, as indexed shard directories.

    python -m headrace.dataio.bench.synth --out /tmp/headrace-bench --text-gb 1.0 --speech-hours 3.0

- text: the demo corpus's real documents (``corpus.demo_token_documents``: byte-level int32
  ``tokens.npy``), repeated under new keys until ``--text-gb`` of tokens; written and indexed by
  ``corpus.write_indexed_shards`` (``webdataset.ShardWriter``, the peer ecosystem's writer) in
  shards of ~64 MB.
- ``--lognormal-docs N`` (instead of ``--text-gb``): the loader benchmark's corpus (issue 35): ``N``
  documents of ``corpus.simulated_token_documents`` lengths (log-normal, median 814 tokens, sigma
  1.664: mean ~3,300 int32 tokens = ~13 KB), 5,556 a shard, under ``OUT/text-lognormal``.
- speech: ``corpus.speech_like`` utterances (3-6 s, 16 kHz FLAC, ~90 KB) with a NeMo manifest,
  sharded by ``dataio shard``; ``--speech-format wav`` / ``--speech-rate 24000`` write 16-bit WAV or
  another rate instead (the decoded-audio benchmark's WAV and resampling cases).

Cost on 2 cores: about a minute per GB of text and a few minutes for 3 h of speech; disk: the sizes asked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import soundfile

from headrace.dataio.bench.corpus import (
    RATE,
    demo_token_documents,
    flac_bytes,
    simulated_token_documents,
    speech_like,
    write_indexed_shards,
)
from headrace.dataio.prepare.job import ShardOptions, shard_corpus
from headrace.dataio.shards.formats import npy_bytes

SHARD_BYTES = 64 << 20


def write_text(out: Path, gigabytes: float) -> None:
    docs = demo_token_documents(6000)
    written = count = 0

    def samples():
        nonlocal written, count
        while written < gigabytes * 1e9:
            doc = docs[count % len(docs)]
            yield {"__key__": f"d{count:09d}", "tokens.npy": npy_bytes(doc)}
            written, count = written + doc.nbytes, count + 1

    shards = write_indexed_shards(out, samples(), maxsize=SHARD_BYTES, workers=2)
    print(f"text: {count:,} documents, {written / 1e9:.2f} GB of int32 tokens in {shards} shards -> {out}")


def write_lognormal_text(out: Path, docs: int) -> None:
    tokens = simulated_token_documents(docs, median=814, sigma=1.664, seed=0)
    samples = ({"__key__": f"d{i:08d}", "tokens.npy": npy_bytes(d)} for i, d in enumerate(tokens))
    shards = write_indexed_shards(out, samples, maxcount=5556)
    print(
        f"text: {docs:,} log-normal documents, {sum(d.nbytes for d in tokens) / 1e6:,.1f} MB of int32 tokens "
        f"in {shards} shards -> {out}"
    )


def write_speech(out: Path, hours: float, *, fmt: str = "flac", rate: int = RATE) -> None:
    src = out.parent / f"{out.name}-{fmt}"
    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows, total = [], 0.0
    while total < hours * 3600:
        seconds = float(rng.uniform(3.0, 6.0))
        path = src / f"u{len(rows):06d}.{fmt}"
        wave = speech_like(rng, seconds, rate)
        if fmt == "flac" and rate == RATE:
            path.write_bytes(flac_bytes(wave))
        else:
            soundfile.write(path, wave, rate, subtype="PCM_16")
        rows.append({"audio_filepath": path.name, "duration": seconds, "text": f"utterance {len(rows)}"})
        total += seconds
    manifest = src / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shard_corpus(ShardOptions(inputs=[str(manifest)], output=out, shard_size="64MB", workers=2))
    print(f"speech: {len(rows):,} utterances, {total / 3600:.2f} h -> {out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m headrace.dataio.bench.synth", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--text-gb", type=float, default=1.0, help="GB of int32 text tokens (0: none)")
    p.add_argument(
        "--lognormal-docs",
        type=int,
        default=0,
        help="write this many log-normal int32 token documents (the loader benchmark's corpus) instead of --text-gb",
    )
    p.add_argument("--speech-hours", type=float, default=3.0, help="hours of speech (0: none)")
    p.add_argument("--speech-format", choices=["flac", "wav"], default="flac", help="16-bit FLAC or WAV")
    p.add_argument("--speech-rate", type=int, default=RATE, help="the utterances' sample rate in Hz")
    args = p.parse_args(argv)
    if args.lognormal_docs > 0:
        write_lognormal_text(args.out / "text-lognormal", args.lognormal_docs)
    elif args.text_gb > 0:
        write_text(args.out / "text", args.text_gb)
    if args.speech_hours > 0:
        write_speech(args.out / "speech", args.speech_hours, fmt=args.speech_format, rate=args.speech_rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
