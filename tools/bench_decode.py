"""Decoded-audio throughput: soundfile (1 process, N worker processes) vs NVIDIA DALI CPU (N threads).

All paths decode the same FLAC utterances (speech-like synthetic audio, ~4.5 s at 16 kHz, ~90 KB each)
from one memory-mapped blob in page cache into float32 batches in the main process:

- ``soundfile``: ``dataio.stream.decode.decode_sample`` in a torch ``DataLoader`` (num_workers=0, then N),
  collated by the loader's ``dataio.stream.collate.collate_field`` (one flat tensor + lengths, allocated in
  shared memory inside a worker, so a batch crosses to the main process as a file descriptor).
- ``dali``: ``dataio.stream.dali.DaliAudioDecoder`` with ``num_threads=N``, ``device_id=None`` (CPU only),
  padded ``[B, T]`` batches as DALI returns them.

``--libsndfile PATH`` makes soundfile use another libsndfile build (e.g. the one DALI bundles) to
separate the codec build's speed from the pipeline's.

Prints, as medians of ``--repeats`` epochs with the paths interleaved: samples/s (each epoch timed from
its first batch, so worker start-up is not counted); CPU milliseconds per sample (all threads and worker
processes: the figure that holds on a shared, loaded machine); the ratio soundfile-with-N-workers /
DALI-N-threads. Plus the per-member cost of a 12.6 KB ``.npy`` token array (``decode_npy`` vs ``np.load``).

    .venv/bin/python -m tools.bench_decode --utterances 3000 --workers 2 --repeats 5
"""

from __future__ import annotations

import argparse
import io
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import soundfile
import torch

from dataio.bench.corpus import RATE, flac_bytes, speech_like
from dataio.bench.timing import best_interleaved, cpu_seconds, interleaved
from dataio.stream.collate import collate_field
from dataio.stream.workers import process_memory
from dataio.shards.formats import npy_bytes
from dataio.stream.decode import DaliConfig, DecodeConfig, decode_sample


def build_corpus(directory: Path, count: int, seed: int = 0) -> tuple[Path, np.ndarray]:
    """One blob of FLAC payloads + an offsets table (cached in ``directory`` between runs)."""
    blob, table = directory / f"utterances-{count}.bin", directory / f"utterances-{count}.json"
    if blob.exists() and table.exists():
        return blob, np.array(json.loads(table.read_text()), dtype=np.int64)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    offsets = [0]
    with open(blob.with_suffix(".tmp"), "wb") as f:
        for _ in range(count):
            offsets.append(offsets[-1] + f.write(flac_bytes(speech_like(rng, rng.uniform(3.0, 6.0)))))
    os.replace(blob.with_suffix(".tmp"), blob)
    table.write_text(json.dumps(offsets))
    return blob, np.array(offsets, dtype=np.int64)


class Utterances(torch.utils.data.Dataset):
    """Sample i = the decoded FLAC payload i of the blob (memory-mapped per process)."""

    def __init__(self, blob: Path, offsets: np.ndarray, cfg: DecodeConfig):
        self.blob, self.offsets, self.cfg, self._view = blob, offsets, cfg, None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def payload(self, i: int) -> memoryview:
        if self._view is None:  # opened lazily so that each worker maps the file itself
            with open(self.blob, "rb") as f:
                self._view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        return self._view[self.offsets[i] : self.offsets[i + 1]]

    def __getitem__(self, i: int) -> torch.Tensor:
        return decode_sample({"flac": self.payload(i)}, self.cfg, key=str(i))["flac"].waveform


def collate_waveforms(waves: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's own collation: one flat tensor (in shared memory inside a worker) plus lengths."""
    return collate_field(waves, process_memory())


def time_epoch(batches) -> tuple[float, int, float]:
    """Wall seconds from the first batch to the last and the samples after the first batch (start-up not
    counted); CPU milliseconds per sample over the whole epoch, workers included once they are joined."""
    cpu_start = sum(cpu_seconds())
    iterator = iter(batches)
    _, lengths = next(iterator)
    total, start, samples = len(lengths), time.perf_counter(), 0
    for _, lengths in iterator:
        samples += len(lengths)
    wall = time.perf_counter() - start
    del iterator  # joins DataLoader workers, so that RUSAGE_CHILDREN has their CPU time
    return wall, samples, (sum(cpu_seconds()) - cpu_start) / (total + samples) * 1e3


def soundfile_epochs(dataset: Utterances, batch_size: int, workers: int):
    """A callable that runs one epoch through a DataLoader with ``workers`` processes (kept alive)."""
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, num_workers=workers, collate_fn=collate_waveforms
    )  # not persistent: workers exit at the end of each epoch, so their CPU time can be counted
    return lambda: time_epoch(loader)


def dali_epochs(dataset: Utterances, batch_size: int, threads: int):
    """A callable that runs one epoch through ``DaliAudioDecoder`` with ``threads`` CPU threads."""
    from dataio.stream.dali import DaliAudioDecoder

    dali = DaliConfig(num_threads=threads, max_batch_size=batch_size)
    decoder = DaliAudioDecoder(DecodeConfig(audio="dali", sample_rate=dataset.cfg.sample_rate, dali=dali))

    def batches():
        for start in range(0, len(dataset), batch_size):
            out = decoder([dataset.payload(i) for i in range(start, min(start + batch_size, len(dataset)))])
            yield out.data, out.lengths

    return lambda: time_epoch(batches())


def npy_microseconds(count: int = 20000) -> dict[str, float]:
    """Per-member cost of a 12.6 KB int32 token array: headrace's zero-copy decode vs ``np.load``."""
    from dataio.stream.decode import decode_npy

    member = memoryview(bytearray(npy_bytes(np.arange(3150, dtype=np.int32))))
    paths = {
        "npy_headrace_us": lambda: decode_npy(member),
        "npy_numpy_load_us": lambda: torch.from_numpy(np.load(io.BytesIO(member), allow_pickle=False)),
    }

    def loop(decode) -> None:
        for _ in range(count):
            decode()

    loops = {name: (lambda decode=decode: loop(decode)) for name, decode in paths.items()}
    return {name: best / count * 1e6 for name, best in best_interleaved(loops, 3).items()}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--utterances", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=2, help="soundfile worker processes = DALI threads")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="epochs per path; the median is reported")
    parser.add_argument("--sample-rate", type=int, default=RATE, help="decode target (16000: no resampling)")
    parser.add_argument("--data", type=Path, default=Path("/tmp/headrace-bench-decode"))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--libsndfile", help="path of a libsndfile.so for soundfile to use instead of its own")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.libsndfile:  # soundfile has no public switch; its cffi handle is swapped before workers fork
        soundfile._snd = soundfile._ffi.dlopen(args.libsndfile)

    blob, offsets = build_corpus(args.data, args.utterances)
    sizes, seconds = np.diff(offsets), []
    dataset = Utterances(blob, offsets, DecodeConfig(sample_rate=args.sample_rate))
    for i in range(0, len(dataset), max(1, len(dataset) // 50)):
        seconds.append(soundfile.info(io.BytesIO(dataset.payload(i))).duration)
    results = {
        "utterances": len(dataset),
        "mean_kb": float(sizes.mean() / 1000),
        "mean_seconds": float(np.mean(seconds)),
        "sample_rate": args.sample_rate,
        "libsndfile": soundfile._ffi.string(soundfile._snd.sf_version_string()).decode()
        + ("" if args.libsndfile is None else f" ({args.libsndfile})"),
    }
    paths = {
        "soundfile_1_process": soundfile_epochs(dataset, args.batch_size, 0),
        f"soundfile_{args.workers}_workers": soundfile_epochs(dataset, args.batch_size, args.workers),
    }
    try:
        paths[f"dali_cpu_{args.workers}_threads"] = dali_epochs(dataset, args.batch_size, args.workers)
    except ImportError as e:
        print(f"DALI skipped: {e}", file=sys.stderr)
    # Interleaved repeats, so that load from other processes on a shared machine hits every path alike.
    epochs = interleaved(paths, args.repeats)  # name -> [(seconds, samples, CPU ms per sample)]
    results.update({name: statistics.median(n / sec for sec, n, _ in runs) for name, runs in epochs.items()})
    results.update({f"{name}_cpu_ms_per_sample": statistics.median(cpu for _, _, cpu in runs)
                    for name, runs in epochs.items()})
    if f"dali_cpu_{args.workers}_threads" in results:
        results["ratio_soundfile_workers_to_dali"] = (
            results[f"soundfile_{args.workers}_workers"] / results[f"dali_cpu_{args.workers}_threads"]
        )
    results.update(npy_microseconds())
    if args.json:
        print(json.dumps(results))
    else:
        for name, value in results.items():
            print(f"{name:44s} {value:,.2f}" if isinstance(value, float) else f"{name:44s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
