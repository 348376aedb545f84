"""One adapter per loader: its own format, written by its own writer, read by its documented fast path,
each batch built as the output contract (``headrace.dataio.bench.contract``) by the cheapest code that does.

Every adapter is a ``Peer``: ``prepare(data)`` writes the loader's format from the benchmarked shards
(cached under ``data.work/<name>`` with a stamp of the source, so reruns skip it) and ``open(data,
workers, shuffle, state)`` returns an iterator of contract batches, ``data.cfg.batch_size`` samples each.
Peers decode only the counted member (``data.field``); the contract has nothing else.

- ``headrace``: ``build_loader`` on the shard directory (``epochs: 1``), its batches turned into the
  contract by ``contract.from_headrace`` (views: no copy for tokens). ``headrace-full`` is the same
  loader measured in its full batch layout (keys, references, validity, positions, every member),
  counted off that layout. Worker count ``auto`` is headrace's own: ``auto_workers`` makes the loader's
  measurement (``headrace.dataio.worker_count``) on the same config, and the run uses the count it chose.
- ``headrace-dali`` (audio, beside ``dali`` in ``--compare``): the same loader with ``decode.audio:
  dali``, each batch's audio decoded by DALI inside the loader (``headrace.dataio.stream.reading.dali``).
- ``webdataset``: ``wds.WebDataset(tars).decode(only=[field]).to_tuple(field).batched(B,
  collation_fn=contract)`` in ``wds.WebLoader``: webdataset's own decoder (``np.load`` for ``.npy``) and
  its own batching stage (shards split over workers by webdataset's ``split_by_worker``).
- ``energon``: ``get_loader(get_train_dataset(dir, batch_size=B, repeat=False))`` on the same directory
  (its ``.nv-meta`` comes from ``dataio shard`` / ``dataio index``): a ``CrudeWebdataset`` whose cooker
  decodes the one member, batched by energon's own batching stage (the task encoder's ``batch``).
- ``litdata``: ``litdata.optimize`` into litdata chunks holding each sample's member as raw bytes
  (token ids without the ``.npy`` header: litdata's ``bytes`` serializer, no pickle, no copy on read),
  read with ``StreamingDataset`` + ``StreamingDataLoader``; ``np.frombuffer`` + the contract's
  concatenation as ``collate_fn``.
- ``lhotse`` (audio only): ``CutSet.to_shar`` (lhotse's Shar writer, audio re-encoded to FLAC) read
  back with ``CutSet.from_shar`` + ``SimpleCutSampler`` + ``IterableDatasetWrapper`` in a DataLoader,
  lhotse's documented Shar recipe: every worker iterates the whole Shar (no shard split), so with
  workers the bench stops at the epoch's sample count.
- ``dali`` (audio only): DALI's ``fn.readers.webdataset`` on the tars + ``fn.decoders.audio`` on CPU,
  ``num_workers`` mapped to DALI threads (the decoded-audio target is "at least DALI's"); in audio-bytes
  mode the reader alone, its encoded buffers handed over.
- ``torch``: a map-style ``Dataset`` over the same tars (member offsets found once with ``tarfile``,
  payloads read with ``os.pread``) in a plain ``DataLoader`` with ``batch_size=B``.

Shuffled runs use each loader's own mechanism (webdataset/energon: shard shuffle + a 1,000-sample
buffer; litdata/lhotse/torch: their ``shuffle=True``; headrace: ``shuffle: true``).

Audio-bytes mode (``decode.audio: raw``): every adapter hands over the tar's encoded audio bytes; lhotse
is skipped, since its Shar holds audio re-encoded by lhotse, not the source bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import io
import json
import os
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from headrace.dataio.stagetimes import TIMES
from headrace.dataio.bench import contract
from headrace.dataio.bench.data import BenchData, count_full
from headrace.dataio.bench.extra import INSTALL
from headrace.dataio.config import DataConfig
from headrace.dataio.loader import Loader, build_loader
from headrace.dataio.stream.reading.decode import decode_audio
from headrace.dataio.worker_count import AUTO, WorkerChoice, choose

SHUFFLE_BUFFER = 1000


@dataclass(kw_only=True)
class Peer:
    name: str
    module: str  # the import that must exist (its absence is a reported skip)
    kinds: tuple[str, ...]  # "text", "audio"
    open: Callable[[BenchData, int, bool, Any], Iterator[dict]]
    # what ``num_workers: auto`` resolves to for ``open``'s config (None: the peer has no such setting)
    auto_workers: Callable[[BenchData, bool], WorkerChoice] | None = None
    prepare: Callable[[BenchData], Any] | None = None  # returns the state open() needs (or None)
    install: str = ""  # the hint printed when the module is missing
    source_bytes: bool = True  # can hand over the source's encoded audio bytes (audio-bytes mode)
    # (samples, units) of one batch: the contract's count unless the peer yields another layout
    count: Callable[[dict, BenchData], tuple[int, float]] | None = None


def skip_reason(peer: Peer, data: BenchData) -> str | None:
    """Why ``peer`` cannot run on ``data`` (not installed, or not for this kind of data), else None."""
    try:
        importlib.import_module(peer.module)
    except ImportError as e:  # absent, or present without a dependency it imports
        return f"not installed ({peer.install or f'pip install {peer.module}'}): {e}"
    if data.kind not in peer.kinds:
        return f"{peer.name} does not load {data.kind} data"
    if data.audio_bytes and not peer.source_bytes:
        return f"{peer.name} re-encodes the audio into its own format: its bytes are not the source's"
    return None


def count(peer: Peer, batch: dict, data: BenchData) -> tuple[int, float]:
    """(samples, units) of one of ``peer``'s batches."""
    return peer.count(batch, data) if peer.count is not None else contract.count(batch, data.contract)


# ------------------------------------------------------------------------------ the contract's pieces


def decode_member(data: BenchData, payload: bytes) -> Any:
    """The counted member decoded as a user of a raw-bytes loader would: ``np.load`` for tokens, soundfile
    (+ soxr) for audio, nothing in audio-bytes mode."""
    if data.kind == "text":
        return np.load(io.BytesIO(payload), allow_pickle=False)
    return payload if data.audio_bytes else decode_audio(payload, data.decode)


def batch_of(data: BenchData, values: list) -> dict:
    """The contract batch of decoded members (``decode_member``'s values)."""
    if data.kind == "text":
        return contract.token_batch(values)
    if data.audio_bytes:
        return contract.bytes_batch(values)
    return contract.audio_batch([a.waveform for a in values], values[0].sample_rate)


# --------------------------------------------------------------------------------------- tar walking


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's member naming: ``dir/key.ext.ext2`` -> (``dir/key``, ``ext.ext2``)."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext


def tar_offsets(path: Path) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """``[(key, {ext: (payload offset, size)})]`` of one tar, with Python's ``tarfile`` (headers only)."""
    samples: list[tuple[str, dict[str, tuple[int, int]]]] = []
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, ext = split_name(member.name)
            if not samples or samples[-1][0] != key:
                samples.append((key, {}))
            samples[-1][1][ext] = (member.offset_data, member.size)
    return samples


def tar_samples(path: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {ext: payload})`` of one tar in order."""
    with open(path, "rb") as f:
        for key, members in tar_offsets(path):
            yield key, {ext: os.pread(f.fileno(), size, offset) for ext, (offset, size) in members.items()}


def _stamp(data: BenchData) -> str:
    return json.dumps(
        {"samples": data.samples, "bytes": data.bytes, "shards": [(p.name, p.stat().st_mtime_ns) for p in data.shards]}
    )


def _cached(data: BenchData, name: str, write: Callable[[Path], None]) -> Path:
    """``data.work/name``, written by ``write(tmp)`` unless a complete copy of the same source exists.
    The stamp lives beside the folder (readers such as lhotse's Shar list every file inside) and is
    written last, so a stamp means a complete copy."""
    out, stamp = data.work / name, data.work / f"{name}.source.json"
    if stamp.exists() and out.is_dir() and stamp.read_text() == _stamp(data):
        return out
    stamp.unlink(missing_ok=True)
    tmp = data.work / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    os.replace(tmp, out)
    stamp.write_text(_stamp(data))
    return out


# ------------------------------------------------------------------------------------------ headrace


def headrace_config(data: BenchData, workers: int | str, shuffle: bool) -> DataConfig:
    # Peers do not pack: the comparison is of plain batches (packing none, no seq_len: with seq_len the
    # loader makes THD rows, one document each); the trainer path, --trainer, packs.
    return dataclasses.replace(data.cfg, num_workers=workers, shuffle=shuffle, epochs=1, packing="none", seq_len=None)


def open_headrace_full(data: BenchData, workers: int, shuffle: bool, state: Any) -> Iterator[dict]:
    return iter(build_loader(headrace_config(data, workers, shuffle), dp_rank=0, dp_size=1))


def open_headrace(data: BenchData, workers: int, shuffle: bool, state: Any) -> Iterator[dict]:
    kind, field, rate = data.contract, data.field, data.decode.sample_rate
    for batch in open_headrace_full(data, workers, shuffle, state):
        out = contract.from_headrace(batch, field, kind, rate)
        if TIMES in batch:  # the loader's stage seconds, for the run's stage fractions (not a batch field)
            out[TIMES] = batch[TIMES]
        del batch  # held here, the batch would keep its memory (or ring bytes) while the next is made
        yield out


def auto_headrace(data: BenchData, shuffle: bool) -> WorkerChoice:
    return choose(
        headrace_config(data, AUTO, shuffle), functools.partial(Loader, dp_rank=0, dp_size=1), dp_rank=0, dp_size=1
    )


def _with_dali(data: BenchData) -> BenchData:
    """headrace with ``decode.audio: dali``: members read by headrace, each batch decoded by DALI."""
    decode = dataclasses.replace(data.decode, audio="dali")
    return dataclasses.replace(data, cfg=dataclasses.replace(data.cfg, decode=decode))


def open_headrace_dali(data: BenchData, workers: int, shuffle: bool, state: Any) -> Iterator[dict]:
    return open_headrace(_with_dali(data), workers, shuffle, state)


def auto_headrace_dali(data: BenchData, shuffle: bool) -> WorkerChoice:
    return auto_headrace(_with_dali(data), shuffle)


# ---------------------------------------------------------------------------------------- webdataset


def _wds_member(data: BenchData, key: str, payload: bytes):
    """webdataset's decoder handler for the counted member (the others are never decoded); webdataset
    passes the member's extension with a leading dot."""
    return decode_member(data, payload) if key.lstrip(".") == data.field else None


def _wds_collate(data: BenchData, rows: list[tuple]) -> dict:
    return batch_of(data, [row[0] for row in rows])


def open_webdataset(data: BenchData, workers: int, shuffle: bool, state: Any) -> Iterator[dict]:
    import webdataset as wds

    ds = wds.WebDataset(
        [str(p) for p in data.shards],
        shardshuffle=len(data.shards) if shuffle else False,
        empty_check=False,
        seed=0 if shuffle else None,
    )
    if shuffle:
        ds = ds.shuffle(SHUFFLE_BUFFER)
    ds = (
        ds.decode(functools.partial(_wds_member, data), only=[data.field])
        .to_tuple(data.field)
        .batched(data.cfg.batch_size, collation_fn=functools.partial(_wds_collate, data), partial=True)
    )
    return iter(wds.WebLoader(ds, batch_size=None, num_workers=workers))


# ------------------------------------------------------------------------------------------ energon


@functools.cache
def _energon_encoder_class():
    from megatron.energon import Cooker, DefaultTaskEncoder, Sample, stateless
    from megatron.energon.edataclass import edataclass

    @edataclass
    class Decoded(Sample):
        value: Any

    class BenchEncoder(DefaultTaskEncoder):
        decoder = None  # raw member bytes; the cooker decodes the one member like every raw-bytes peer

        def __init__(self, data: BenchData):
            super().__init__()
            self.data = data

            @stateless
            def cook(crude: dict) -> Decoded:
                return Decoded(
                    __key__=crude["__key__"],
                    __restore_key__=crude["__restore_key__"],
                    __subflavors__=crude.get("__subflavors__"),
                    __sources__=crude.get("__sources__"),
                    value=decode_member(data, crude[data.field]),
                )

            self.cookers = [Cooker(cook)]

        def batch(self, samples: list) -> dict:
            return batch_of(self.data, [s.value for s in samples])

    return BenchEncoder


def open_energon(data: BenchData, workers: int, shuffle: bool, state: Any) -> Iterator[dict]:
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    ds = get_train_dataset(
        str(data.root),
        split_part=data.split,
        worker_config=wc,
        batch_size=data.cfg.batch_size,
        shuffle_buffer_size=SHUFFLE_BUFFER if shuffle else None,
        max_samples_per_sequence=100 if shuffle else None,
        repeat=False,
        task_encoder=_energon_encoder_class()(data),
    )
    return iter(get_loader(ds))


# ------------------------------------------------------------------------------------------- litdata


def _litdata_rows(field: str, text: bool, shard: str) -> Iterator[bytes]:
    """litdata ``optimize`` fn: one tar -> each sample's counted member as raw bytes (token ids without the
    ``.npy`` header for text, the encoded member for audio)."""
    for _, members in tar_samples(Path(shard)):
        payload = members[field]
        yield np.load(io.BytesIO(payload), allow_pickle=False).tobytes() if text else payload


def _token_dtype(data: BenchData) -> str | None:
    """The dtype of the counted token member (from the first sample's ``.npy`` header); None for audio."""
    if data.kind != "text":
        return None
    _, members = next(tar_samples(data.shards[0]))
    return np.load(io.BytesIO(members[data.field]), allow_pickle=False).dtype.str


def prepare_litdata(data: BenchData) -> tuple[Path, str | None]:
    def write(tmp: Path) -> None:
        from litdata import optimize

        optimize(
            fn=functools.partial(_litdata_rows, data.field, data.kind == "text"),
            inputs=[str(p) for p in data.shards],
            output_dir=str(tmp),
            chunk_bytes="64MB",
            num_workers=1,
            mode="overwrite",
            verbose=False,
            reorder_files=False,
            start_method="fork",
        )

    return _cached(data, "litdata", write), _token_dtype(data)


def _litdata_collate(data: BenchData, dtype: str | None, items: list) -> dict:
    if dtype is not None:
        return contract.token_batch([np.frombuffer(item, dtype=dtype) for item in items])
    return batch_of(data, [decode_member(data, item) for item in items])


def open_litdata(data: BenchData, workers: int, shuffle: bool, state: tuple[Path, str | None]) -> Iterator[dict]:
    from litdata import StreamingDataLoader, StreamingDataset

    path, dtype = state
    ds = StreamingDataset(str(path), shuffle=shuffle, seed=0)
    return iter(
        StreamingDataLoader(
            ds,
            batch_size=data.cfg.batch_size,
            num_workers=workers,
            collate_fn=functools.partial(_litdata_collate, data, dtype),
        )
    )


# -------------------------------------------------------------------------------------------- lhotse


def prepare_lhotse(data: BenchData) -> Path:
    def write(tmp: Path) -> None:
        from lhotse import CutSet, Recording

        def cuts():
            for shard in data.shards:
                for key, members in tar_samples(shard):
                    rec = Recording.from_bytes(members[data.field], recording_id=key.replace("/", "_"))
                    yield rec.to_cut()

        CutSet(cuts()).to_shar(str(tmp), fields={"recording": "flac"}, shard_size=1000, verbose=False)

    return _cached(data, "lhotse", write)


class LhotseAudio(torch.utils.data.Dataset):
    """lhotse's dataset contract: ``__getitem__`` gets a CutSet (one sampler batch) and collates it."""

    def __init__(self, data: BenchData):
        self.rate = data.decode.sample_rate

    def __getitem__(self, cuts) -> dict:
        waves, rate = [], None
        for cut in cuts:
            if self.rate is not None and cut.sampling_rate != self.rate:
                cut = cut.resample(self.rate)
            waves.append(cut.load_audio()[0])
            rate = cut.sampling_rate
        return contract.audio_batch(waves, rate)


def open_lhotse(data: BenchData, workers: int, shuffle: bool, state: Path) -> Iterator[dict]:
    from lhotse import CutSet
    from lhotse.dataset import IterableDatasetWrapper, SimpleCutSampler

    cuts = CutSet.from_shar(in_dir=str(state), shuffle_shards=shuffle, seed=0)
    sampler = SimpleCutSampler(cuts, max_cuts=data.cfg.batch_size, shuffle=shuffle, seed=0)
    wrapped = IterableDatasetWrapper(LhotseAudio(data), sampler)
    return iter(torch.utils.data.DataLoader(wrapped, batch_size=None, num_workers=workers))


# --------------------------------------------------------------------------------------------- torch


class TarSamples(torch.utils.data.Dataset):
    """Map-style dataset over tars: sample ``i``'s counted member read by offset (``os.pread``), decoded."""

    def __init__(self, data: BenchData, index: list[tuple[int, int, int]]):
        self.paths, self.index, self.data = [str(p) for p in data.shards], index, data
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:
        if self._pid != os.getpid():  # a forked worker opens its own descriptors
            self._fds, self._pid = {}, os.getpid()
        shard, offset, size = self.index[i]
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(self.paths[shard], os.O_RDONLY)
        return decode_member(self.data, os.pread(fd, size, offset))


def prepare_torch(data: BenchData) -> list[tuple[int, int, int]]:
    """``(shard, offset, size)`` of every sample's counted member."""
    return [(s, *members[data.field]) for s, path in enumerate(data.shards) for _, members in tar_offsets(path)]


def open_torch(data: BenchData, workers: int, shuffle: bool, state: list) -> Iterator[dict]:
    generator = torch.Generator().manual_seed(0)
    return iter(
        torch.utils.data.DataLoader(
            TarSamples(data, state),
            batch_size=data.cfg.batch_size,
            shuffle=shuffle,
            num_workers=workers,
            collate_fn=functools.partial(batch_of, data),
            generator=generator,
        )
    )


# ---------------------------------------------------------------------------------------------- dali


def open_dali(data: BenchData, workers: int, shuffle: bool, state: Any) -> Iterator[dict]:
    """DALI's own tar reader + ``fn.decoders.audio`` on CPU (``device_id=None``), ``max(1, workers)``
    threads standing in for worker processes; the last batch is padded by the reader and trimmed here.
    In audio-bytes mode the reader's encoded buffers are handed over undecoded."""
    from nvidia.dali import fn, pipeline_def, types

    decode, batch_size = data.decode, data.cfg.batch_size
    resample = {"sample_rate": float(decode.sample_rate)} if decode.sample_rate else {}

    @pipeline_def(batch_size=batch_size, num_threads=max(1, workers), device_id=None, prefetch_queue_depth=2)
    def pipeline():
        encoded = fn.readers.webdataset(
            paths=[str(p) for p in data.shards],
            ext=[data.field],
            name="reader",
            random_shuffle=shuffle,
            initial_fill=SHUFFLE_BUFFER,
            seed=0,
            pad_last_batch=True,
            missing_component_behavior="error",
        )
        if data.audio_bytes:
            return encoded
        audio, rate = fn.decoders.audio(encoded, downmix=decode.mono, dtype=types.FLOAT, **resample)
        return audio, rate

    pipe = pipeline()
    pipe.build()

    def batches() -> Iterator[dict]:
        left = data.samples
        while left > 0:
            outputs = pipe.run()
            n = min(batch_size, left)
            if data.audio_bytes:
                yield contract.bytes_batch([np.array(outputs[0].at(i)) for i in range(n)])
            else:
                audio, rate = outputs
                yield contract.audio_batch([np.array(audio.at(i)).reshape(-1) for i in range(n)], int(rate.at(0)))
            left -= n

    return batches()


PEERS: dict[str, Peer] = {
    p.name: p
    for p in [
        Peer(
            name="headrace",
            module="headrace.dataio",
            kinds=("text", "audio"),
            open=open_headrace,
            auto_workers=auto_headrace,
        ),
        Peer(
            name="headrace-full",
            module="headrace.dataio",
            kinds=("text", "audio"),
            open=open_headrace_full,
            auto_workers=auto_headrace,
            count=count_full,
        ),
        Peer(name="webdataset", module="webdataset", kinds=("text", "audio"), open=open_webdataset, install=INSTALL),
        Peer(name="energon", module="megatron.energon", kinds=("text", "audio"), open=open_energon, install=INSTALL),
        Peer(
            name="litdata",
            module="litdata",
            kinds=("text", "audio"),
            open=open_litdata,
            prepare=prepare_litdata,
            install="pip install --no-deps litdata lightning-utilities; pip install boto3 requests "
            "(litdata's declared deps pull another torch)",
        ),
        Peer(
            name="lhotse",
            module="lhotse",
            kinds=("audio",),
            open=open_lhotse,
            prepare=prepare_lhotse,
            source_bytes=False,
        ),
        Peer(name="torch", module="torch", kinds=("text", "audio"), open=open_torch, prepare=prepare_torch),
        Peer(
            name="dali", module="nvidia.dali", kinds=("audio",), open=open_dali, install="pip install 'headrace[dali]'"
        ),
        Peer(
            name="headrace-dali",
            module="nvidia.dali",
            kinds=("audio",),
            open=open_headrace_dali,
            auto_workers=auto_headrace_dali,
            install="pip install 'headrace[dali]'",
        ),
    ]
}


def prepare(peer: Peer, data: BenchData) -> tuple[Any, float]:
    """(the peer's prepared state, seconds it took; ~0 when cached)."""
    start = time.perf_counter()
    state = peer.prepare(data) if peer.prepare is not None else None
    return state, time.perf_counter() - start


__all__ = [
    "PEERS",
    "Peer",
    "batch_of",
    "count",
    "decode_member",
    "prepare",
    "skip_reason",
    "split_name",
    "tar_offsets",
    "tar_samples",
]
