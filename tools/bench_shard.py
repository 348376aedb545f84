"""Shard-writing benchmark: `dataio shard` vs `webdataset.ShardWriter` + `energon prepare`, beside dd.

Builds a text corpus (JSONL + a BPE tokenizer.json) and an already-encoded audio corpus (FLAC files +
NeMo manifest) in a scratch directory, then, in one run on the same disk:

- ``dataio shard`` at 1 and 2 workers (end to end: plan, tokenize, tars, index parts, energon metadata);
- ``webdataset.ShardWriter`` writing the same samples (same members, same tokenizer, batched encode)
  plus ``energon prepare --non-interactive`` indexing them, which is what the peer workflow needs;
- ``dd if=/dev/zero bs=1M conv=fdatasync``: the disk's sequential write speed.

Corpora, timings and dd come from ``headrace.dataio.bench`` (``corpus``, ``processes``).
Prints MB/s (bytes of tar written) and samples/s per method, and the ratios the targets are about.
``dataio shard`` is timed end to end (process start-up and metadata included) and by its own timer
(the "in X s" of its summary line: planning and writing, without interpreter start-up and imports).
Usage: ``.venv/bin/python -m tools.bench_shard [--docs 40000] [--audio-files 300] [--dir /tmp/bench_shard]
[--baseline DIR]`` (``DIR``: another checkout, e.g. ``git archive COMMIT | tar -x -C DIR``, timed beside).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np

from headrace.dataio.bench.corpus import flac_bytes, longtail_lengths, speech_like, write_bpe_tokenizer
from headrace.dataio.bench.processes import REPO, dd_write_mb_per_s, time_dataio, time_energon_prepare
from headrace.dataio.shards.formats import npy_bytes

SHARD_SIZE = {"text": 16_000_000, "audio": 64_000_000}  # several shards per corpus at the default sizes
_THROUGHPUT = re.compile(r"in ([0-9.]+) s \(")


def build_text(d: Path, docs: int) -> tuple[Path, Path]:
    """JSONL of documents with log-normal (long-tailed) lengths, words from the stdlib's own source text."""
    words = re.findall(r"[A-Za-z']+", open(os.__file__).read() + open(json.__file__).read())
    rng = np.random.default_rng(0)
    lengths = np.minimum(longtail_lengths(rng, docs, median=np.exp(5.5), sigma=1.0) + 5, 20_000)
    src = d / "docs.jsonl"
    with open(src, "w") as f:
        for i, n in enumerate(lengths):
            start = int(rng.integers(0, len(words) - 1))
            text = " ".join(words[(start + j) % len(words)] for j in range(n))
            f.write(json.dumps({"id": f"doc{i}", "text": text}) + "\n")
    return src, write_bpe_tokenizer(d / "tokenizer.json", [" ".join(words)], vocab_size=8000)


def build_audio(d: Path, files: int, unique: int = 200) -> Path:
    """FLAC files of 5-15 s of 16 kHz ``speech_like`` audio. ``unique`` clips are encoded and the rest
    are byte copies of them under new names: kept audio is copied as given, so the content does not
    matter to the writer, and encoding thousands of clips would dominate."""
    rng = np.random.default_rng(1)
    (d / "audio").mkdir(exist_ok=True)
    rows = []
    for i in range(files):
        path = d / "audio" / f"u{i:05d}.flac"
        if i < unique:
            seconds = float(rng.uniform(5, 15))
            path.write_bytes(flac_bytes(speech_like(rng, seconds)))
        else:
            shutil.copyfile(d / "audio" / f"u{i % unique:05d}.flac", path)
            seconds = rows[i % unique]["duration"]
        rows.append({"audio_filepath": f"audio/u{i:05d}.flac", "duration": seconds, "text": f"utterance {i}"})
    manifest = d / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.sync()  # the corpus is on disk (and in the page cache) before anything is timed
    return manifest


def tar_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("*.tar"))


def run_dataio(
    inputs: list[Path], out: Path, workers: int, tokenizer: Path | None, shard_size: int, repo: Path = REPO
) -> tuple[float, float]:
    """(wall seconds of the whole process, seconds of dataio's own timer: plan + write, no start-up);
    ``repo`` is the checkout whose ``dataio`` runs."""
    argv = [
        "shard",
        *map(str, inputs),
        "--output",
        str(out),
        "--workers",
        str(workers),
        "--shard-size",
        str(shard_size),
        "--quiet",
    ] + (["--tokenizer", str(tokenizer)] if tokenizer else [])
    wall, stdout = time_dataio(argv, repo)
    return wall, float(_THROUGHPUT.search(stdout).group(1))


def run_shardwriter(
    manifest: Path, out: Path, tokenizer: Path | None, audio: bool, shard_size: int
) -> tuple[float, float]:
    """(ShardWriter seconds, energon prepare seconds) for the same samples and members."""
    import webdataset as wds
    from tokenizers import Tokenizer

    out.mkdir(parents=True)
    tok = Tokenizer.from_file(str(tokenizer)) if tokenizer else None
    t = time.perf_counter()
    rows = [json.loads(line) for line in open(manifest)]
    with wds.ShardWriter(str(out / "train-%06d.tar"), maxsize=shard_size, maxcount=10**9, verbose=0) as sink:
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
                    sample["npy"] = npy_bytes(np.asarray(ids[i].ids, np.uint16))
                sink.write(sample)
    os.sync()
    write_s = time.perf_counter() - t
    return write_s, time_energon_prepare(out, workers=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=40_000)
    p.add_argument("--audio-files", type=int, default=300)
    p.add_argument("--dir", default="/tmp/bench_shard")
    p.add_argument(
        "--baseline",
        type=Path,
        help="another checkout (e.g. `git archive HEAD`) whose `dataio shard "
        "--workers 1` is timed in the same run, for before/after figures",
    )
    args = p.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    (root / "data").mkdir(parents=True)
    text, tokenizer = build_text(root / "data", args.docs)
    manifest = build_audio(root / "data", args.audio_files)
    samples = {"text": args.docs, "audio": args.audio_files}

    print(f"{'corpus':6} {'method':44} {'seconds':>8} {'MB/s':>8} {'samples/s':>10}")
    results = {}
    for corpus, inputs, tok in (("text", text, tokenizer), ("audio", manifest, None)):
        rows = {}
        for workers in (1, 2):
            out = root / f"{corpus}-dataio-{workers}"
            wall, own = run_dataio([inputs], out, workers, tok, SHARD_SIZE[corpus])
            rows[f"dataio shard --workers {workers}"] = (wall, tar_bytes(out))
            rows[f"  its own timer (plan + write) --workers {workers}"] = (own, tar_bytes(out))
        if args.baseline:
            out = root / f"{corpus}-baseline"
            wall, own = run_dataio([inputs], out, 1, tok, SHARD_SIZE[corpus], repo=args.baseline.resolve())
            rows["baseline dataio shard --workers 1"] = (wall, tar_bytes(out))
            rows["  baseline's own timer --workers 1"] = (own, tar_bytes(out))
        out = root / f"{corpus}-wds"
        write_s, prepare_s = run_shardwriter(inputs, out, tok, corpus == "audio", SHARD_SIZE[corpus])
        size = tar_bytes(out)
        rows["ShardWriter"] = (write_s, size)
        rows["energon prepare"] = (prepare_s, size)
        rows["ShardWriter + energon prepare"] = (write_s + prepare_s, size)
        for name, (seconds, size) in rows.items():
            print(f"{corpus:6} {name:44} {seconds:8.2f} {size / 1e6 / seconds:8.1f} {samples[corpus] / seconds:10.0f}")
        results[corpus] = rows
        for d in root.glob(f"{corpus}-*"):
            shutil.rmtree(d)
    dd_mb = max(256, int(results["audio"]["dataio shard --workers 1"][1] / 2**20))
    dd = dd_write_mb_per_s(root, dd_mb)
    print(f"disk   dd bs=1M count={dd_mb} conv=fdatasync{'':17} {'':8} {dd:8.1f}")
    for corpus, rows in results.items():
        peer = rows["ShardWriter + energon prepare"][0]
        for workers in (1, 2):
            seconds, size = rows[f"dataio shard --workers {workers}"]
            line = f"{corpus}: dataio shard --workers {workers} is {peer / seconds:.2f}x faster than ShardWriter + energon prepare"
            if corpus == "audio":
                own = rows[f"  its own timer (plan + write) --workers {workers}"][0]
                line += (
                    f"; {size / 1e6 / seconds / dd:.2f}x of dd's MB/s end to end, "
                    f"{size / 1e6 / own / dd:.2f}x by its own timer"
                )
            print(line)
        if args.baseline:
            print(
                f"{corpus}: this checkout's --workers 1 is {rows['baseline dataio shard --workers 1'][0] / rows['dataio shard --workers 1'][0]:.2f}x "
                "the baseline's speed end to end"
            )


if __name__ == "__main__":
    main()
