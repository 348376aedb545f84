"""The ``model.speech:`` section of a ``model.kind: salm`` job (the LLM itself is ``model.config`` /
``config_path`` / ``pretrained_path`` as for text jobs).

    model:
      kind: salm
      pretrained_path: runs/demo/hf          # the LLM (a local safetensors checkpoint)
      tokenizer: demo/corpus/tokenizer.json
      speech:
        encoder: {kind: parakeet, config: {hidden_size: 128, num_hidden_layers: 4, ...}, freeze: false}
        # or Whisper's encoder from a local Whisper checkpoint (features: Whisper's own, leave unset):
        # encoder: {kind: whisper, pretrained_path: /ckpt/whisper-small, freeze: true}
        adapter: {subsampling: 2}
        prompt: "Transcribe the audio. <|audio|> Transcript:"
        features: {n_mels: 80}               # headrace.kernels.log_mel, on the device in the step (parakeet)
        spec_augment: {freq_masks: 2, time_masks: 2}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from headrace.kernels.log_mel import WHISPER_SAMPLE_RATE, LogMelConfig, SpecAugmentConfig

AUDIO_PLACEHOLDER = "<|audio|>"
WHISPER_FEATURE_KINDS = ("whisper", "qwen2_audio", "voxtral")  # encoders on Whisper's own features over a fixed window


@dataclass(kw_only=True)
class EncoderConfig:
    """The speech encoder: a transformers encoder config (inline or a local config.json / directory),
    optionally its weights (``pretrained_path``: config.json + safetensors, e.g. an export's ``encoder/``
    or, for ``whisper``, a whole Whisper checkpoint directory whose ``model.encoder.*`` weights are read)."""

    # FastConformer (ParakeetEncoder) | WhisperEncoder | Qwen2AudioEncoder (Whisper's + 2x average pooling + norm)
    # | VoxtralEncoder (Whisper's; every frame of its window goes on)
    kind: Literal["parakeet", "whisper", "qwen2_audio", "voxtral"] = "parakeet"
    config: dict[str, Any] | None = None
    config_path: str | None = None
    pretrained_path: str | None = None
    freeze: bool = False

    def __post_init__(self):
        given = [n for n in ("config", "config_path", "pretrained_path") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"set exactly one of config / config_path / pretrained_path (got {given or 'none'})")


@dataclass(kw_only=True)
class AdapterConfig:
    """Encoder frames -> LLM embeddings: stack ``subsampling`` consecutive frames, then
    Linear -> GELU -> Linear to the LLM's hidden size."""

    kind: Literal["mlp", "linear"] = "mlp"  # linear: one Linear, no stacking (Qwen2-Audio's projector)
    subsampling: int = 2
    hidden_size: int | None = None  # of the middle layer; None: the LLM's hidden size
    bias: bool = True  # of the mlp's two Linears (Voxtral's projector has none)
    pretrained_path: str | None = None  # a directory with adapter.safetensors (an export's encoder/)
    freeze: bool = False

    def __post_init__(self):
        if self.subsampling < 1:
            raise ValueError(f"subsampling must be >= 1, got {self.subsampling}")
        if self.kind == "linear" and self.subsampling != 1:
            raise ValueError(f"a linear adapter does not stack frames: subsampling must be 1, got {self.subsampling}")


@dataclass(kw_only=True)
class SpeechConfig:
    encoder: EncoderConfig
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    freeze_llm: bool = False
    prompt: str = f"Transcribe the audio. {AUDIO_PLACEHOLDER} Transcript:"  # one placeholder, the frames' place
    answer_field: str = "text"  # the batch field the loss is taken on (the transcript for ASR)
    # log-mel parameters of a parakeet encoder (default: DALI's); a whisper encoder takes Whisper's own features
    # (n_fft 400, hop 160, its config's num_mel_bins), so it leaves this unset
    features: LogMelConfig | None = None
    spec_augment: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)
    # > 0: a CTC head on the encoder frames, its loss on the transcript tokens added to the answer loss with this
    # weight in training (joint CTC/attention): from scratch, it keeps the encoder's output tied to the audio
    # while the LLM learns the text prior (without it the recipe's encoder collapsed to one output for any input)
    ctc_weight: float = 0.0
    max_answer_tokens: int = 256  # longer answers are cut (counted in the step's metrics)
    max_new_tokens: int = 64  # greedy decoding length in eval
    eval_every: int = 0  # decode the training dataset's eval_split every N steps, print the WER (0: never)
    eval_split: str = "val"
    eval_batch_duration: float = 60.0  # seconds of padded audio per eval batch

    @property
    def sample_rate(self) -> int:
        """The audio sample rate the encoder's features expect (the loader's ``decode.sample_rate``)."""
        return WHISPER_SAMPLE_RATE if self.features is None else self.features.sample_rate

    def __post_init__(self):
        if self.encoder.kind in WHISPER_FEATURE_KINDS and self.features is not None:
            raise ValueError("features: a whisper encoder takes Whisper's own log-mel features (n_fft 400, hop 160, "
                             "n_mels = its config's num_mel_bins); leave model.speech.features unset")
        if self.encoder.kind == "parakeet" and self.features is None:
            self.features = LogMelConfig()
        if self.ctc_weight < 0:
            raise ValueError(f"ctc_weight must be >= 0, got {self.ctc_weight}")
        if self.prompt.count(AUDIO_PLACEHOLDER) != 1:
            raise ValueError(f"prompt must contain the audio placeholder {AUDIO_PLACEHOLDER} exactly once: "
                             f"{self.prompt!r}")


__all__ = ["AUDIO_PLACEHOLDER", "WHISPER_FEATURE_KINDS", "AdapterConfig", "EncoderConfig", "SpeechConfig"]
