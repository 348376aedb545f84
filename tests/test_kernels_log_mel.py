"""kernels.log_mel against the loader's DALI log-mel path (DALI on CPU), and SpecAugment's masks."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from kernels.log_mel import LogMelConfig, SpecAugmentConfig, log_mel, spec_augment

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

    from dataio.stream.dali import DaliAudioDecoder
    from dataio.stream.decode import DaliConfig, DecodeConfig

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
