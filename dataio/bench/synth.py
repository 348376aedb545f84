"""A larger benchmark corpus: >= 1 GB of text tokens and >= 3 h of speech, as indexed shard directories.

    python -m dataio.bench.synth --out /tmp/headrace-bench --text-gb 1.0 --speech-hours 3.0

- text: the demo corpus's real documents (``tools.demo_corpus.select_documents``), byte-level
  tokenised to int32 ``tokens.npy`` (as ``tools/bench_loader.py`` does), documents repeated under new
  keys until ``--text-gb`` of tokens; written with ``webdataset.TarWriter`` (the peer ecosystem's
  writer) in shards of ~64 MB, then indexed with ``dataio index``'s scanner and metadata writer.
- speech: ``tools.bench_decode.speech_like`` utterances (3-6 s, 16 kHz FLAC, ~90 KB) with a NeMo
  manifest, sharded by ``dataio shard``.

Cost on 2 cores: about a minute per GB of text and a few minutes for 3 h of speech; disk: the sizes asked.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np

SHARD_BYTES = 64 << 20


def write_text(out: Path, gigabytes: float) -> None:
    import webdataset as wds

    from dataio.commands.index import build_index
    from tools.demo_corpus import select_documents

    docs = [np.frombuffer(d.text.encode(), np.uint8).astype(np.int32) for d in select_documents(6000)]
    out.mkdir(parents=True, exist_ok=True)
    target, written, shard, i = gigabytes * 1e9, 0, 0, 0
    while written < target:
        with wds.TarWriter(str(out / f"train-{shard:06d}.tar")) as w:
            size = 0
            while size < SHARD_BYTES and written < target:
                buf = io.BytesIO()
                np.save(buf, docs[i % len(docs)])
                w.write({"__key__": f"d{i:09d}", "tokens.npy": buf.getvalue()})
                size += buf.tell()
                written += docs[i % len(docs)].nbytes
                i += 1
        shard += 1
    build_index(out, workers=2)  # what `dataio index DIR` does: headrace index + energon .nv-meta
    print(f"text: {i:,} documents, {written / 1e9:.2f} GB of int32 tokens in {shard} shards -> {out}")


def write_speech(out: Path, hours: float) -> None:
    import soundfile

    from tools.bench_decode import RATE, speech_like

    src = out.parent / f"{out.name}-flac"
    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows, total = [], 0.0
    while total < hours * 3600:
        seconds = float(rng.uniform(3.0, 6.0))
        path = src / f"u{len(rows):06d}.flac"
        soundfile.write(path, speech_like(rng, seconds), RATE, format="FLAC", subtype="PCM_16")
        rows.append({"audio_filepath": path.name, "duration": seconds, "text": f"utterance {len(rows)}"})
        total += seconds
    manifest = src / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from dataio.commands import shard

    parser = argparse.ArgumentParser()
    shard.add_arguments(parser)
    shard.run(parser.parse_args([str(manifest), "--output", str(out), "--shard-size", "64MB", "--workers", "2", "--quiet"]))
    print(f"speech: {len(rows):,} utterances, {total / 3600:.2f} h -> {out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataio.bench.synth", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--text-gb", type=float, default=1.0, help="GB of int32 text tokens (0: none)")
    p.add_argument("--speech-hours", type=float, default=3.0, help="hours of speech (0: none)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/ lives at the repository root
    if args.text_gb > 0:
        write_text(args.out / "text", args.text_gb)
    if args.speech_hours > 0:
        write_speech(args.out / "speech", args.speech_hours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
