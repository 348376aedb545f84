"""headrace.dataio.stream.reading.dali: DALI batch audio decoding on CPU (device_id=None) checked against the soundfile path.

Resampled waveforms are compared with soxr's away from the edges: both are windowed-sinc resamplers
(DALI 16 lobes at quality 50, soxr HQ), so in the interior they agree to ~6e-5 on a 0.5-amplitude sine
and the test allows 1e-3 (-54 dB below the signal); the first and last 12.5 ms differ more because
the two treat the signal's edges differently (zero-extension vs filter warm-up), bounded at 0.05.
"""

import io
import sys

import numpy as np
import pytest
import soundfile
import torch

from headrace.dataio.stream.reading.decode import Audio, decode_audio, decode_sample

from headrace.dataio.usererror import SampleDecodeError
from headrace.dataio.config import DaliConfig, DecodeConfig

EDGE = 200  # samples at 16 kHz: longer than either resampler's filter half-width


@pytest.fixture
def dali():
    pytest.importorskip("nvidia.dali")
    import headrace.dataio.stream.reading.dali

    return headrace.dataio.stream.reading.dali


def encode(rate: int, seconds: float, freq: float, channels: int, fmt: str = "FLAC") -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    wave = 0.5 * np.sin(2 * np.pi * freq * t)
    audio = np.stack([wave * (c + 1) / channels for c in range(channels)], axis=1).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, audio, rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def test_missing_dali_names_the_extra(monkeypatch):
    import headrace.dataio.stream.reading.dali

    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # makes `import nvidia.dali...` fail
    monkeypatch.setitem(sys.modules, "nvidia.dali.fn", None)
    with pytest.raises(ImportError, match=r"headrace\[dali\]"):
        headrace.dataio.stream.reading.dali.DaliAudioDecoder(DecodeConfig(audio="dali"))


def test_waveforms_match_soundfile_and_soxr(dali):
    cases = [(8000, 1.0, 1, "FLAC"), (16000, 0.7, 1, "FLAC"), (44100, 0.5, 2, "WAV"), (16000, 1.2, 2, "WAV")]
    buffers = [encode(rate, seconds, 1000.0, channels, fmt) for rate, seconds, channels, fmt in cases]
    cfg = DecodeConfig(audio="dali")
    batch = dali.DaliAudioDecoder(cfg)([memoryview(b) for b in buffers], keys=list("abcd"))
    assert batch.index == [0, 1, 2, 3] and batch.errors == {}
    assert batch.data.shape == (4, 19200) and batch.data.dtype == torch.float32
    assert batch.sample_rate.tolist() == [16000] * 4
    for row, buf in enumerate(buffers):
        reference = decode_audio(buf, cfg).waveform
        n = int(batch.lengths[row])
        assert n == len(reference)
        diff = (batch.data[row, :n] - reference).abs()
        assert diff[EDGE:-EDGE].max() < 1e-3
        assert diff.max() < 0.05
        assert not batch.data[row, n:].any()  # padding is zeros


def test_native_rate_and_channels_kept(dali):
    buffers = [encode(44100, 0.25, 440.0, 2, "WAV"), encode(44100, 0.5, 440.0, 2, "FLAC")]
    cfg = DecodeConfig(audio="dali", sample_rate=None, mono=False, dtype="int16")
    batch = dali.DaliAudioDecoder(cfg)(buffers)
    assert batch.data.shape == (2, 2, 22050) and batch.data.dtype == torch.int16
    assert batch.lengths.tolist() == [11025, 22050] and batch.sample_rate.tolist() == [44100, 44100]
    for row, buf in enumerate(buffers):  # no resampling: bit-exact with libsndfile
        reference = decode_audio(buf, cfg).waveform
        assert torch.equal(batch.data[row, :, : batch.lengths[row]], reference)


def test_mixed_channel_counts_without_downmix_is_a_clear_error(dali):
    decoder = dali.DaliAudioDecoder(DecodeConfig(audio="dali", mono=False))
    with pytest.raises(ValueError, match="one channel count per batch"):
        decoder([encode(16000, 0.1, 440.0, 1), encode(16000, 0.1, 440.0, 2)])


def test_corrupt_member_is_dropped_and_named_the_rest_kept(dali):
    good = encode(16000, 0.5, 440.0, 1)
    decoder = dali.DaliAudioDecoder(DecodeConfig(audio="dali"))
    batch = decoder([good, b"RIFF" + bytes(300), good[:40], good], keys=["u0", "u1", "u2", "u3"], shard="a-000002.tar")
    assert batch.index == [0, 3] and batch.data.shape == (2, 8000)
    labels = {i: (e.key, e.shard) for i, e in batch.errors.items()}
    assert labels == {1: ("u1", "a-000002.tar"), 2: ("u2", "a-000002.tar")}
    assert all(isinstance(e, SampleDecodeError) and "DALI" in str(e) for e in batch.errors.values())
    assert decoder([good]).data.shape == (1, 8000)  # the decoder is usable again
    all_bad = decoder([b"junk" * 50], keys=["x"])
    assert all_bad.index == [] and all_bad.data.numel() == 0 and all_bad.errors[0].key == "x"


def test_max_duration_drops_long_audio_with_its_key(dali):
    decoder = dali.DaliAudioDecoder(DecodeConfig(audio="dali", max_duration=1.0))
    batch = decoder([encode(16000, 0.5, 440.0, 1), encode(8000, 1.5, 440.0, 1)], keys=["short", "long"])
    assert batch.index == [0] and batch.data.shape == (1, 8000)
    assert list(batch.errors) == [1] and batch.errors[1].key == "long" and "max_duration" in str(batch.errors[1])


def test_loader_hook_replaces_raw_audio_members_in_place(dali):
    cfg = DecodeConfig(audio="dali", dali=DaliConfig(max_batch_size=2))  # 3 audio members: two DALI runs
    raw = [
        {"flac": encode(8000, 0.5, 440.0, 1), "json": b'{"text": "a"}'},
        {"flac": b"RIFF" + bytes(100), "json": b'{"text": "b"}'},
        {"wav": encode(16000, 0.25, 440.0, 2, "WAV")},
    ]
    samples = [decode_sample(members, cfg, key=f"k{i}", shard="s.tar") for i, members in enumerate(raw)]
    keys, shards = ["k0", "k1", "k2"], ["s.tar", "t.tar", "s.tar"]
    failed = dali.decode_audio_members(dali.DaliAudioDecoder(cfg), samples, keys, shards)
    assert list(failed) == [1] and (failed[1].key, failed[1].shard, failed[1].member) == ("k1", "t.tar", "flac")
    assert samples[0]["json"] == {"text": "a"}
    for sample, ext, n in ((samples[0], "flac", 8000), (samples[2], "wav", 4000)):
        assert isinstance(sample[ext], Audio) and sample[ext].sample_rate == 16000
        assert sample[ext].waveform.shape == (n,)
        reference = decode_audio(raw[0 if ext == "flac" else 2][ext], cfg).waveform
        assert (sample[ext].waveform - reference)[EDGE:-EDGE].abs().max() < 1e-3


def slaney_mel(hz: float) -> float:
    """Slaney's mel scale (DALI's default): linear to 1 kHz, logarithmic above."""
    return 3 * hz / 200 if hz < 1000 else 15 + 27 * np.log(hz / 1000) / np.log(6.4)


@pytest.mark.parametrize("freq", [700.0, 1000.0, 3000.0])
def test_log_mel_frames_and_tone_band(dali, freq):
    cfg = DecodeConfig(audio="dali", dali=DaliConfig(features="log_mel", n_mels=80, hop_length=160))
    batch = dali.DaliAudioDecoder(cfg)([encode(16000, 1.0, freq, 1), encode(8000, 0.5, freq, 1)])
    assert batch.data.shape == (2, 80, 101) and batch.lengths.tolist() == [101, 51]  # 1 + T // hop (centred)
    # Filter k peaks at mel (k + 1) * mel(8 kHz) / (n_mels + 1): the tone must land in the nearest band.
    expected_band = slaney_mel(freq) * 81 / slaney_mel(8000) - 1
    for row in range(2):
        frame = batch.data[row, :, batch.lengths[row] // 2]
        assert abs(int(frame.argmax()) - expected_band) <= 1
        # dB relative to the utterance peak (a steady tone: every frame near it), floored at -80.
        assert -1.0 < frame.max() <= 1e-4 and frame.min() >= -80.0


def test_rejects_impossible_options(dali):
    with pytest.raises(ValueError, match="log_mel needs decode.sample_rate"):
        dali.DaliAudioDecoder(DecodeConfig(audio="dali", sample_rate=None, dali=DaliConfig(features="log_mel")))
    with pytest.raises(ValueError, match="max_batch_size"):
        dali.DaliAudioDecoder(DecodeConfig(audio="dali", dali=DaliConfig(max_batch_size=2)))([b"", b"", b""])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            dali.DaliAudioDecoder(DecodeConfig(audio="dali", dali=DaliConfig(device="gpu")))


@pytest.mark.gpu
@pytest.mark.parametrize("features", ["waveform", "log_mel"])
def test_gpu_path_matches_cpu(dali, features):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    buffers = [encode(8000, 1.0, 1000.0, 1), encode(44100, 0.5, 3000.0, 2, "WAV")]
    cpu = dali.DaliAudioDecoder(DecodeConfig(audio="dali", dali=DaliConfig(features=features)))(buffers)
    gpu = dali.DaliAudioDecoder(DecodeConfig(audio="dali", dali=DaliConfig(device="gpu", features=features)))(buffers)
    assert gpu.data.is_cuda and gpu.data.shape == cpu.data.shape
    assert torch.equal(gpu.lengths, cpu.lengths) and gpu.sample_rate.tolist() == [16000, 16000]
    # Same resampler (quality 50) on either device; the GPU resamples after decoding, the CPU inside it.
    tolerance = 1e-3 if features == "waveform" else 0.5  # dB for log-mel
    for row in range(2):
        n = int(cpu.lengths[row])
        edge = EDGE if features == "waveform" else 2
        diff = (gpu.data[row, ..., edge : n - edge].cpu() - cpu.data[row, ..., edge : n - edge]).abs()
        assert diff.max() < tolerance
