"""Loader throughput: headrace beside webdataset and the page-cache read limit, in one run.

Data: real text (the demo corpus's documents: package READMEs and standard-library docstrings, a
natural long-tailed length distribution), byte-level tokenised to int32 ``tokens.npy`` members and
written as WebDataset tars with ``webdataset.TarWriter``, then indexed with ``headrace.dataio.shards.tarscan``. Built
once under ``--data-dir``.

Measured, each for one epoch, median of ``--repeats`` (warm page cache, after one untimed warm-up):
- ``page cache``: every tar read into one preallocated buffer (``readinto``): the ceiling.
- ``webdataset``: ``wds.WebDataset(tars).decode()`` (``.npy`` to numpy), one process.
- ``headrace``: ``build_loader`` with batch_size 256, in one process and with 2 workers, unshuffled
  and shuffled (whole epoch, start-up included); plus time to the first batch, the steady rate after
  it, and peak RSS of the main process and of the workers.
- CPU microseconds per sample in the main process and in the workers (user + system, from
  ``getrusage``): unlike samples/s, CPU time does not depend on what else runs on the machine, so it
  shows what workers cost on a shared machine.
- audio: synthetic ~90 KB FLAC utterances, read as raw bytes (``decode.audio: raw`` leaves them
  encoded) by headrace and by webdataset (no decode), beside the page-cache read of the same tars.
- shuffle quality of headrace's window permutation beside webdataset's shard shuffle + buffer of the
  same size (see ``shuffle_quality``).

    .venv/bin/python -m tools.bench_loader --docs 50000 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

import numpy as np


def build_corpus(root: Path, docs: int, per_shard: int, min_chars: int = 0) -> None:
    """``docs`` documents of the installed docs' text as int32 byte tokens in WebDataset shards of
    ``per_shard``; ``min_chars`` > 0 joins consecutive texts until each document has at least that many
    characters (``--min-chars 3000`` gives the issue-17 harness's mean of ~13 KB of int32 tokens)."""
    import io

    import webdataset as wds

    from headrace.dataio.shards.index import merge_parts
    from headrace.dataio.shards.tarscan import scan_shard
    from headrace.dataio.bench.documents import select_documents

    texts = [d.text for d in select_documents(docs)]
    if min_chars > 0:
        texts = _joined(texts, min_chars)
    while len(texts) < docs:  # the installed docs run out: repeat them (same length distribution)
        texts += texts[: docs - len(texts)]
    root.mkdir(parents=True, exist_ok=True)
    for s in range(0, docs, per_shard):
        with wds.TarWriter(str(root / f"text-{s // per_shard:06d}.tar")) as w:
            for i in range(s, min(s + per_shard, docs)):
                buf = io.BytesIO()
                np.save(buf, np.frombuffer(texts[i].encode(), np.uint8).astype(np.int32))
                w.write({"__key__": f"d{i:08d}", "tokens.npy": buf.getvalue()})
    names = sorted(p.name for p in root.glob("*.tar"))
    merge_parts([scan_shard(root, n) for n in names]).save(root)


def _joined(texts: list[str], min_chars: int) -> list[str]:
    out, parts, size = [], [], 0
    for t in texts:
        parts.append(t)
        size += len(t)
        if size >= min_chars:
            out.append("\n\n".join(parts))
            parts, size = [], 0
    return out


def build_audio_corpus(root: Path, utterances: int, per_shard: int) -> None:
    """Synthetic speech-like FLAC (16 kHz mono, 1-10 s, mean ~4.5 s: voiced harmonics under a
    syllable-rate envelope plus noise), sized like real utterances (~90 KB); no decoding is timed."""
    import io

    import soundfile
    import webdataset as wds

    from headrace.dataio.shards.index import merge_parts
    from headrace.dataio.shards.tarscan import scan_shard

    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for s in range(0, utterances, per_shard):
        with wds.TarWriter(str(root / f"audio-{s // per_shard:06d}.tar")) as w:
            for i in range(s, min(s + per_shard, utterances)):
                n = int(np.clip(rng.lognormal(np.log(4.0), 0.45), 1, 10) * 16000)
                t = np.arange(n) / 16000
                f0 = 110 + 40 * np.sin(2 * np.pi * 0.7 * t)
                voice = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / 16000) / k for k in range(1, 6))
                wave = 0.2 * voice * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t)) + 0.02 * rng.standard_normal(n)
                buf = io.BytesIO()
                soundfile.write(buf, wave.astype(np.float32), 16000, format="FLAC", subtype="PCM_16")
                w.write({"__key__": f"u{i:08d}", "flac": buf.getvalue()})
    names = sorted(p.name for p in root.glob("*.tar"))
    merge_parts([scan_shard(root, n) for n in names]).save(root)


def page_cache(tars: list[Path]) -> float:
    from headrace.dataio.bench.pagecache import read_seconds

    return read_seconds(tars)


def webdataset_epoch(tars: list[Path]) -> tuple[float, int]:
    import webdataset as wds

    t = time.perf_counter()
    n = sum(1 for _ in wds.WebDataset([str(p) for p in tars], shardshuffle=False).decode())
    return time.perf_counter() - t, n


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its reaped children (the workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def webdataset_bytes_epoch(tars: list[Path]) -> float:
    import webdataset as wds

    t = time.perf_counter()
    sum(1 for _ in wds.WebDataset([str(p) for p in tars], shardshuffle=False))
    return time.perf_counter() - t


def headrace_bytes_epoch(root: Path, *, workers: int) -> tuple[float, int, float]:
    """Audio members as raw bytes (``decode.audio: raw`` leaves them encoded), batch_size 32:
    ``(seconds, samples, steady samples/s after the first batch)``."""
    from headrace.dataio import build_loader

    t = time.perf_counter()
    loader = build_loader(
        {
            "datasets": [{"path": str(root)}],
            "batch_size": 32,
            "epochs": 1,
            "num_workers": workers,
            "shuffle": False,
            "decode": {"audio": "raw"},
        }
    )
    n, first, first_n = 0, None, 0
    for batch in loader:
        n += len(batch["__key__"])
        if first is None:
            first, first_n = time.perf_counter(), n
    end = time.perf_counter()
    return end - t, n, (n - first_n) / (end - first)


def headrace_epoch(root: Path, *, workers: int, shuffle: bool) -> dict:
    import gc

    from headrace.dataio import build_loader

    cpu0 = cpu_seconds()
    t = time.perf_counter()
    loader = build_loader(
        {
            "datasets": [{"path": str(root)}],
            "batch_size": 256,
            "epochs": 1,
            "num_workers": workers,
            "shuffle": shuffle,
            "prefetch": 4,
        }
    )
    n, first, first_n, rss = 0, None, 0, []
    for i, batch in enumerate(loader):
        n += len(batch["__key__"])
        if first is None:
            first, first_n = time.perf_counter() - t, n
        if i % 40 == 0:
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    seconds = time.perf_counter() - t
    main_cpu = cpu_seconds()[0]  # before the collection below, which is the benchmark's, not the loader's
    del loader
    gc.collect()  # the DataLoader iterator is gone: its workers are joined, their CPU time counted
    workers_cpu = cpu_seconds()[1]
    return {
        "seconds": seconds,
        "samples": n,
        "first_batch_s": first,
        "rss_mb": rss,
        "steady_samples_per_s": round((n - first_n) / (seconds - first)),
        "cpu_us_per_sample": {
            "main": round((main_cpu - cpu0[0]) / n * 1e6, 2),
            "workers": round((workers_cpu - cpu0[1]) / n * 1e6, 2),
        },
    }


def shuffle_quality(source_order: np.ndarray) -> dict:
    """How well an epoch is mixed: the mean distance, in source (tar) order, between consecutive output
    samples (as a fraction of the epoch; a uniform random permutation gives ~1/3), and the rank
    correlation between output position and source position (0 for a uniform permutation)."""
    n = len(source_order)
    gap = float(np.abs(np.diff(source_order)).mean() / n)
    corr = float(np.corrcoef(np.arange(n), source_order)[0, 1])
    return {"mean_gap": round(gap, 4), "position_correlation": round(corr, 4)}


def headrace_shuffle_order(root: Path, window: int) -> np.ndarray:
    from headrace.dataio import build_loader

    loader = build_loader(
        {
            "datasets": [{"path": str(root)}],
            "batch_size": 1024,
            "epochs": 1,
            "num_workers": 0,
            "shuffle": True,
            "shuffle_window": window,
        }
    )
    return np.concatenate([b["__ref__"].numpy() for b in loader])


def webdataset_shuffle_order(tars: list[Path], buffer: int) -> np.ndarray:
    import webdataset as wds

    ds = wds.WebDataset([str(p) for p in tars], shardshuffle=len(tars), seed=0).shuffle(buffer, initial=buffer)
    return np.array([int(s["__key__"][1:]) for s in ds])


def worker_round_trip(batches: int = 2000) -> tuple[float, float, float]:
    """``(wall ms, main CPU us, worker CPU us)`` per batch through 2 workers for a batch with no payload
    (keys and two small tensors, one batch a message): the fixed cost a worker batch pays before any
    data moves. CPU includes forking and joining the workers, spread over ``batches``."""
    import torch

    from headrace.dataio.stream.reading.workers import RankBatches, iterate

    keys = [f"d{i:08d}" for i in range(256)]
    main0, kids0 = cpu_seconds()
    stream = iterate(
        RankBatches(
            lambda b, alloc: {"__key__": keys, "__ref__": torch.arange(256)},
            first=0,
            last=batches,
            seed=0,
            dp_rank=0,
            epoch=0,
        ),
        num_workers=2,
        prefetch=4,
        pin_memory=False,
        timeout=60,
    )
    next(stream)
    t = time.perf_counter()
    n = sum(1 for _ in stream)
    wall = (time.perf_counter() - t) / n * 1e3
    main1, kids1 = cpu_seconds()  # the workers are joined once the stream ends: RUSAGE_CHILDREN has them
    return wall, (main1 - main0) / batches * 1e6, (kids1 - kids0) / batches * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="/tmp/headrace-bench/text")
    ap.add_argument("--docs", type=int, default=50000)
    ap.add_argument("--per-shard", type=int, default=2000)
    ap.add_argument(
        "--min-chars", type=int, default=0, help="join texts into documents of at least this many characters"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--audio-dir", default="/tmp/headrace-bench/audio")
    ap.add_argument("--utterances", type=int, default=3000)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    root = Path(args.data_dir)
    if not (root / ".nv-meta/headrace/manifest.json").exists():
        build_corpus(root, args.docs, args.per_shard, args.min_chars)
    tars = sorted(root.glob("*.tar"))
    total_bytes = sum(p.stat().st_size for p in tars)
    from headrace.dataio.shards.index import load_index

    n = len(load_index(root))
    page_cache(tars)  # warm the page cache
    results = {
        "samples": n,
        "mean_sample_kb": total_bytes / n / 1024,
        "page cache": statistics.median(n / page_cache(tars) for _ in range(args.repeats)),
    }
    results["webdataset"] = statistics.median(n / webdataset_epoch(tars)[0] for _ in range(args.repeats))
    details = {}
    for name, workers, shuffle in [
        ("headrace, 1 process", 0, False),
        ("headrace, 2 workers", 2, False),
        ("headrace, shuffled, 1 process", 0, True),
        ("headrace, shuffled, 2 workers", 2, True),
    ]:
        runs = [headrace_epoch(root, workers=workers, shuffle=shuffle) for _ in range(args.repeats)]
        assert all(r["samples"] == n for r in runs), "an epoch must serve every sample once"
        results[name] = statistics.median(r["samples"] / r["seconds"] for r in runs)
        details[name] = {
            "first_batch_s": statistics.median(r["first_batch_s"] for r in runs),
            "steady_samples_per_s": statistics.median(r["steady_samples_per_s"] for r in runs),
            "cpu_us_per_sample": runs[-1]["cpu_us_per_sample"],
            "main_rss_mb_over_epoch": runs[-1]["rss_mb"][:: max(1, len(runs[-1]["rss_mb"]) // 5)],
        }
    wall, main_cpu, worker_cpu = worker_round_trip()
    details["worker round trip, no payload, ms/batch"] = round(wall, 3)
    details["worker round trip, no payload, CPU us/batch (main, workers)"] = [round(main_cpu), round(worker_cpu)]
    details["worker_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    for window in (1000, 8192):
        details[f"shuffle quality, headrace window {window}"] = shuffle_quality(headrace_shuffle_order(root, window))
        details[f"shuffle quality, webdataset buffer {window}"] = shuffle_quality(
            webdataset_shuffle_order(tars, window)
        )
    audio_root = Path(args.audio_dir)
    if not (audio_root / ".nv-meta/headrace/manifest.json").exists():
        build_audio_corpus(audio_root, args.utterances, 500)
    audio_tars = sorted(audio_root.glob("*.tar"))
    n_audio = len(load_index(audio_root))
    page_cache(audio_tars)
    audio_kb = sum(p.stat().st_size for p in audio_tars) / n_audio / 1024
    results[f"audio page cache ({audio_kb:.0f} KB/sample)"] = statistics.median(
        n_audio / page_cache(audio_tars) for _ in range(args.repeats)
    )
    results["audio bytes, webdataset, 1 process"] = statistics.median(
        n_audio / webdataset_bytes_epoch(audio_tars) for _ in range(args.repeats)
    )
    for workers in (0, 2):
        runs = [headrace_bytes_epoch(audio_root, workers=workers) for _ in range(args.repeats)]
        assert all(n == n_audio for _, n, _ in runs)
        name = f"audio bytes, headrace, {workers or 1} {'workers' if workers else 'process'}"
        results[name] = statistics.median(n / sec for sec, n, _ in runs)
        details[f"{name}: steady samples/s"] = round(statistics.median(steady for _, _, steady in runs))
    if args.json:
        print(json.dumps({"samples_per_s": results, "details": details}, indent=1))
        return
    print(f"{n} samples, mean {results['mean_sample_kb']:.1f} KB, {len(tars)} shards, {os.cpu_count()} cores")
    for k, v in results.items():
        if k not in ("samples", "mean_sample_kb"):
            print(f"{k:32s} {v:12,.0f} samples/s")
    for k, v in details.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
