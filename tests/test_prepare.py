"""Unit tests of the shard writer's parts: the ustar writer, sizes, splits, planning and nodes."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

from headrace.dataio.prepare.readers import Entry
from headrace.dataio.prepare.plan import assign_splits, key_hashes, parse_splits, plan_job, resolve_node
from headrace.dataio.sizes import parse_size
from headrace.dataio.shards.tarwriter import TarWriter, tar_header


def test_tar_writer_offsets_match_tarfile_and_headers_are_fixed():
    buf = io.BytesIO()
    tar = TarWriter(buf, sha256=True)
    long_name = "deep/" * 30 + "key.flac"  # > 100 bytes: uses the ustar prefix field
    payloads = {"a.txt": b"hello", long_name: b"x" * 1000, "b.json": b"", "c.npy": bytes(range(256)) * 3}
    spans = {name: tar.add(name, data) for name, data in payloads.items()}
    size = tar.close()
    data = buf.getvalue()
    assert size == len(data) and size % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        members = t.getmembers()
        assert [m.name for m in members] == list(payloads)
        for m in members:
            assert (m.offset_data, m.size) == (spans[m.name].offset, spans[m.name].size)
            assert (m.mtime, m.uid, m.gid, m.mode, m.uname, m.gname) == (0, 0, 0, 0o644, "", "")
            assert t.extractfile(m).read() == payloads[m.name]
    import hashlib

    assert tar.hexdigest() == hashlib.sha256(data).hexdigest()


def test_tar_header_limits():
    with pytest.raises(ValueError, match="too long"):
        tar_header("x" * 101, 1)
    with pytest.raises(ValueError, match="ustar limit"):
        tar_header("a.bin", 8**11)


@pytest.mark.parametrize(
    "text, value",
    [("512MB", 512_000_000), ("1GiB", 1 << 30), ("100k", 100_000), ("4096", 4096), ("1.5 GB", 1_500_000_000)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_and_splits_reject_bad_values():
    for bad in ("", "12XB", "-1MB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError, match="sum to 1"):
        parse_splits("train=0.9,val=0.2")
    with pytest.raises(ValueError, match="NAME=FRACTION"):
        parse_splits("train")
    assert parse_splits(None) == [("train", 1.0)]


def test_split_assignment_is_a_function_of_the_key():
    keys = [f"doc-{i}" for i in range(20000)]
    splits = parse_splits("train=0.9,val=0.05,test=0.05")
    a = assign_splits(key_hashes(keys), splits)
    b = assign_splits(key_hashes(keys[::-1]), splits)[::-1]
    np.testing.assert_array_equal(a, b)
    fractions = np.bincount(a, minlength=3) / len(keys)
    np.testing.assert_allclose(fractions, [0.9, 0.05, 0.05], atol=0.01)


class FakeInput:
    def __init__(self, path, sizes):
        self.path, self.sizes = path, sizes

    def scan(self):
        for i, size in enumerate(self.sizes):
            yield Entry(key=f"{self.path}-{i}", est_bytes=size, line=i + 1)


def test_plan_cuts_by_size_and_count_and_assigns_nodes_round_robin():
    inputs = [FakeInput("a", [100] * 10), FakeInput("b", [250] * 4)]
    plan = plan_job(inputs, splits=[("train", 1.0)], shard_bytes=500, samples_per_shard=None)
    assert [len(s.entries) for s in plan.shards] == [5, 5, 2, 2]
    assert all(s.est_bytes <= 500 for s in plan.shards)
    assert [s.name for s in plan.shards] == [f"train-{i:06d}.tar" for i in range(4)]
    by_count = plan_job(inputs, splits=[("train", 1.0)], shard_bytes=None, samples_per_shard=6)
    assert [len(s.entries) for s in by_count.shards] == [6, 6, 2]
    nodes = [[s.name for s in by_count.for_node(2, r)] for r in range(2)]
    assert nodes == [["train-000000.tar", "train-000002.tar"], ["train-000001.tar"]]
    one_big = plan_job([FakeInput("c", [10_000])], splits=[("train", 1.0)], shard_bytes=500, samples_per_shard=None)
    assert [len(s.entries) for s in one_big.shards] == [1]  # an oversized sample still gets a shard


def test_resolve_node_from_flags_and_slurm():
    assert resolve_node(None, None, env={}) == (1, 0)
    assert resolve_node(4, 3, env={"SLURM_ARRAY_TASK_COUNT": "9", "SLURM_ARRAY_TASK_ID": "1"}) == (4, 3)
    assert resolve_node(
        None, None, env={"SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1"}
    ) == (4, 2)
    assert resolve_node(None, None, env={"SLURM_NTASKS": "8", "SLURM_PROCID": "5"}) == (8, 5)
    with pytest.raises(ValueError, match="outside"):
        resolve_node(2, 2, env={})


def _encoded(fmt: str, subtype: str, channels: int, rate: int, frames: int) -> bytes:
    import soundfile as sf

    rng = np.random.default_rng(channels * rate + frames)
    out = io.BytesIO()
    sf.write(out, (0.2 * rng.standard_normal((frames, channels))).astype(np.float32), rate, format=fmt, subtype=subtype)
    return out.getvalue()


AUDIO_VARIANTS = [
    ("FLAC", "PCM_16", 1, 16000, 8000),
    ("FLAC", "PCM_24", 2, 44100, 5000),
    ("FLAC", "PCM_S8", 1, 8000, 3000),
    ("WAV", "PCM_16", 1, 16000, 7001),
    ("WAV", "PCM_24", 2, 22050, 3000),
    ("WAV", "FLOAT", 1, 48000, 4000),
    ("WAV", "DOUBLE", 2, 16000, 1000),
    ("WAV", "PCM_U8", 1, 8000, 999),
    ("WAVEX", "PCM_16", 3, 16000, 2000),
    ("WAV", "ULAW", 1, 8000, 800),
]


@pytest.mark.parametrize("fmt, subtype, channels, rate, frames", AUDIO_VARIANTS)
def test_header_probe_agrees_with_libsndfile(tmp_path, fmt, subtype, channels, rate, frames):
    """The header parser is a fast path: where it answers, libsndfile (the oracle) gives the same
    sample rate and frame count; where it does not, probe falls back to libsndfile."""
    import soundfile as sf

    from headrace.dataio.shards.audioheader import HEADER_BYTES, parse_header, probe, probe_file

    data = _encoded(fmt, subtype, channels, rate, frames)
    parsed = parse_header(data[:HEADER_BYTES], len(data))
    if subtype == "ULAW":  # compressed WAV: libsndfile's
        assert parsed is None
    else:
        assert parsed == (rate, frames)
    path = tmp_path / "a.bin"
    path.write_bytes(data)
    assert probe(data) == (rate, frames) and probe_file(path) == (rate, frames, len(data))
    info = sf.info(io.BytesIO(data))
    assert (info.samplerate, info.frames) == (rate, frames)


def _wav_with_list() -> bytes:
    from tests.hostile import list_info, riff, wav_chunks

    pcm = np.random.default_rng(1).integers(-3000, 3000, (4000, 1), dtype=np.int16)
    fmt, data = wav_chunks(pcm, 16000)
    return riff(fmt, list_info(), (b"JUNK", bytes(6)), data)


@pytest.mark.parametrize(
    "fmt, subtype", [("FLAC", "PCM_16"), ("FLAC", "PCM_24"), ("WAV", "PCM_16"), ("WAV", "FLOAT"), ("WAV", "LIST")]
)
def test_header_probe_on_damaged_headers_never_disagrees_with_libsndfile(fmt, subtype):
    """Random damage to the first 200 bytes (float WAV: fmt, fact, PEAK; the LIST case: fmt, LIST, JUNK):
    where the parser answers, libsndfile reads the same rate and length and, for a WAV, the same
    samples the loader reads in place (``wav_format``'s data offset)."""
    import soundfile as sf

    from headrace.dataio.shards.audioheader import HEADER_BYTES, parse_header, wav_format

    data = _wav_with_list() if subtype == "LIST" else _encoded(fmt, subtype, 1, 16000, 4000)
    rng = np.random.default_rng(0)
    answered = 0
    for trial in range(400):
        damaged = bytearray(data)
        for _ in range(1 + trial % 3):
            damaged[int(rng.integers(0, 200))] = int(rng.integers(0, 256))
        if trial % 5 == 0:
            damaged = damaged[: int(rng.integers(20, len(data)))]
        parsed = parse_header(bytes(damaged[:HEADER_BYTES]), len(damaged))
        if parsed is None:
            continue  # probe() asks libsndfile
        answered += 1
        f = io.BytesIO(bytes(damaged))
        info = sf.info(f)
        assert parsed == (info.samplerate, info.frames), f"trial {trial}"
        wav = wav_format(bytes(damaged[:HEADER_BYTES]), len(damaged))
        if wav is not None and wav.channels == 1 and (wav.tag, wav.bits) in ((1, 16), (3, 32)):
            dtype = "<i2" if wav.tag == 1 else "<f4"
            in_place = np.frombuffer(damaged, dtype, count=wav.frames, offset=wav.data_offset)
            f.seek(0)
            decoded = sf.read(f, dtype="int16" if wav.tag == 1 else "float32")[0]
            assert np.array_equal(in_place, decoded, equal_nan=wav.tag == 3), f"trial {trial}"
    assert answered > 50  # the fast path still answers for most harmless changes


def test_wav_chunks_before_data_are_skipped_only_where_libsndfile_goes_past_them():
    """Each chunk kind the parser skips, well formed (skipped: the parser answers what libsndfile reads)
    and in forms libsndfile refuses (a short fact, a PEAK for another channel count, a LIST with data
    inside or sub-chunks that overrun it) or that the parser does not vouch for: left to libsndfile."""
    import soundfile as sf

    from headrace.dataio.shards.audioheader import parse_header
    from tests.hostile import list_info, peak_chunk, riff, wav_chunks

    fmt, data = wav_chunks(np.zeros((1000, 2), np.float32), 8000)
    isft = list_info()[1][4:]  # the LIST's ISFT sub-chunk
    skipped = {
        "fact": [(b"fact", bytes(4))],
        "PEAK": [peak_chunk(2)],
        "LIST INFO": [list_info()],
        "LIST adtl": [(b"LIST", b"adtl" + b"labl" + (6).to_bytes(4, "little") + bytes(6))],
        "short LIST": [(b"LIST", b"INFO")],
        "LIST under 4 bytes": [(b"LIST", b"IN")],
        "JUNK": [(b"JUNK", bytes(9))],
        "bext": [(b"bext", bytes(602))],
    }
    refused = {
        "short fact": [fmt, (b"fact", bytes(2))],
        "PEAK for 1 channel": [fmt, peak_chunk(1)],
        "PEAK before fmt": [peak_chunk(2), fmt],
        "data inside LIST": [fmt, (b"LIST", b"INFO" + b"data" + (8).to_bytes(4, "little") + bytes(8))],
        "LIST overrun": [fmt, (b"LIST", b"INFO" + isft + bytes(3))],
    }
    unvouched = {"LIST of another type": [(b"LIST", b"wavl" + isft)], "cue": [(b"cue ", bytes(4))]}
    for name, chunks in skipped.items():
        payload = riff(fmt, *chunks, data)
        info = sf.info(io.BytesIO(payload))
        assert parse_header(payload, len(payload)) == (info.samplerate, info.frames) == (8000, 1000), name
    for name, chunks in refused.items():
        payload = riff(*chunks, data)
        assert parse_header(payload, len(payload)) is None, name
        with pytest.raises(sf.LibsndfileError):
            sf.info(io.BytesIO(payload))
    for name, chunks in unvouched.items():
        payload = riff(fmt, *chunks, data)
        assert parse_header(payload, len(payload)) is None, name


def test_corrupt_audio_is_unreadable():
    from headrace.dataio.shards.audioheader import probe

    with pytest.raises(ValueError, match="unreadable audio"):
        probe(b"fLaC" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="no samples"):
        probe(_encoded("WAV", "PCM_16", 1, 16000, 10)[:44])


def _tar_of(stream_factory, payloads, **kw):
    stream = stream_factory()
    tar = TarWriter(stream, **kw)
    spans = [tar.add(name, payload) for name, payload in payloads]
    tar.close()
    return stream, spans, tar.hexdigest()


@pytest.mark.parametrize("unsupported", [(), ("copy_file_range",), ("copy_file_range", "sendfile")])
def test_file_payloads_give_the_same_bytes_as_in_memory_ones(tmp_path, monkeypatch, unsupported):
    import errno
    import hashlib
    import os

    from headrace.dataio.shards.tarwriter import FilePayload

    rng = np.random.default_rng(3)
    sources = []
    for i, size in enumerate([0, 1, 511, 512, 70_000, 3 << 20]):
        path = tmp_path / f"src{i}.bin"
        path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        sources.append((f"k{i}.flac", path))
    in_memory = [(name, p.read_bytes()) for name, p in sources] + [("k9.json", b"{}")]
    as_files = [(name, FilePayload(path=str(p), size=p.stat().st_size)) for name, p in sources] + [("k9.json", b"{}")]
    reference, ref_spans, _ = _tar_of(io.BytesIO, in_memory)

    def refuse(*args):
        raise OSError(errno.ENOSYS, "not here")

    for name in unsupported:
        monkeypatch.setattr(os, name, refuse)
    with open(tmp_path / "out.tar", "wb", buffering=1 << 20) as f:
        tar = TarWriter(f)
        spans = [tar.add(name, payload) for name, payload in as_files]
        tar.close()
    assert (tmp_path / "out.tar").read_bytes() == reference.getvalue() and spans == ref_spans
    hashed, _, digest = _tar_of(io.BytesIO, as_files, sha256=True)  # no descriptor, hashing: through Python
    assert hashed.getvalue() == reference.getvalue() and digest == hashlib.sha256(reference.getvalue()).hexdigest()


def test_a_file_payload_that_shrank_is_an_error(tmp_path):
    from headrace.dataio.shards.tarwriter import FilePayload

    path = tmp_path / "a.flac"
    path.write_bytes(b"x" * 1000)
    with open(tmp_path / "out.tar", "wb") as f:
        with pytest.raises(OSError, match=r"a\.flac has 1000 bytes, expected 2000"):
            TarWriter(f).add("a.flac", FilePayload(path=str(path), size=2000))


@pytest.mark.parametrize(
    "array",
    [
        np.arange(10, dtype="<u2"),
        np.arange(70_000, dtype="<i4"),
        np.zeros(0, "<u2"),
        np.zeros((3, 4), "<f4"),
        np.asfortranarray(np.ones((2, 3), ">i8")),
    ],
)
def test_npy_writer_matches_np_save_and_header_parser_matches_numpy(array):
    from numpy.lib import format as npy_format

    from headrace.dataio.shards.formats import npy_bytes
    from headrace.dataio.shards.formats import npy_header

    saved = io.BytesIO()
    np.save(saved, array)
    if array.ndim == 1:
        assert npy_bytes(array) == saved.getvalue()
    f = io.BytesIO(saved.getvalue())
    npy_format.read_magic(f)
    shape, fortran, dtype = npy_format.read_array_header_1_0(f)
    assert npy_header(saved.getvalue()) == (shape, fortran, dtype, f.tell())
    odd = saved.getvalue().replace(b"'descr'", b"'descr' ", 1)  # valid, not canonical: numpy's reader answers
    odd = odd[:8] + (int.from_bytes(odd[8:10], "little") + 1).to_bytes(2, "little") + odd[10:]
    assert npy_header(odd)[:3] == (shape, fortran, dtype)
