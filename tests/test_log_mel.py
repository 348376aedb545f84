"""headrace.kernels.log_mel against the loader's DALI log-mel path (DALI on CPU) and against transformers'
WhisperFeatureExtractor and ParakeetFeatureExtractor, and SpecAugment's masks."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from headrace.kernels.log_mel import (
    LogMelConfig,
    SpecAugmentConfig,
    log_mel,
    nemo_log_mel,
    spec_augment,
    whisper_log_mel,
)

TOLERANCE_DB = 1e-3  # the stated tolerance (README "Speech LLMs"): float32 FFT rounding only


def _utterances() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for seconds, pitch in ((1.3, 220.0), (0.61, 440.0), (0.95, 330.0)):
        n = int(seconds * 16000) + int(rng.integers(0, 160))
        t = np.arange(n) / 16000
        out.append((0.4 * np.sin(2 * np.pi * pitch * t) + 0.05 * rng.standard_normal(n)).astype(np.float32))
    return out


def _compare_with_dali(device: str) -> None:
    """Our features of a padded batch on ``device`` vs the loader's DALI log-mel with ``dali.device``."""
    pytest.importorskip("nvidia.dali")
    import soundfile as sf

    from headrace.dataio.stream.reading.dali import DaliAudioDecoder
    from headrace.dataio.config import DaliConfig, DecodeConfig

    waves = _utterances()
    buffers = []
    for w in waves:
        f = io.BytesIO()
        sf.write(f, w, 16000, format="WAV", subtype="FLOAT")
        buffers.append(f.getvalue())
    dali = DaliAudioDecoder(DecodeConfig(audio="dali", dali=DaliConfig(features="log_mel", device=device)))(buffers)
    audio = torch.zeros(len(waves), max(len(w) for w in waves))
    for row, w in zip(audio, waves):
        row[: len(w)] = torch.from_numpy(w)
    audio, lengths = audio.to(device.replace("gpu", "cuda")), torch.tensor([len(w) for w in waves])
    ours, frames = log_mel(audio, lengths, LogMelConfig(scale=False))
    assert frames.tolist() == dali.lengths.tolist()
    for i, n in enumerate(frames.tolist()):
        diff = (ours[i, :, :n].cpu() - dali.data[i, :, :n].cpu()).abs().max().item()
        assert diff < TOLERANCE_DB, (i, diff)
        assert (ours[i, :, n:] == -80.0).all()  # frames past the end hold the floor
    scaled, _ = log_mel(audio, lengths, LogMelConfig())
    torch.testing.assert_close(scaled, (ours + 40) / 40)


def test_log_mel_matches_dali_per_utterance_in_a_padded_batch():
    _compare_with_dali("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_log_mel_on_cuda_matches_dali_gpu_features():
    _compare_with_dali("gpu")


# The extractor computes on the CPU. Our CPU features match it to 1.2e-7; a float32 FFT on a GPU sums in another
# order, and its error is relative to the frame's whole energy, so the quietest bins (down to the floor,
# 8 decades below the peak) carry relative errors up to ~1e-4: measured on an H200 (torch 2.11, cuFFT), 1 of
# 1,152,000 elements off by 1.26e-5. The (log10 + 4) / 4 scale turns an atol of 1e-4 into 0.04 % of a bin's
# energy (0.002 dB): 8x the measured worst case, and ~100x below a real error (one mel bin or frame off).
ATOL = {"cpu": 1e-5, "cuda": 1e-4}
# NeMo's features are normalised to unit variance per bin; the extractor takes |X| (a sqrt) then squares it, we take
# |X|^2 directly: float32 rounding, measured at most 4.1e-6 (80 mels) and 7.2e-6 (128), CPU; a frame or bin off is ~1
NEMO_ATOL = 1e-5


def _compare_with_whisper_extractor(device: str, n_mels: int, window_frames: int) -> None:
    """The padded batch on ``device`` vs the extractor's per-utterance features on the CPU (its own 30 s padding,
    or a shorter window through ``max_length``), and the real-audio frames vs its attention mask."""
    from transformers import WhisperFeatureExtractor

    waves = _utterances()
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    want = extractor(
        waves, sampling_rate=16000, max_length=window_frames * 160, return_attention_mask=True, return_tensors="pt"
    )
    audio = torch.zeros(len(waves), max(len(w) for w in waves))
    for row, w in zip(audio, waves):
        row[: len(w)] = torch.from_numpy(w)
    audio[1, len(waves[1]) :] = 1.0  # whatever the batch padding holds, each utterance sees silence after its end
    audio, lengths = audio.to(device), torch.tensor([len(w) for w in waves], device=device)
    with torch.autocast(audio.device.type, dtype=torch.bfloat16):  # a bf16 step computes its features in fp32
        ours, frames = whisper_log_mel(audio, lengths, n_mels, window_frames)
    assert ours.dtype == torch.float32 and ours.shape == want["input_features"].shape == (3, n_mels, window_frames)
    assert frames.tolist() == want["attention_mask"].sum(1).tolist()
    torch.testing.assert_close(ours.cpu(), want["input_features"], rtol=0, atol=ATOL[device])
    with pytest.raises(ValueError, match="longer than the Whisper encoder's window of 1.25 s"):
        whisper_log_mel(audio, lengths, n_mels, 125)


@pytest.mark.parametrize("n_mels,window_frames", [(80, 3000), (128, 3000), (80, 200)])
def test_whisper_log_mel_matches_whisper_feature_extractor(n_mels, window_frames):
    _compare_with_whisper_extractor("cpu", n_mels, window_frames)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_whisper_log_mel_on_cuda_matches_whisper_feature_extractor():
    _compare_with_whisper_extractor("cuda", 128, 3000)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_nemo_log_mel_matches_parakeet_feature_extractor(n_mels):
    """NeMo's features of a padded batch (``kind: nemo``) vs transformers' ParakeetFeatureExtractor: the same frames
    per utterance (its attention mask), the same normalised values, whatever the batch padding holds."""
    from transformers import ParakeetFeatureExtractor

    waves = _utterances()
    want = ParakeetFeatureExtractor(feature_size=n_mels)(
        waves, sampling_rate=16000, return_attention_mask=True, return_tensors="pt"
    )
    audio = torch.zeros(len(waves), max(len(w) for w in waves))
    for row, w in zip(audio, waves):
        row[: len(w)] = torch.from_numpy(w)
    audio[1, len(waves[1]) :] = 1.0
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 step computes its features in fp32
        ours, frames = nemo_log_mel(
            audio, torch.tensor([len(w) for w in waves]), LogMelConfig(kind="nemo", n_mels=n_mels)
        )
    assert ours.dtype == torch.float32 and frames.tolist() == want["attention_mask"].sum(1).tolist()
    assert ours.transpose(1, 2).shape == want["input_features"].shape
    torch.testing.assert_close(ours.transpose(1, 2), want["input_features"], rtol=0, atol=NEMO_ATOL)


def test_spec_augment_masks_within_limits_and_reproducibly():
    feats = torch.randn(3, 80, 50) + 5.0
    frames = torch.tensor([50, 30, 20])
    cfg = SpecAugmentConfig(freq_masks=2, freq_width=10, time_masks=2, time_width=0.2)
    out = spec_augment(feats, frames, cfg, torch.Generator().manual_seed(1))
    again = spec_augment(feats, frames, cfg, torch.Generator().manual_seed(1))
    assert torch.equal(out, again)
    masked = out == 0.0
    assert masked.any()
    for b in range(3):
        bands = masked[b].all(dim=1)  # mel bins masked over all frames
        spans = masked[b].all(dim=0)  # frames masked over all bins
        assert bands.sum() <= 2 * 10 and spans.sum() <= 2 * int(frames[b] * 0.2)
    assert torch.equal(spec_augment(feats, frames, SpecAugmentConfig()), feats)
