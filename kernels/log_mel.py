"""Log-mel features of a padded waveform batch on the device: the loader's DALI path, NeMo's, and Whisper's.

``log_mel(audio, lengths, cfg)`` computes, in plain torch on whatever device ``audio`` lives (no
torchaudio), the same features as ``headrace.dataio.stream.reading.dali``'s ``features: log_mel`` graph
(``fn.spectrogram -> fn.mel_filter_bank -> fn.to_decibels(multiplier=10, cutoff_db=-80)``):

1. Each utterance is reflect-padded by ``n_fft // 2`` at *its own* ends (a gather with reflected
   indices, so a short utterance in a padded batch sees its own signal, not the batch padding), giving
   ``1 + length // hop`` centred frames, exactly DALI's count.
2. ``torch.stft`` with DALI's Hann window ``0.5 * (1 - cos(2 pi (i + 0.5) / win_length))`` centred in the
   ``n_fft`` frame; power spectrum ``|X|^2``.
3. Slaney mel filter bank with Slaney area normalisation (DALI's defaults; the matrix comes from
   ``transformers.audio_utils.mel_filter_bank``, built once per device and shape).
4. dB relative to each utterance's own peak over its valid frames, floored at -80 dB.

Measured against DALI 2.4 on CPU (tests/test_log_mel.py): max |difference| below 1e-3 dB on
utterances of different lengths in one batch (float32 FFT rounding). Frames past an utterance's end are
set to -80 dB (the floor). The output is scaled to about [-1, 1] by ``(db + 40) / 40`` for the encoder
(``scale: true``, the default for training; ``scale: false`` returns DALI's dB values).

``whisper_log_mel(audio, lengths, n_mels, window_frames)`` computes transformers' ``WhisperFeatureExtractor``
features on the device: every utterance zero-padded to Whisper's fixed window (30 s = 3000 frames for
the released checkpoints), centred STFT (n_fft 400, hop 160, periodic Hann, reflect padding of the
whole window) without its last frame, Slaney mel bank (80 or 128 bins), ``log10(max(x, 1e-10))``
floored at the utterance's maximum - 8, then ``(x + 4) / 4``. The frames the real audio covers are
``ceil(length / hop)`` (the extractor's attention mask). Measured against the extractor in
tests/test_log_mel.py. Cost: the STFT of the whole window per utterance (the encoder's input
size is fixed anyway).

``nemo_log_mel(audio, lengths, cfg)`` (``LogMelConfig(kind="nemo")``) computes transformers'
``ParakeetFeatureExtractor`` features (NeMo's preprocessor: preemphasis, symmetric Hann, ``log(x + 2^-24)``,
per-utterance per-bin normalisation over ``length // hop`` frames), the input a released Parakeet encoder
expects; measured against the extractor in tests/test_log_mel.py.

All run with autocast off: the mel matmul and the log must stay in float32 under a bf16 step.

``spec_augment`` masks random frequency bands and time spans per utterance (SpecAugment without time
warping), drawing from an explicit ``torch.Generator`` so runs are reproducible per rank.

Cost: one STFT over ``B x max_len`` samples (O(B T log n_fft)) plus a ``[n_mels, n_fft/2+1]`` matmul; the
STFT's complex output ``B x frames x (n_fft/2+1)`` is the peak memory (at 16 kHz about 26 kB per second
of audio).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch

CUTOFF_DB = -80.0


@dataclass(kw_only=True)
class LogMelConfig:
    """The feature parameters; defaults equal ``data.decode.dali``'s (25 ms window, 10 ms hop, 80 mels).
    ``kind: nemo``: NeMo's features, as transformers' ``ParakeetFeatureExtractor`` computes them
    (``nemo_log_mel``), the ones a released Parakeet / Canary encoder was trained on."""

    kind: Literal["dali", "nemo"] = "dali"
    sample_rate: int = 16000
    n_mels: int = 80
    n_fft: int = 512
    win_length: int = 400
    hop_length: int = 160
    scale: bool = True  # dali: (db + 40) / 40, about [-1, 1] instead of [-80, 0] dB
    preemphasis: float = 0.97  # nemo: x[t] - 0.97 x[t - 1] before the STFT

    def __post_init__(self):
        if self.win_length > self.n_fft:
            raise ValueError(f"features.win_length {self.win_length} must be <= n_fft {self.n_fft}")
        for name in ("sample_rate", "n_mels", "n_fft", "win_length", "hop_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"features.{name} must be >= 1, got {getattr(self, name)}")


def num_frames(lengths: torch.Tensor, hop_length: int) -> torch.Tensor:
    """Frames of each utterance (centred windows): ``1 + length // hop``."""
    return 1 + torch.div(lengths, hop_length, rounding_mode="floor")


@functools.lru_cache(maxsize=8)
def _mel_matrix(sample_rate: int, n_mels: int, n_fft: int, device: str) -> torch.Tensor:
    """Slaney mel bank with Slaney area normalisation, ``[n_mels, n_fft // 2 + 1]`` (DALI's and Whisper's)."""
    from transformers.audio_utils import mel_filter_bank

    mel = mel_filter_bank(
        num_frequency_bins=n_fft // 2 + 1,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=sample_rate / 2,
        sampling_rate=sample_rate,
        norm="slaney",
        mel_scale="slaney",
    )
    return torch.from_numpy(mel.T).float().to(device)


@functools.lru_cache(maxsize=8)
def _tables(cfg_key: tuple, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(window ``[n_fft]``, mel matrix ``[n_mels, n_fft // 2 + 1]``) for one parameter set and device."""
    sample_rate, n_mels, n_fft, win_length = cfg_key
    i = torch.arange(win_length, dtype=torch.float64)
    hann = 0.5 * (1 - torch.cos(2 * math.pi * (i + 0.5) / win_length))
    left = (n_fft - win_length) // 2
    window = torch.zeros(n_fft, dtype=torch.float64)
    window[left : left + win_length] = hann
    return window.float().to(device), _mel_matrix(sample_rate, n_mels, n_fft, device)


@torch.autocast("cuda", enabled=False)
@torch.autocast("cpu", enabled=False)
def log_mel(audio: torch.Tensor, lengths: torch.Tensor, cfg: LogMelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``audio [B, T]`` (zero-padded, float) with valid ``lengths [B]`` -> (features ``[B, n_mels, F]``,
    frames ``[B]``)."""
    audio = audio.float()
    lengths = lengths.to(audio.device)
    window, mel = _tables((cfg.sample_rate, cfg.n_mels, cfg.n_fft, cfg.win_length), str(audio.device))
    frames = num_frames(lengths, cfg.hop_length)
    longest = int(frames.max())
    half = cfg.n_fft // 2
    # Reflect each utterance at its own ends: index j of the padded signal reads sample |j - half|
    # reflected at length - 1.
    span = (longest - 1) * cfg.hop_length + cfg.n_fft
    j = torch.arange(span, device=audio.device) - half
    last = (lengths - 1).clamp(min=0)[:, None]
    idx = j.abs()[None, :].expand(len(lengths), -1)
    idx = torch.where(idx > last, 2 * last - idx, idx).clamp(min=0)
    idx = torch.minimum(idx, last)  # utterances shorter than n_fft / 2 (DALI would reflect again)
    padded = torch.gather(audio, 1, idx)
    spec = torch.stft(
        padded, n_fft=cfg.n_fft, hop_length=cfg.hop_length, window=window, center=False, return_complex=True
    )[..., :longest]
    power = spec.real.square() + spec.imag.square()  # [B, freq, F]
    mels = torch.matmul(mel, power)  # [B, n_mels, F]
    valid = torch.arange(longest, device=audio.device)[None, :] < frames[:, None]
    peak = mels.masked_fill(~valid[:, None, :], 0.0).amax(dim=(1, 2), keepdim=True)
    db = 10.0 * torch.log10(torch.clamp(mels / peak.clamp(min=torch.finfo(mels.dtype).tiny), min=1e-8))
    db = db.masked_fill(~valid[:, None, :], CUTOFF_DB)
    return ((db - CUTOFF_DB / 2) / (-CUTOFF_DB / 2) if cfg.scale else db), frames


NEMO_LOG_GUARD, NEMO_NORM_EPS = 2.0**-24, 1e-5  # ParakeetFeatureExtractor's


def feature_frames(lengths: torch.Tensor, cfg: LogMelConfig) -> torch.Tensor:
    """Feature frames of each utterance: DALI's ``1 + length // hop``, NeMo's ``length // hop``."""
    return torch.div(lengths, cfg.hop_length, rounding_mode="floor") + (cfg.kind == "dali")


@torch.autocast("cuda", enabled=False)
@torch.autocast("cpu", enabled=False)
def nemo_log_mel(audio: torch.Tensor, lengths: torch.Tensor, cfg: LogMelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``audio [B, T]`` (zero-padded) with valid ``lengths [B]`` -> (NeMo features ``[B, n_mels, 1 + T // hop]``,
    frames ``[B]``): preemphasis within each utterance, centred STFT with zero padding and a symmetric Hann
    window of ``win_length``, Slaney mel bank on the power spectrum, ``log(x + 2^-24)``, then each mel bin
    normalised to zero mean and unit variance over the utterance's ``length // hop`` frames (unbiased variance,
    as NeMo's ``per_feature``); frames after them are 0. ``ParakeetFeatureExtractor``'s features, on the device."""
    audio = audio.float()
    lengths = lengths.to(audio.device)
    inside = torch.arange(audio.shape[1], device=audio.device)[None, :] < lengths[:, None]
    if cfg.preemphasis:
        audio = torch.cat([audio[:, :1], audio[:, 1:] - cfg.preemphasis * audio[:, :-1]], dim=1)
    audio = audio * inside
    window = torch.hann_window(cfg.win_length, periodic=False, device=audio.device)
    spec = torch.stft(
        audio,
        cfg.n_fft,
        hop_length=cfg.hop_length,
        win_length=cfg.win_length,
        window=window,
        center=True,
        pad_mode="constant",
        return_complex=True,
    )
    power = spec.real.square() + spec.imag.square()
    logs = torch.log(
        torch.matmul(_mel_matrix(cfg.sample_rate, cfg.n_mels, cfg.n_fft, str(audio.device)), power) + NEMO_LOG_GUARD
    )
    frames = feature_frames(lengths, cfg)
    valid = (torch.arange(logs.shape[-1], device=audio.device)[None, :] < frames[:, None])[:, None, :]
    count = frames[:, None, None].to(logs.dtype)
    mean = (logs * valid).sum(-1, keepdim=True) / count
    # (count - 1): the unbiased variance; at least 1 so a one-frame utterance gives zeros, not NaN
    var = (((logs - mean) * valid).square()).sum(-1, keepdim=True) / (count - 1).clamp(min=1)
    return (logs - mean) / (var.sqrt() + NEMO_NORM_EPS) * valid, frames


WHISPER_SAMPLE_RATE, WHISPER_N_FFT, WHISPER_HOP = 16000, 400, 160  # WhisperFeatureExtractor's


def whisper_num_frames(lengths: torch.Tensor) -> torch.Tensor:
    """Whisper frames the audio covers (frame centres inside it): ``ceil(length / hop)``."""
    return -torch.div(-lengths, WHISPER_HOP, rounding_mode="floor")


@torch.autocast("cuda", enabled=False)
@torch.autocast("cpu", enabled=False)
def whisper_log_mel(
    audio: torch.Tensor, lengths: torch.Tensor, n_mels: int, window_frames: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``audio [B, T]`` (16 kHz) with valid ``lengths [B]`` -> (Whisper features ``[B, n_mels, window_frames]``,
    frames of real audio ``[B]``); see the module docstring. Raises if an utterance is longer than the window."""
    window_samples = window_frames * WHISPER_HOP
    lengths = lengths.to(audio.device)
    # lengths never exceed the padded width: only a batch wider than the window needs the (syncing) check
    if audio.shape[1] > window_samples and int(lengths.max()) > window_samples:
        raise ValueError(
            f"audio of {int(lengths.max()) / WHISPER_SAMPLE_RATE:.2f} s is longer than the Whisper "
            f"encoder's window of {window_samples / WHISPER_SAMPLE_RATE:g} s"
        )
    audio = audio[:, :window_samples].float()
    # zeros after each utterance's end, up to the window (the extractor pads every utterance with silence)
    audio = audio * (torch.arange(audio.shape[1], device=audio.device)[None, :] < lengths[:, None])
    audio = torch.nn.functional.pad(audio, (0, window_samples - audio.shape[1]))
    window = torch.hann_window(WHISPER_N_FFT, device=audio.device)
    spec = torch.stft(
        audio,
        n_fft=WHISPER_N_FFT,
        hop_length=WHISPER_HOP,
        window=window,
        center=True,
        pad_mode="reflect",
        return_complex=True,
    )[..., :-1]
    power = spec.real.square() + spec.imag.square()
    mels = torch.matmul(_mel_matrix(WHISPER_SAMPLE_RATE, n_mels, WHISPER_N_FFT, str(audio.device)), power)
    logs = torch.clamp(mels, min=1e-10).log10()
    logs = torch.maximum(logs, logs.amax(dim=(1, 2), keepdim=True) - 8.0)
    return (logs + 4.0) / 4.0, whisper_num_frames(lengths)


@dataclass(kw_only=True)
class SpecAugmentConfig:
    """SpecAugment masks per utterance; zero masks (the default) switch it off."""

    freq_masks: int = 0
    freq_width: int = 15  # mel bins, at most
    time_masks: int = 0
    time_width: float = 0.05  # fraction of the utterance's frames, at most

    @property
    def enabled(self) -> bool:
        return self.freq_masks > 0 or self.time_masks > 0


def spec_augment(
    features: torch.Tensor,
    frames: torch.Tensor,
    cfg: SpecAugmentConfig,
    generator: torch.Generator | None = None,
    fill: float = 0.0,
) -> torch.Tensor:
    """``features [B, n_mels, F]`` with ``cfg.freq_masks`` bands of up to ``freq_width`` bins and
    ``cfg.time_masks`` spans of up to ``time_width * frames`` frames set to ``fill`` (new tensor)."""
    batch, n_mels, longest = features.shape
    device = features.device

    def draw(count: int, width: torch.Tensor, extent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = torch.rand((2, batch, count), generator=generator, device="cpu").to(device)
        w = (u[0] * (width[:, None].float() + 1)).floor()
        start = (u[1] * (extent[:, None].float() - w + 1).clamp(min=1)).floor()
        return start, start + w

    mask = torch.zeros_like(features, dtype=torch.bool)
    if cfg.freq_masks:
        lo, hi = draw(
            cfg.freq_masks,
            torch.full((batch,), cfg.freq_width, device=device),
            torch.full((batch,), n_mels, device=device),
        )
        f = torch.arange(n_mels, device=device)[None, None, :]
        mask |= ((f >= lo[..., None]) & (f < hi[..., None])).any(1)[:, :, None]
    if cfg.time_masks:
        lo, hi = draw(cfg.time_masks, (frames.to(device) * cfg.time_width).floor(), frames.to(device))
        t = torch.arange(longest, device=device)[None, None, :]
        mask |= ((t >= lo[..., None]) & (t < hi[..., None])).any(1)[:, None, :]
    return features.masked_fill(mask, fill)


__all__ = [
    "CUTOFF_DB",
    "WHISPER_HOP",
    "WHISPER_N_FFT",
    "WHISPER_SAMPLE_RATE",
    "LogMelConfig",
    "SpecAugmentConfig",
    "feature_frames",
    "log_mel",
    "nemo_log_mel",
    "num_frames",
    "spec_augment",
    "whisper_log_mel",
    "whisper_num_frames",
]
