"""Audio decoded per batch straight into the batch tensor (``headrace.dataio.stream.reading.audio_batch``) gives the
values the per-sample ``decode_audio`` gives, bit for bit, drops bad members naming them, and collates
without a copy; ``decode.libsndfile`` picks a libsndfile build without changing values."""

import io

import numpy as np
import pytest
import soundfile
import torch

from headrace.dataio import libsndfile
from headrace.dataio.stream.reading.audio_batch import decode_pending, mean_decoded_bytes
from headrace.dataio.stream.reading.collate import collate, plain_memory
from headrace.dataio.stream.reading.decode import Audio, PendingAudio, decode_audio, decode_sample
from headrace.dataio.usererror import SampleDecodeError
from headrace.dataio.config import DecodeConfig

from tests.test_loader_audio import audio, waveforms  # noqa: F401  (the loader fixture and reader)

from tests.hostile import list_info, peak_chunk, riff, wav_chunks


def encode(rate: int, seconds: float, channels: int, fmt: str, subtype: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    wave = (0.3 * rng.standard_normal((int(rate * seconds), channels))).clip(-1, 1).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, wave, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


# (format, subtype, rate, channels): the WAV fast paths, libsndfile's direct read, downmix, resampling
CASES = [
    ("WAV", "PCM_16", 16000, 1),
    ("WAV", "FLOAT", 16000, 1),
    ("FLAC", "PCM_16", 16000, 1),
    ("FLAC", "PCM_24", 16000, 1),
    ("WAV", "PCM_24", 16000, 1),
    ("WAV", "PCM_16", 16000, 2),
    ("FLAC", "PCM_16", 22050, 1),
    ("WAV", "PCM_16", 24000, 2),
    ("FLAC", "PCM_16", 8000, 2),
]


def batch_of(payloads: list[bytes], cfg: DecodeConfig, alloc=plain_memory):
    samples = [
        decode_sample({"audio.wav" if p[:4] == b"RIFF" else "flac": p}, cfg, key=f"k{i}", defer_audio=True)
        for i, p in enumerate(payloads)
    ]
    keys = [f"k{i}" for i in range(len(samples))]
    failed = decode_pending(samples, keys, ["s.tar"] * len(samples), cfg, alloc)
    return samples, failed


@pytest.mark.parametrize("dtype", ["float32", "int16"])
def test_batch_decode_equals_per_sample_decode_and_is_collated_in_place(dtype):
    cfg = DecodeConfig(dtype=dtype)
    payloads = [encode(rate, 0.3 + 0.01 * i, ch, fmt, sub, seed=i) for i, (fmt, sub, rate, ch) in enumerate(CASES)]
    if dtype == "float32":  # soxr's int16 output of inputs this short varies by 1-2 from call to call
        # 3 frames at 22.05 kHz need 3 at 16 kHz too (rounded up): resampled all the same
        payloads += [encode(22050, 3.5 / 22050, 1, fmt, "PCM_16", seed=20) for fmt in ("FLAC", "WAV")]
    payloads = [p for p in payloads if not (dtype == "int16" and b"FLOAT" in p)]
    samples, failed = batch_of(payloads, cfg)
    assert not failed
    for payload, sample in zip(payloads, samples):
        (value,) = sample.values()
        expected = decode_audio(payload, cfg)
        assert isinstance(value, Audio) and value.sample_rate == expected.sample_rate == 16000
        assert value.waveform.dtype == expected.waveform.dtype
        assert torch.equal(value.waveform, expected.waveform)  # bit for bit, resampled ones included
    # Same-extension members lie end to end in one buffer: the batch tensor is that buffer, not a copy.
    flac = [s for s in samples if "flac" in s]
    batch = collate(
        flac,
        [str(i) for i in range(len(flac))],
        torch.zeros(len(flac), dtype=torch.int64),
        torch.ones(len(flac), dtype=torch.bool),
        end=0,
    )
    assert batch["flac"].data_ptr() == flac[0]["flac"].waveform.data_ptr()
    assert batch["__lengths__"]["flac"].tolist() == [len(s["flac"].waveform) for s in flac]
    assert torch.equal(batch["flac"], torch.cat([s["flac"].waveform for s in flac]))


def test_mono_16_bit_and_float_wavs_are_read_in_place_past_metadata_chunks(monkeypatch):
    """The in-place WAV read (no libsndfile) takes files built field by field, bare and with the chunks
    real writers put before ``data`` (libsndfile's float WAVs: fact + PEAK; ffmpeg's: LIST), and
    soundfile's own float WAV; each equals soundfile's decode. libsndfile is made to fail, so any
    fallback to it fails the test."""
    rng = np.random.default_rng(5)
    wave = (0.3 * rng.standard_normal((1601, 1))).clip(-1, 1).astype(np.float32)
    pcm = (wave * 0x7FFF).astype(np.int16)
    metadata = [(b"fact", (1601).to_bytes(4, "little")), peak_chunk(1), list_info(), (b"JUNK", bytes(7))]
    fmt, data = wav_chunks(wave, 16000)
    pcm_fmt, pcm_data = wav_chunks(pcm, 16000)
    payloads = [
        riff(fmt, data),
        riff(fmt, *metadata, data),
        encode(16000, 0.2, 1, "WAV", "FLOAT", seed=6),
        riff(pcm_fmt, list_info(), pcm_data),
    ]
    cfg = DecodeConfig()
    expected = [soundfile.read(io.BytesIO(p), dtype="float32")[0] for p in payloads]
    per_sample = [decode_audio(p, cfg).waveform for p in payloads]

    def libsndfile_opened(*args, **kwargs):
        raise AssertionError("the in-place WAV read fell back to libsndfile")

    monkeypatch.setattr(soundfile, "SoundFile", libsndfile_opened)
    samples, failed = batch_of(payloads, cfg)
    assert not failed
    for sample, want, ref in zip(samples, expected, per_sample):
        waveform = sample["audio.wav"].waveform
        assert torch.equal(waveform, torch.from_numpy(want)) and torch.equal(waveform, ref)


def test_chunks_libsndfile_refuses_are_left_to_it_and_named():
    """A PEAK chunk of the wrong size or before ``fmt `` is an error to libsndfile: the header parser
    does not skip it, so the member goes to libsndfile, whose complaint names shard, key and member."""
    wave = np.zeros((800, 1), np.float32)
    fmt, data = wav_chunks(wave, 16000)
    tag, body = peak_chunk(2)  # two channels' peaks in a mono file
    for payload in (riff(fmt, (tag, body), data), riff(peak_chunk(1), fmt, data)):
        with pytest.raises(SampleDecodeError, match=r"shard 's7.tar', key 'u3', member 'wav'.*PEAK"):
            decode_sample({"wav": payload}, DecodeConfig(), key="u3", shard="s7.tar", defer_audio=True)


def test_pending_only_where_the_header_is_understood():
    flac = encode(16000, 0.2, 1, "FLAC", "PCM_16", seed=0)
    assert isinstance(decode_sample({"flac": flac}, DecodeConfig(), defer_audio=True)["flac"], PendingAudio)
    # mono: false keeps [C, T] per sample; raw/dali leave bytes; ogg has no parsed header: decoded now
    assert isinstance(decode_sample({"flac": flac}, DecodeConfig(mono=False), defer_audio=True)["flac"], Audio)
    assert isinstance(decode_sample({"flac": flac}, DecodeConfig(audio="raw"), defer_audio=True)["flac"], memoryview)
    ogg = io.BytesIO()
    soundfile.write(ogg, np.zeros(1600, np.float32), 16000, format="OGG")
    assert isinstance(decode_sample({"ogg": ogg.getvalue()}, DecodeConfig(), defer_audio=True)["ogg"], Audio)
    with pytest.raises(SampleDecodeError, match="max_duration"):  # checked before any room is reserved
        decode_sample({"flac": flac}, DecodeConfig(max_duration=0.1), key="k", defer_audio=True)


def test_a_member_that_fails_is_dropped_and_named_the_rest_stay_dense():
    good = [encode(16000, 0.25, 1, "FLAC", "PCM_16", seed=i) for i in range(3)]
    broken = bytearray(good[1])
    broken[200:] = bytes(len(broken) - 200)  # header intact, frames zeroed: libFLAC fails mid-stream
    cfg = DecodeConfig()
    samples, failed = batch_of([good[0], bytes(broken), good[2]], cfg)
    assert list(failed) == [1] and (failed[1].key, failed[1].member, failed[1].shard) == ("k1", "flac", "s.tar")
    assert "lost sync" in str(failed[1])  # libFLAC's own complaint, kept
    assert isinstance(samples[1]["flac"], PendingAudio)
    first, last = samples[0]["flac"].waveform, samples[2]["flac"].waveform
    assert last.data_ptr() == first.data_ptr() + first.nbytes  # the next member took its place
    assert torch.equal(samples[2]["flac"].waveform, decode_audio(good[2], cfg).waveform)


def test_loader_serves_the_per_sample_values_with_and_without_workers(audio):  # noqa: F811
    """Through the loader (batches decoded into the worker's ring slot with 2 workers), the corrupt
    utterance skipped and counted, every other one equal to ``decode_audio`` of its payload."""
    import webdataset as wds

    payloads = {
        s["__key__"]: s["flac"]
        for tar in sorted(audio.glob("*.tar"))
        for s in wds.WebDataset(str(tar), shardshuffle=False)
    }
    for workers in (0, 2):
        decoded = waveforms(audio, "soundfile", workers=workers)
        assert sorted(decoded) == [f"u{i:03d}" for i in range(10) if i != 5]
        for key, wave in decoded.items():
            assert torch.equal(wave, decode_audio(payloads[key], DecodeConfig()).waveform), (workers, key)


def test_libsndfile_choice_keeps_values_and_checks_paths():
    payloads = [encode(16000, 0.2, 1, fmt, sub, seed=3) for fmt, sub in [("FLAC", "PCM_16"), ("WAV", "PCM_24")]]
    try:
        libsndfile.use("bundled")
        bundled = [decode_audio(p, DecodeConfig(libsndfile="bundled")).waveform for p in payloads]
        assert "1.2.2" in libsndfile.loaded()
        auto = [decode_audio(p, DecodeConfig(libsndfile="auto")).waveform for p in payloads]
        assert libsndfile.version(soundfile._snd) >= libsndfile.MIN_SYSTEM_VERSION
        if libsndfile.system_paths():  # this machine has one (Debian's 1.2.0): auto took it, not the wheel's
            assert "1.2.2" not in libsndfile.loaded()
    finally:
        libsndfile.use("auto")
    assert all(torch.equal(a, b) for a, b in zip(auto, bundled))
    with pytest.raises(ValueError, match="decode.libsndfile.*no file"):
        DecodeConfig(libsndfile="/nonexistent/libsndfile.so")


def test_ring_slots_are_sized_for_decoded_audio():
    durations = np.array([4.0, np.nan, 6.0], dtype=np.float32)
    assert mean_decoded_bytes(durations, DecodeConfig()) == 5.0 * 16000 * 4
    assert mean_decoded_bytes(durations, DecodeConfig(dtype="int16")) == 5.0 * 16000 * 2
    assert mean_decoded_bytes(durations, DecodeConfig(audio="raw")) == 0.0
    assert mean_decoded_bytes(np.full(2, np.nan, np.float32), DecodeConfig()) == 0.0
