"""Shard-writing benchmark: `dataio shard` vs `webdataset.ShardWriter` + `energon prepare`, beside dd.

Builds a text corpus (JSONL + a BPE tokenizer.json) and an already-encoded audio corpus (FLAC files +
NeMo manifest) in a scratch directory, then, in one run on the same disk:

- ``dataio shard`` at 1 and 2 workers (end to end: plan, tokenize, tars, index parts, energon metadata);
- ``webdataset.ShardWriter`` writing the same samples (same members, same tokenizer, batched encode)
  plus ``energon prepare --non-interactive`` indexing them, which is what the peer workflow needs;
- ``dd if=/dev/zero bs=1M conv=fdatasync``: the disk's sequential write speed.

Prints MB/s (bytes of tar written) and samples/s per method, and the ratios the targets are about.
Usage: ``.venv/bin/python tools/bench_shard.py [--docs 40000] [--audio-files 300] [--dir /tmp/bench_shard]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARD_SIZE = 16_000_000


def build_text(d: Path, docs: int) -> tuple[Path, Path]:
    """JSONL of documents with log-normal (long-tailed) lengths, words from the stdlib's own source text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = re.findall(r"[A-Za-z']+", open(os.__file__).read() + open(json.__file__).read())
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(5.5, 1.0, docs).astype(int) + 5, 20_000)
    src = d / "docs.jsonl"
    with open(src, "w") as f:
        for i, n in enumerate(lengths):
            start = int(rng.integers(0, len(words) - 1))
            text = " ".join(words[(start + j) % len(words)] for j in range(n))
            f.write(json.dumps({"id": f"doc{i}", "text": text}) + "\n")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainers.BpeTrainer(vocab_size=8000, special_tokens=["[UNK]"]))
    tok.save(str(d / "tokenizer.json"))
    return src, d / "tokenizer.json"


def build_audio(d: Path, files: int) -> Path:
    """FLAC files of 5-15 s of 16 kHz speech-band noise (compresses like speech: ~50%)."""
    import soundfile as sf

    rng = np.random.default_rng(1)
    (d / "audio").mkdir(exist_ok=True)
    rows = []
    for i in range(files):
        seconds = float(rng.uniform(5, 15))
        x = np.cumsum(rng.standard_normal(int(seconds * 16000))).astype(np.float32)
        x = (x - np.convolve(x, np.ones(64) / 64, mode="same")) / 200
        sf.write(d / "audio" / f"u{i:05d}.flac", np.clip(x, -1, 1), 16000, subtype="PCM_16")
        rows.append({"audio_filepath": f"audio/u{i:05d}.flac", "duration": seconds, "text": f"utterance {i}"})
    manifest = d / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def tar_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("*.tar"))


def run_dataio(inputs: list[Path], out: Path, workers: int, tokenizer: Path | None) -> float:
    argv = [sys.executable, "-m", "dataio", "shard", *map(str, inputs), "--output", str(out), "--workers", str(workers),
            "--shard-size", str(SHARD_SIZE), "--quiet"] + (["--tokenizer", str(tokenizer)] if tokenizer else [])
    t = time.perf_counter()
    subprocess.run(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def run_shardwriter(manifest: Path, out: Path, tokenizer: Path | None, audio: bool) -> tuple[float, float]:
    """(ShardWriter seconds, energon prepare seconds) for the same samples and members."""
    import io

    import webdataset as wds
    from tokenizers import Tokenizer

    out.mkdir(parents=True)
    tok = Tokenizer.from_file(str(tokenizer)) if tokenizer else None
    t = time.perf_counter()
    rows = [json.loads(line) for line in open(manifest)]
    with wds.ShardWriter(str(out / "train-%06d.tar"), maxsize=SHARD_SIZE, maxcount=10**9, verbose=0) as sink:
        for start in range(0, len(rows), 1024):
            batch = rows[start : start + 1024]
            ids = tok.encode_batch([r["text"] for r in batch], add_special_tokens=False) if tok else None
            for i, r in enumerate(batch):
                sample = {"__key__": r.get("id") or Path(r["audio_filepath"]).stem}
                if audio:
                    sample["flac"] = (manifest.parent / r["audio_filepath"]).read_bytes()
                    sample["json"] = json.dumps(r).encode()
                else:
                    sample["txt"] = r["text"].encode()
                    sample["json"] = json.dumps({"source": str(manifest), "line": start + i + 1}).encode()
                if ids is not None:
                    buf = io.BytesIO()
                    np.save(buf, np.asarray(ids[i].ids, np.uint16))
                    sample["npy"] = buf.getvalue()
                sink.write(sample)
    os.sync()
    write_s = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run([str(Path(sys.executable).with_name("energon")), "prepare", str(out), "--non-interactive",
                    "--split-ratio", "1,0,0", "--sample-type", "CrudeWebdataset", "--num-workers", "2", "--no-progress"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return write_s, time.perf_counter() - t


def dd_speed(d: Path, mb: int) -> float:
    """MB/s of ``dd if=/dev/zero bs=1M conv=fdatasync`` (the disk's sequential write speed)."""
    target = d / "dd.bin"
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mb}", "conv=fdatasync"],
                   check=True, capture_output=True)
    elapsed = time.perf_counter() - t
    target.unlink()
    return mb * 1.048576 / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=40_000)
    p.add_argument("--audio-files", type=int, default=300)
    p.add_argument("--dir", default="/tmp/bench_shard")
    args = p.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    (root / "data").mkdir(parents=True)
    text, tokenizer = build_text(root / "data", args.docs)
    manifest = build_audio(root / "data", args.audio_files)
    samples = {"text": args.docs, "audio": args.audio_files}

    print(f"{'corpus':6} {'method':34} {'seconds':>8} {'MB/s':>8} {'samples/s':>10}")
    results = {}
    for corpus, inputs, tok in (("text", text, tokenizer), ("audio", manifest, None)):
        rows = {}
        for workers in (1, 2):
            out = root / f"{corpus}-dataio-{workers}"
            seconds = run_dataio([inputs], out, workers, tok)
            rows[f"dataio shard --workers {workers}"] = (seconds, tar_bytes(out))
        out = root / f"{corpus}-wds"
        write_s, prepare_s = run_shardwriter(inputs, out, tok, audio=corpus == "audio")
        size = tar_bytes(out)
        rows["ShardWriter"] = (write_s, size)
        rows["energon prepare"] = (prepare_s, size)
        rows["ShardWriter + energon prepare"] = (write_s + prepare_s, size)
        for name, (seconds, size) in rows.items():
            print(f"{corpus:6} {name:34} {seconds:8.2f} {size / 1e6 / seconds:8.1f} {samples[corpus] / seconds:10.0f}")
        results[corpus] = rows
        for d in root.glob(f"{corpus}-*"):
            shutil.rmtree(d)
    dd_mb = max(256, int(results["audio"]["dataio shard --workers 1"][1] / 2**20))
    dd = dd_speed(root, dd_mb)
    print(f"disk   dd bs=1M count={dd_mb} conv=fdatasync      {'':8} {dd:8.1f}")
    for corpus, rows in results.items():
        peer = rows["ShardWriter + energon prepare"][0]
        for workers in (1, 2):
            seconds, size = rows[f"dataio shard --workers {workers}"]
            line = f"{corpus}: dataio shard --workers {workers} is {peer / seconds:.2f}x faster than ShardWriter + energon prepare"
            if corpus == "audio":
                line += f"; {size / 1e6 / seconds / dd:.2f}x of dd's MB/s"
            print(line)


if __name__ == "__main__":
    main()
