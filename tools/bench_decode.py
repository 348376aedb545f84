"""Decoded-audio throughput: headrace's loader (0 and N workers) vs NVIDIA DALI's own CPU reader (N threads).

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench_decode --rounds 5 --baseline /tmp/before

Cases (each a shard directory built once by ``headrace.dataio.bench.synth`` under ``--data``, ``--hours`` of
``corpus.speech_like`` utterances of 3-6 s, 16-bit): FLAC at 16 kHz, WAV at 16 kHz, FLAC at 24 kHz
(resampled to 16 kHz by every path). Paths, all decoding to float32 mono at 16 kHz:

- ``headrace w0`` / ``headrace wN``: ``build_loader`` over the shards (``decode.audio: soundfile``,
  batch ``--batch-size``, no shuffle), ``num_workers`` 0 and N: batches as the trainer gets them;
- ``baseline w0`` / ``baseline wN``: the same against another checkout (``--baseline DIR``, e.g.
  ``git archive main | tar -x -C DIR``), run as this script with ``PYTHONPATH=DIR``;
- ``dali tN``: ``fn.readers.webdataset`` on the same tars + ``fn.decoders.audio`` (downmix, resample
  to 16 kHz, float) + ``fn.pad``, CPU only (``device_id=None``), ``num_threads`` N, batches copied once
  into a torch tensor (DALI reuses its buffers): DALI's best case.

Every measurement is its own process (``--epoch``), so no path inherits another's state: one loader
(or DALI pipeline) runs ``--epochs`` epochs and all but the first are timed (page cache, worker
processes, their ring, the pipeline and libraries warm): samples/s, and CPU milliseconds per sample
of the process and its worker processes, all threads (``psutil`` for running workers, ``getrusage``
once they are joined): the figure that holds on a loaded, shared machine. Start-up (forking workers,
building the DALI pipeline) falls in the first epoch and is not counted: in training it is paid once.
The paths run interleaved, one measurement each per round, ``--rounds`` rounds; medians are printed
as a markdown table, one row per case and path.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = {"flac16": ("flac", 16000), "wav16": ("wav", 16000), "flac24": ("flac", 24000)}
TARGET_RATE = 16000


def cpu_seconds() -> float:
    """CPU seconds so far of this process (all threads) and of its children: the running ones (the
    loader's workers, by ``psutil``) and the ones that ended and were waited for (``getrusage``)."""
    import psutil

    own, ended = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:  # ended just now: in the next getrusage
            pass
    return total


def audio_ext(shards: Path) -> str:
    """The audio member's extension in a case's tars (``flac`` or ``wav``)."""
    return next(ext for ext in ("flac", "wav") if (shards.parent / f"{shards.name}-{ext}").exists())


def headrace_batches(shards: Path, workers: int, batch_size: int, count: int, epochs: int):
    """The loader's batches over ``epochs`` epochs as (batch tensor, lengths): one loader, its workers
    and their shared-memory ring kept from one epoch to the next, as in training."""
    from headrace.dataio import build_loader

    ext = audio_ext(shards)
    cfg = {
        "datasets": [{"path": str(shards)}],
        "batch_size": batch_size,
        "shuffle": False,
        "epochs": epochs,
        "num_workers": workers,
        "decode": {"sample_rate": TARGET_RATE},
    }
    for batch in build_loader(cfg, dp_rank=0, dp_size=1):
        yield batch[ext], batch["__lengths__"][ext]


def dali_batches(shards: Path, threads: int, batch_size: int, count: int, epochs: int):
    """DALI's batches over ``epochs`` epochs as (batch tensor, lengths), from one pipeline."""
    import numpy as np
    import torch
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import feed_ndarray

    tars = sorted(str(p) for p in shards.glob("*.tar"))
    ext = audio_ext(shards)

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, prefetch_queue_depth=2)
    def pipeline():
        encoded = fn.readers.webdataset(paths=tars, ext=[ext], name="reader", pad_last_batch=True)
        audio, _ = fn.decoders.audio(encoded, downmix=True, dtype=types.FLOAT, sample_rate=float(TARGET_RATE))
        return fn.pad(audio, axes=(0,)), audio

    pipe = pipeline()
    pipe.build()
    for _ in range(epochs):
        left = count
        while left > 0:
            padded, unpadded = pipe.run()
            dense = padded.as_tensor()
            out = feed_ndarray(dense, torch.empty(dense.shape(), dtype=torch.float32))
            n = min(batch_size, left)
            lengths = np.array([s[0] for s in unpadded.shape()[:n]], dtype=np.int64)
            left -= n
            yield out[:n], lengths


def run_epoch(path: str, shards: Path, batch_size: int, epochs: int) -> dict:
    """``epochs`` epochs of ``path`` (``headrace:N`` or ``dali:N``): figures of all but the first."""
    import soundfile
    import torch

    from headrace.dataio.shards.index import load_index

    torch.set_num_threads(1)
    kind, n = path.split(":")
    count = len(load_index(shards).samples)
    batches = (dali_batches if kind == "dali" else headrace_batches)(shards, int(n), batch_size, count, epochs)
    seen = 0
    while seen < count:  # the first epoch: start-up, page cache, pipeline and libraries warm
        seen += len(next(batches)[1])
    start, cpu, timed = time.perf_counter(), cpu_seconds(), 0
    for _, lengths in batches:
        timed += len(lengths)
    wall = time.perf_counter() - start
    del batches  # the loader's workers are joined, so RUSAGE_CHILDREN holds their CPU time
    cpu = cpu_seconds() - cpu
    if seen + timed != count * epochs:
        raise AssertionError(f"{path} delivered {seen + timed} of {count * epochs} samples")
    return {
        "wall_s": wall,
        "samples_after_first": timed,
        "samples": count,
        "cpu_s": cpu,
        "libsndfile": soundfile._ffi.string(soundfile._snd.sf_version_string()).decode(),
    }


def build_cases(data: Path, hours: float) -> dict[str, Path]:
    from headrace.dataio.bench.synth import write_speech

    out = {}
    for name, (fmt, rate) in CASES.items():
        shards = data / name / "speech"
        if not (shards / ".nv-meta").exists():
            write_speech(shards, hours, fmt=fmt, rate=rate)
        out[name] = shards
    return out


def measure(path: str, shards: Path, batch_size: int, epochs: int, repo: Path | None) -> dict:
    """One ``--epoch`` process of this script (against ``repo``'s dataio when given)."""
    env = dict(os.environ, PYTHONPATH=str(repo or Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--epoch",
        path,
        "--shards",
        str(shards),
        "--batch-size",
        str(batch_size),
        "--epochs",
        str(epochs),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{path} on {shards} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--data", type=Path, default=Path("/tmp/headrace-bench-decode"), help="cases are built here once")
    p.add_argument("--hours", type=float, default=1.0, help="hours of speech per case")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, from " + ",".join(CASES))
    p.add_argument("--workers", type=int, default=2, help="headrace worker processes = DALI threads")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    p.add_argument("--epochs", type=int, default=3, help="per measurement; the first is not timed")
    p.add_argument("--baseline", type=Path, help="another checkout to time beside this one")
    p.add_argument("--json", type=Path, help="also write every measurement here")
    p.add_argument("--epoch", help=argparse.SUPPRESS)  # internal: one measurement, headrace:N or dali:N
    p.add_argument("--shards", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.epoch:
        print(json.dumps(run_epoch(args.epoch, args.shards, args.batch_size, args.epochs)))
        return 0

    cases = build_cases(args.data, args.hours)
    w = args.workers
    paths = {"headrace w0": ("headrace:0", None), f"headrace w{w}": (f"headrace:{w}", None)}
    if args.baseline:
        paths.update(
            {
                "baseline w0": ("headrace:0", args.baseline.resolve()),
                f"baseline w{w}": (f"headrace:{w}", args.baseline.resolve()),
            }
        )
    paths[f"dali t{w}"] = (f"dali:{w}", None)
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for case in args.cases.split(","):
            for name, (path, repo) in paths.items():
                runs.setdefault((case, name), []).append(measure(path, cases[case], args.batch_size, args.epochs, repo))
        print(f"round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({f"{c}|{n}": v for (c, n), v in runs.items()}, indent=1))
    print(
        f"\n{args.rounds} rounds, batch {args.batch_size}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the end\n"
    )
    print("| case | path | libsndfile | samples/s | CPU ms / sample | x dali (samples/s) | x dali (CPU) |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for case in args.cases.split(","):
        rate = {n: statistics.median(x["samples_after_first"] / x["wall_s"] for x in runs[(case, n)]) for n in paths}
        cpu = {
            n: statistics.median(x["cpu_s"] / x["samples_after_first"] * 1e3 for x in runs[(case, n)]) for n in paths
        }
        dali = f"dali t{w}"
        for n in paths:
            lib = runs[(case, n)][0]["libsndfile"].removeprefix("libsndfile-") if not n.startswith("dali") else "-"
            print(
                f"| {case} | {n} | {lib} | {rate[n]:,.0f} | {cpu[n]:.3f} | {rate[n] / rate[dali]:.2f} | "
                f"{cpu[dali] / cpu[n]:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
