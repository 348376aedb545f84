"""Re-read every shard of a directory and check it against the index and energon's metadata (``dataio verify``).

Per shard (in ``workers`` processes): the file size and, where recorded, the sha256; a fresh header
scan (``headrace.dataio.shards.tarscan``: header checksums, truncation) whose samples, keys, byte spans and member
offsets must equal the index rows; then every member must decode as the loader will decode it (audio:
every frame through libsndfile, to the length its header declares; ``.npy`` header without pickle and
with a matching size; ``.json`` parses; ``.txt`` is UTF-8).
Per dataset: each ``.tar.idx``, the ``index.sqlite`` rows and ``.info.json``'s shard counts must
agree with the index. The first fault of each shard is kept, naming its shard, sample key and byte
offset (``dataio verify`` prints them and exits with status 1). Cost: one sequential read of every byte
(sha256 / decode), which is the point, plus a full decode of every audio member (16 kHz FLAC: ~2 ms of CPU
per second of audio, ``tools.bench_reliability_checks``; ``--workers`` spreads shards over processes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from headrace.dataio.shards.index import META_DIR, DatasetIndex
from headrace.dataio.shards.metadata import energon_spans
from headrace.dataio.shards.audioheader import check_decodes
from headrace.dataio.shards.formats import AUDIO_EXTENSIONS, npy_header
from headrace.dataio.shards.tarscan import TarFormatError, open_tar, scan_buffer
from headrace.dataio.stream.reading.decode import PICKLE_EXTENSIONS, check_token_document, decode_npy
from headrace.dataio.interrupts import leave_interrupt_to_parent


@dataclass(frozen=True)
class Fault:
    shard: str
    key: str | None
    offset: int
    reason: str

    def __str__(self) -> str:
        where = f"sample {self.key!r} at byte {self.offset}" if self.key is not None else f"byte {self.offset}"
        return f"{self.shard}: {where}: {self.reason}"


@dataclass(kw_only=True)
class ShardExpectation:
    """What the index says about one shard, in energon's terms (spans end at the next sample)."""

    name: str
    bytes: int
    sha256: str | None
    keys: list[str]
    offsets: np.ndarray
    spans: np.ndarray
    members: list[list[tuple[str, int, int]]]  # per sample: (ext, payload offset, size)


def _expectations(index) -> list[ShardExpectation]:
    _, spans, _ = energon_spans(index)
    out = []
    shard_of = np.asarray(index.samples["shard"])
    for i, info in enumerate(index.shards):
        rows = np.flatnonzero(shard_of == i)
        out.append(
            ShardExpectation(
                name=info.name,
                bytes=info.bytes,
                sha256=info.sha256,
                keys=[index.key(j) for j in rows],
                offsets=index.samples["offset"][rows].astype(np.int64),
                spans=spans[rows],
                members=[sorted((e, o, s) for e, (o, s) in index.sample_members(j).items()) for j in rows],
            )
        )
    return out


def verify_shard(root: Path, expect: ShardExpectation) -> Fault | None:
    """The first fault in one shard, or None (the shard is mapped once: checksum, header scan, decodes)."""
    path = root / expect.name
    if not path.is_file():
        return Fault(expect.name, None, 0, "shard file is missing")
    size = path.stat().st_size

    def key_at(offset: int) -> str | None:
        i = int(np.searchsorted(expect.offsets, offset, side="right")) - 1
        return expect.keys[i] if 0 <= i < len(expect.keys) else None

    if expect.bytes and size != expect.bytes:
        at = min(size, expect.bytes)
        return Fault(
            expect.name, key_at(at), at, f"file is {size} bytes, the index says {expect.bytes} (truncated or replaced)"
        )

    buf = open_tar(path)
    try:
        if expect.sha256 and hashlib.sha256(buf).hexdigest() != expect.sha256:
            return Fault(expect.name, None, 0, "sha256 differs from the one recorded at write time")
        try:
            part = scan_buffer(buf, expect.name, path=path, lengths=False)
        except TarFormatError as e:
            return Fault(expect.name, key_at(e.offset), e.offset, e.reason)
        for i, key in enumerate(part.keys.tolist()):
            key = key.decode("utf-8", "surrogateescape")
            if i >= len(expect.keys):
                return Fault(
                    expect.name,
                    key,
                    int(part.samples["offset"][i]),
                    f"tar has more samples than the index ({len(expect.keys)})",
                )
            offset = int(expect.offsets[i])
            if key != expect.keys[i] or int(part.samples["offset"][i]) != offset:
                return Fault(
                    expect.name,
                    expect.keys[i],
                    offset,
                    f"index says sample {expect.keys[i]!r} starts here; the tar has {key!r} "
                    f"at byte {int(part.samples['offset'][i])}",
                )
            if int(part.samples["size"][i]) != int(expect.spans[i]):
                return Fault(
                    expect.name,
                    key,
                    offset,
                    f"sample spans {int(part.samples['size'][i])} bytes, the index says {int(expect.spans[i])}",
                )
            start, count = int(part.samples["member_start"][i]), int(part.samples["member_count"][i])
            found = sorted(
                (part.extensions[m["ext"]], int(m["offset"]), int(m["size"]))
                for m in part.members[start : start + count]
            )
            if found != expect.members[i]:
                return Fault(expect.name, key, offset, f"members {found} differ from the index {expect.members[i]}")
            for ext, member_offset, member_size in found:
                reason = decode_check(ext, buf[member_offset : member_offset + member_size])
                if reason is not None:
                    return Fault(expect.name, key, member_offset, f"member .{ext} does not decode: {reason}")
        if len(part.keys) < len(expect.keys):
            i = len(part.keys)
            return Fault(
                expect.name,
                expect.keys[i],
                int(expect.offsets[i]),
                f"tar has {len(part.keys)} samples, the index says {len(expect.keys)}",
            )
    finally:
        if not isinstance(buf, bytes):
            buf.close()
    return None


def verify_metadata(root: Path, index, expectations: list[ShardExpectation]) -> Fault | None:
    """Energon's ``.tar.idx`` files, ``index.sqlite`` and ``.info.json`` against the index."""
    _, _, shard_end = energon_spans(index)
    for expect, end in zip(expectations, shard_end.tolist()):
        idx_path = root / (expect.name + ".idx")
        if not idx_path.is_file():
            return Fault(expect.name, None, 0, f"{idx_path.name} is missing (run `dataio index`)")
        entries = np.fromfile(idx_path, dtype="=u8").astype(np.int64)
        wanted = np.append(expect.offsets, end)
        n = min(len(entries), len(wanted))
        diff = np.flatnonzero(entries[:n] != wanted[:n])
        if len(diff) or len(entries) != len(wanted):
            bad = int(diff[0]) if len(diff) else n
            key = expect.keys[bad] if bad < len(expect.keys) else None
            return Fault(
                expect.name,
                key,
                int(wanted[min(bad, len(wanted) - 1)]),
                f"{idx_path.name} entry {bad} disagrees with the index",
            )
    meta = root / META_DIR
    try:
        counts = json.loads((meta / ".info.json").read_text())["shard_counts"]
    except (OSError, ValueError, KeyError) as e:
        return Fault(META_DIR, None, 0, f".info.json unreadable: {e}")
    wanted_counts = {e.name: len(e.keys) for e in expectations}
    if counts != wanted_counts:
        return Fault(META_DIR, None, 0, f".info.json shard_counts {counts} differ from the index {wanted_counts}")
    db = sqlite3.connect(f"file:{meta / 'index.sqlite'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT tar_file_id, sample_key, sample_index, byte_offset, byte_size "
            "FROM samples ORDER BY tar_file_id, sample_index"
        )
        for shard_id, expect in enumerate(expectations):
            for i, key in enumerate(expect.keys):
                row = rows.fetchone()
                wanted = (shard_id, key, i, int(expect.offsets[i]), int(expect.spans[i]))
                if row != wanted:
                    return Fault(
                        expect.name,
                        key,
                        int(expect.offsets[i]),
                        f"index.sqlite row {row} differs from the index {wanted}",
                    )
        if rows.fetchone() is not None:
            return Fault(META_DIR, None, 0, "index.sqlite has more samples than the index")
        parts = db.execute("SELECT COUNT(*) FROM sample_parts").fetchone()[0]
        if parts != len(index.members):
            return Fault(META_DIR, None, 0, f"index.sqlite has {parts} sample parts, the index {len(index.members)}")
    except sqlite3.Error as e:
        return Fault(META_DIR, None, 0, f"index.sqlite unreadable: {e}")
    finally:
        db.close()
    return None


def verify_dir(
    root: Path,
    index: DatasetIndex,
    *,
    workers: int,
    track: Callable[[Iterable, int], Iterator] = lambda items, total: iter(items),
) -> list[Fault]:
    """Every shard's first fault, then the metadata's, in shard order (empty: the directory is sound).
    Shards are read by ``workers`` processes; ``track(results, total)`` wraps the per-shard results
    (a progress bar)."""
    expectations = _expectations(index)
    workers = min(workers, len(expectations))
    with (
        ProcessPoolExecutor(workers, initializer=leave_interrupt_to_parent) if workers > 1 else contextlib.nullcontext()
    ) as pool:
        results = (pool.map if pool else map)(verify_shard, [root] * len(expectations), expectations)
        faults = [f for f in track(results, len(expectations)) if f is not None]
    meta_fault = verify_metadata(root, index, expectations)
    if meta_fault is not None:
        faults.append(meta_fault)
    return faults


def decode_check(ext: str, payload) -> str | None:
    """Why a member does not decode (None when it does): audio decoded whole by libsndfile, every frame,
    to the length its header declares (``headrace.dataio.shards.audioheader.check_decodes``), ``.npy`` header without
    pickle and with a size that matches its shape, ``.json`` parses, ``.txt`` is UTF-8."""
    # the loader's own decoders and token rule, so that verify passes no member the loader refuses
    last = ext.rsplit(".", 1)[-1].lower()
    try:
        if last in PICKLE_EXTENSIONS:
            return "a pickle-based member: the loader never loads one (store tensors as .npy)"
        if last in AUDIO_EXTENSIONS:
            check_decodes(payload)  # raises for unreadable audio, audio without samples, a damaged frame
        elif last == "npy":
            shape, _, dtype, header = npy_header(payload)
            expected = header + math.prod(shape) * dtype.itemsize
            if expected != len(payload):
                return f"npy header says {expected} bytes, member has {len(payload)}"
            tensor = decode_npy(payload)
            if tensor.ndim == 1 and not (tensor.dtype.is_floating_point or tensor.dtype == torch.bool):
                check_token_document(tensor)  # a 1-D integer array is a document of token ids to packing
        elif last == "json":
            json.loads(bytes(payload))
        elif last == "txt":
            bytes(payload).decode("utf-8")
    except Exception as e:  # soundfile raises its own LibsndfileError (a RuntimeError)
        return f"{type(e).__name__}: {e}"
    return None


__all__ = ["Fault", "ShardExpectation", "decode_check", "verify_dir", "verify_metadata", "verify_shard"]
