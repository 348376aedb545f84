"""headrace.dataio.stream.reading.decode: zero-copy .npy tokens, pickle refusal, soundfile audio with soxr resampling."""

import ctypes
import io
import pickle

import numpy as np
import pytest
import soundfile
import torch

from headrace.dataio.stream.reading.decode import Audio, UnsafeMemberError, decode_npy, decode_sample

from headrace.dataio.usererror import SampleDecodeError
from headrace.dataio.config import DecodeConfig

# decode_npy over a read-only `bytes` member is zero-copy on purpose (see dataio/stream/reading/decode.py); pytest resets
# the module's own filter for torch's "not writable" warning, so it is restated here.
pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def buffer_span(buf) -> tuple[int, int]:
    """(address, length) of a bytes/bytearray object's payload."""
    view = np.frombuffer(buf, dtype=np.uint8)
    return view.ctypes.data, len(view)


# ---------------------------------------------------------------------------------------------- npy


@pytest.mark.parametrize("dtype", ["<u2", "<i4"])
@pytest.mark.parametrize("container", [bytes, bytearray])
def test_npy_round_trip_is_zero_copy(dtype, container):
    tokens = np.random.default_rng(0).integers(0, 30000, size=1237).astype(dtype)
    payload = container(npy_bytes(tokens))
    tensor = decode_npy(memoryview(payload))
    assert tensor.dtype == {"<u2": torch.uint16, "<i4": torch.int32}[dtype]
    assert np.array_equal(tensor.numpy(), tokens)
    start, length = buffer_span(payload)
    assert start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= start + length


def test_npy_from_a_slice_of_a_larger_block_shares_the_block():
    # What the loader hands over: memoryviews into one block read holding several members.
    a, b = npy_bytes(np.arange(10, dtype="<i4")), npy_bytes(np.arange(5, 9, dtype="<u2"))
    block = bytearray(b"\0" * 512 + a + b"\0" * 512 + b)
    view = memoryview(block)
    ta = decode_npy(view[512 : 512 + len(a)])
    tb = decode_npy(view[1024 + len(a) :])
    assert ta.tolist() == list(range(10)) and tb.tolist() == [5, 6, 7, 8]
    block_start = ctypes.addressof(ctypes.c_char.from_buffer(block))
    assert block_start + 512 <= ta.data_ptr() < block_start + 512 + len(a)
    block[512 + len(a) - 4 : 512 + len(a)] = (99).to_bytes(4, "little")  # last element of `a`, in place
    assert ta[-1].item() == 99


@pytest.mark.parametrize(
    "array",
    [
        np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian: one byte-swapping copy
        np.asfortranarray(np.arange(6, dtype="<i8").reshape(2, 3)),
        np.array(7, dtype="<i4"),
        np.zeros((0,), dtype="<u2"),
        np.zeros(3, dtype=[("a", "<i4"), ("b", "<f4")])["a"].copy(),
    ],
)
def test_npy_layouts(array):
    assert np.array_equal(decode_npy(npy_bytes(array)).numpy(), array)


def test_npy_non_canonical_header_goes_through_numpys_safe_reader():
    header = b"{'shape': (3,), 'fortran_order': False, 'descr': '<i2'}"  # keys in another order
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    payload = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + np.arange(3, dtype="<i2").tobytes()
    assert decode_npy(payload).tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"not numpy at all", "bad magic"),
        (npy_bytes(np.arange(100, dtype="<i4"))[:-8], "truncated"),
        (b"\x93NUMPY\x01\x00\xff\x7f{}", "past the payload"),
        (b"\x93NUMPY\x09\x00\x10\x00", "version 9"),
    ],
)
@pytest.mark.parametrize("defer_npy", [False, True])
def test_npy_corrupt_payloads_raise_with_key(payload, message, defer_npy):
    with pytest.raises(SampleDecodeError, match=message) as info:
        decode_sample(
            {"tokens.npy": payload}, DecodeConfig(), key="doc-17", shard="text-000003.tar", defer_npy=defer_npy
        )
    assert (info.value.shard, info.value.key, info.value.member) == ("text-000003.tar", "doc-17", "tokens.npy")
    assert "doc-17" in str(info.value) and "text-000003.tar" in str(info.value)


def test_deferred_npy_collates_like_decoded_tensors():
    """``defer_npy`` (the loader's plain batches): 1-D native arrays stay ``NpyView`` and ``collate``
    copies them into the same batch tensors the decoded path gives; anything else is decoded at once."""
    from headrace.dataio.stream.reading.collate import collate_field
    from headrace.dataio.stream.reading.decode import NpyView

    batches = [
        [np.arange(n, dtype="<i4") * 3 for n in (5, 0, 17, 2)],  # ragged: flat + lengths
        [np.full(4, i, dtype="<u2") for i in range(3)],  # equal lengths: stacked
        [np.arange(3, dtype="<i4"), np.arange(4, dtype="<i8")],  # mixed dtypes: promoted, as decoded
        [np.arange(6, dtype="<i4").reshape(2, 3), np.arange(6, dtype="<i4").reshape(2, 3)],  # 2-D: decoded
        [np.arange(5, dtype=">i4"), np.arange(2, dtype="<i4")],  # foreign byte order: decoded
    ]
    for arrays in batches:
        members = [{"tokens.npy": memoryview(npy_bytes(a))} for a in arrays]
        deferred = [decode_sample(m, DecodeConfig(), defer_npy=True)["tokens.npy"] for m in members]
        decoded = [decode_sample(m, DecodeConfig())["tokens.npy"] for m in members]
        kinds = {type(v) for v in deferred}
        assert kinds == (
            {NpyView}
            if all(a.ndim == 1 and a.dtype.isnative for a in arrays)
            else {NpyView, torch.Tensor}
            if any(a.ndim == 1 and a.dtype.isnative for a in arrays)
            else {torch.Tensor}
        )
        (got, got_lengths), (want, want_lengths) = collate_field(deferred), collate_field(decoded)
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert (got_lengths is None and want_lengths is None) or torch.equal(got_lengths, want_lengths)


# ------------------------------------------------------------------------------------------- pickle


class CreatesFileWhenUnpickled:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("ext", ["pyd", "pickle", "pkl", "pth", "pt", "state.pth"])
def test_pickle_members_are_refused_and_never_executed(tmp_path, ext):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(CreatesFileWhenUnpickled(str(marker)))
    with pytest.raises(UnsafeMemberError, match="never loaded") as info:
        decode_sample({"txt": b"hi", ext: payload}, DecodeConfig(), key="k1", shard="s.tar")
    assert info.value.member == ext and "k1" in str(info.value) and "s.tar" in str(info.value)
    assert not marker.exists()


def test_npy_holding_pickled_objects_is_refused_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    array = np.empty(1, dtype=object)
    array[0] = CreatesFileWhenUnpickled(str(marker))
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    with pytest.raises(SampleDecodeError, match="Python objects") as info:
        decode_sample({"npy": buf.getvalue()}, DecodeConfig(), key="k2")
    assert info.value.key == "k2"
    assert not marker.exists()


# ------------------------------------------------------------------------------------ text, passthru


def test_text_json_int_and_unknown_members():
    members = {
        "txt": memoryview("héllo".encode()),
        "meta.json": b'{"speaker": 3, "lang": "en"}',
        "cls": b"42\n",
        "weird.bin": memoryview(b"\x00\x01"),
    }
    out = decode_sample(members, DecodeConfig())
    assert list(out) == list(members)
    assert out["txt"] == "héllo"
    assert out["meta.json"] == {"speaker": 3, "lang": "en"}
    assert out["cls"] == 42
    assert out["weird.bin"] == b"\x00\x01" and type(out["weird.bin"]) is bytes


@pytest.mark.parametrize("members", [{"json": b"{oops"}, {"txt": b"\xff\xfe\xfa"}, {"cls": b"four"}])
def test_bad_text_members_raise_with_key(members):
    with pytest.raises(SampleDecodeError) as info:
        decode_sample(members, DecodeConfig(), key="k3", shard="t.tar")
    assert info.value.key == "k3" and info.value.member == next(iter(members))


# -------------------------------------------------------------------------------------------- audio


def sine(rate: int, seconds: float, freq: float, channels: int) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    wave = 0.5 * np.sin(2 * np.pi * freq * t)
    # Channel c at amplitude (c+1)/channels so that downmixing has something to average.
    return np.stack([wave * (c + 1) / channels for c in range(channels)], axis=1).astype(np.float32)


def encode(audio: np.ndarray, rate: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, audio, rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def peak_hz(wave: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(len(wave))))
    return float(np.argmax(spectrum)) * rate / len(wave)


@pytest.mark.parametrize("fmt", ["FLAC", "WAV"])
@pytest.mark.parametrize("rate", [8000, 16000, 44100])
@pytest.mark.parametrize("channels", [1, 2])
def test_audio_decoded_downmixed_and_resampled_to_16k(fmt, rate, channels):
    seconds, freq = 1.5, 1000.0
    payload = encode(sine(rate, seconds, freq, channels), rate, fmt)
    out = decode_sample({fmt.lower(): payload}, DecodeConfig(sample_rate=16000))[fmt.lower()]
    assert isinstance(out, Audio) and out.sample_rate == 16000
    wave = out.waveform.numpy()
    assert wave.dtype == np.float32 and wave.ndim == 1
    assert len(wave) == int(seconds * 16000)  # soxr keeps duration: ceil(n * 16000 / rate) here is exact
    assert abs(peak_hz(wave, 16000) - freq) <= 16000 / len(wave)  # within one FFT bin
    # Downmix = channel mean: amplitudes 0.5 * (1/2 + 2/2) / 2 for stereo, 0.5 for mono.
    expected_amplitude = 0.5 * (0.75 if channels == 2 else 1.0)
    assert np.max(np.abs(wave[1000:-1000])) == pytest.approx(expected_amplitude, abs=0.01)


def test_audio_keeps_rate_and_channels_when_asked():
    payload = encode(sine(8000, 0.5, 440.0, 2), 8000, "FLAC")
    out = decode_sample({"flac": payload}, DecodeConfig(sample_rate=None, mono=False, dtype="int16"))["flac"]
    assert out.sample_rate == 8000 and out.waveform.shape == (2, 4000) and out.waveform.dtype == torch.int16
    assert out.waveform.is_contiguous()
    ratio = out.waveform[1].abs().max().item() / out.waveform[0].abs().max().item()
    assert ratio == pytest.approx(2.0, rel=0.01)


def test_int16_downmix_and_resample():
    payload = encode(sine(44100, 1.0, 3000.0, 2), 44100, "WAV")
    out = decode_sample({"wav": payload}, DecodeConfig(dtype="int16"))["wav"]
    assert out.waveform.dtype == torch.int16 and out.waveform.shape == (16000,)
    assert abs(peak_hz(out.waveform.numpy().astype(np.float32), 16000) - 3000.0) <= 1.0


@pytest.mark.parametrize("fmt, ext", [("OGG", "ogg"), ("MP3", "mp3")])
def test_compressed_formats_libsndfile_supports(fmt, ext):
    buf = io.BytesIO()
    soundfile.write(buf, sine(16000, 1.0, 1000.0, 1), 16000, format=fmt)
    out = decode_sample({ext: buf.getvalue()}, DecodeConfig())[ext]
    assert abs(out.waveform.shape[0] - 16000) < 2000  # lossy codecs pad frames
    assert abs(peak_hz(out.waveform.numpy(), 16000) - 1000.0) <= 16.0


@pytest.mark.parametrize("damage", ["garbage", "truncated_header", "empty"])
def test_corrupt_audio_raises_with_key(damage):
    good = encode(sine(16000, 1.0, 440.0, 1), 16000, "FLAC")
    payload = {"garbage": b"RIFF" + bytes(range(256)) * 4, "truncated_header": good[:20], "empty": b""}[damage]
    with pytest.raises(SampleDecodeError) as info:
        decode_sample({"flac": payload}, DecodeConfig(), key="utt-9", shard="audio-000001.tar")
    assert (info.value.key, info.value.member, info.value.shard) == ("utt-9", "flac", "audio-000001.tar")


def test_max_duration_guard():
    payload = encode(sine(16000, 3.0, 440.0, 1), 16000, "FLAC")
    with pytest.raises(SampleDecodeError, match="max_duration"):
        decode_sample({"flac": payload}, DecodeConfig(max_duration=2.0), key="long")
    assert decode_sample({"flac": payload}, DecodeConfig(max_duration=3.5))["flac"].waveform.shape == (48000,)


@pytest.mark.parametrize("audio", ["dali", "raw"])
def test_dali_and_raw_backends_leave_audio_encoded(audio):
    payload = encode(sine(16000, 0.2, 440.0, 1), 16000, "FLAC")
    out = decode_sample({"flac": payload, "json": b"{}"}, DecodeConfig(audio=audio))
    assert isinstance(out["flac"], memoryview) and out["flac"].obj is payload and out["json"] == {}


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="sample_rate"):
        DecodeConfig(sample_rate=0)
    with pytest.raises(ValueError, match="max_duration"):
        DecodeConfig(max_duration=-1.0)
