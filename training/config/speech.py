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
        # or a transformers ParakeetForCTC checkpoint's encoder, on the NeMo features it was trained on:
        # encoder: {kind: parakeet, pretrained_path: /ckpt/parakeet-ctc-1.1b}, features: {kind: nemo}
        adapter: {subsampling: 2}
        prompt: "Transcribe the audio. <|audio|> Transcript:"
        features: {n_mels: 80}               # headrace.kernels.log_mel, on the device in the step (parakeet)
        spec_augment: {freq_masks: 2, time_masks: 2}

A released transformers speech LLM (Qwen2-Audio, Voxtral) as ``model.pretrained_path`` is the whole SALM:
``encoder`` / ``adapter`` / ``prompt`` left unset are its own (``headrace.training.speech.checkpoints``), so
``speech: {}`` or only ``freeze`` / training settings; a value that contradicts the checkpoint is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from headrace.kernels.log_mel import WHISPER_SAMPLE_RATE, LogMelConfig, SpecAugmentConfig

AUDIO_PLACEHOLDER = "<|audio|>"
WHISPER_FEATURE_KINDS = ("whisper", "qwen2_audio", "voxtral")  # encoders on Whisper's own features over a fixed window


@dataclass(kw_only=True)
class EncoderConfig:
    """The speech encoder: a transformers encoder config (inline or a local config.json / directory),
    optionally its weights (``pretrained_path``: config.json + safetensors, e.g. an export's ``encoder/``, or a
    whole transformers model's checkpoint directory whose encoder weights are read: Whisper's ``model.encoder.*``,
    ParakeetForCTC's ``encoder.*``, Qwen2-Audio's / Voxtral's ``audio_tower.*``). None of the three: the
    encoder of the speech-LLM checkpoint in ``model.pretrained_path`` (``from_checkpoint``)."""

    # FastConformer (ParakeetEncoder) | WhisperEncoder | Qwen2AudioEncoder (Whisper's + 2x average pooling + norm)
    # | VoxtralEncoder (Whisper's; every frame of its window goes on); unset: parakeet, or the checkpoint's
    kind: Literal["parakeet", "whisper", "qwen2_audio", "voxtral"] | None = None
    config: dict[str, Any] | None = None
    config_path: str | None = None
    pretrained_path: str | None = None
    freeze: bool = False

    def __post_init__(self):
        given = [n for n in ("config", "config_path", "pretrained_path") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"set one of config / config_path / pretrained_path (got {given})")
        if given and self.kind is None:
            self.kind = "parakeet"

    @property
    def from_checkpoint(self) -> bool:
        """True when the encoder is the one of the speech-LLM checkpoint in ``model.pretrained_path``."""
        return self.config is None and self.config_path is None and self.pretrained_path is None


@dataclass(kw_only=True)
class AdapterConfig:
    """Encoder frames -> LLM embeddings: stack ``subsampling`` consecutive frames, then
    Linear -> GELU -> Linear to the LLM's hidden size."""

    # linear: one Linear, no stacking (Qwen2-Audio's projector). Unset here and below: the speech-LLM checkpoint's,
    # else mlp, subsampling 2 (1 for linear), bias true (``with_defaults``)
    # ctc_bridge: the mlp plus a CTC head over the LLM's tokens whose posteriors enter through the LLM's embedding
    # table (headrace.training.speech.bridge)
    kind: Literal["mlp", "linear", "ctc_bridge"] | None = None
    subsampling: int | None = None
    hidden_size: int | None = None  # of the middle layer; None: the LLM's hidden size
    bias: bool | None = None  # of the mlp's two Linears (Voxtral's projector has none)
    # a directory with model.safetensors (an export's adapter/), or a speech-LLM checkpoint (its projector)
    pretrained_path: str | None = None
    # ctc_bridge: a model.kind ctc export's head/ (ctc.units: tokens, the SALM's tokenizer) to start the head from
    head_path: str | None = None
    freeze: bool = False

    def __post_init__(self):
        if self.head_path is not None and self.kind != "ctc_bridge":
            raise ValueError(f"head_path is the ctc_bridge adapter's; kind is {self.kind}")
        if self.subsampling is not None and self.subsampling < 1:
            raise ValueError(f"subsampling must be >= 1, got {self.subsampling}")
        if self.kind == "linear" and self.subsampling not in (None, 1):
            raise ValueError(f"a linear adapter does not stack frames: subsampling must be 1, got {self.subsampling}")

    def with_defaults(self) -> AdapterConfig:
        """This adapter with its unset fields at their defaults (a SALM not built from a speech-LLM checkpoint)."""
        kind = self.kind or "mlp"
        return dataclasses.replace(
            self,
            kind=kind,
            subsampling=self.subsampling or (1 if kind == "linear" else 2),
            bias=True if self.bias is None else self.bias,
        )


DEFAULT_PROMPT = f"Transcribe the audio. {AUDIO_PLACEHOLDER} Transcript:"


@dataclass(kw_only=True)
class SpeechConfig:
    encoder: EncoderConfig = field(default_factory=EncoderConfig)  # default: the speech-LLM checkpoint's
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    freeze_llm: bool = False
    # one placeholder, the frames' place; unset: the speech-LLM checkpoint's layout, else DEFAULT_PROMPT
    prompt: str | None = None
    answer_field: str = "text"  # the batch field the loss is taken on (the transcript for ASR)
    # the token that ends each answer (and decoding); unset: a speech-LLM checkpoint's tokenizer's eos_token (a chat
    # checkpoint's turn end), else the first of headrace.training.speech.prompt.EOS_NAMES the tokenizer has
    answer_end: str | None = None
    # log-mel parameters of a parakeet encoder (default: DALI's); a whisper encoder takes Whisper's own features
    # (n_fft 400, hop 160, its config's num_mel_bins), so it leaves this unset
    features: LogMelConfig | None = None
    spec_augment: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)
    # > 0: a CTC head on the encoder frames, its loss on the transcript tokens added to the answer loss with this
    # weight in training (joint CTC/attention): from scratch, it gives the encoder an alignment signal of its
    # own while the LLM learns the text prior
    ctc_weight: float = 0.0
    max_answer_tokens: int = 256  # longer answers are cut (counted in the step's metrics)
    max_new_tokens: int = 64  # greedy decoding length in eval
    # and at most this many tokens a second of audio (+ 4): a hypothesis that does not end is cut near what was
    # said (headrace.training.speech.eval.token_caps); 25 is above any speaking rate in characters
    max_tokens_per_second: float = 25.0
    eval_every: int = 0  # decode the training dataset's eval_split every N steps, print the WER (0: never)
    # the first validation at or past this step whose listening ratio is still >= 0.8 prints a warning, once
    # (headrace.training.speech.listening.not_listening_warning)
    warn_not_listening_after: int = 200
    eval_split: str = "val"
    eval_data: str | None = None  # the dataset folder eval_every decodes; None: the first training dataset's
    eval_batch_duration: float = 60.0  # seconds of padded audio per eval batch

    @property
    def sample_rate(self) -> int:
        """The audio sample rate the encoder's features expect (the loader's ``decode.sample_rate``)."""
        return WHISPER_SAMPLE_RATE if self.features is None else self.features.sample_rate

    def __post_init__(self):
        if not self.encoder.from_checkpoint:  # (a checkpoint's fill in ``headrace.training.speech.checkpoints``)
            self.adapter = self.adapter.with_defaults()
            self.prompt = DEFAULT_PROMPT if self.prompt is None else self.prompt
        if self.encoder.kind in WHISPER_FEATURE_KINDS and self.features is not None:
            raise ValueError(
                "features: a whisper encoder takes Whisper's own log-mel features (n_fft 400, hop 160, "
                "n_mels = its config's num_mel_bins); leave model.speech.features unset"
            )
        if self.encoder.kind == "parakeet" and self.features is None:
            self.features = LogMelConfig()
        if self.ctc_weight < 0:
            raise ValueError(f"ctc_weight must be >= 0, got {self.ctc_weight}")
        if self.prompt is not None and self.prompt.count(AUDIO_PLACEHOLDER) != 1:
            raise ValueError(
                f"prompt must contain the audio placeholder {AUDIO_PLACEHOLDER} exactly once: {self.prompt!r}"
            )


@dataclass(kw_only=True)
class CTCConfig:
    """``model.ctc:`` of a ``model.kind: ctc`` job: the ``model.speech`` encoder trained alone with CTC
    (``headrace.training.speech.ctc``); the adapter / prompt / LLM fields of ``model.speech`` are not used."""

    # chars: a-z, 0-9, space and apostrophe of the normalized transcript (WER's normalization); tokens: the
    # pieces of model.tokenizer. Chars need frames of <= 40 ms (4x subsampling) for espeak-ng's ~15 chars/s
    units: Literal["chars", "tokens"] = "chars"


__all__ = [
    "AUDIO_PLACEHOLDER",
    "DEFAULT_PROMPT",
    "WHISPER_FEATURE_KINDS",
    "AdapterConfig",
    "CTCConfig",
    "EncoderConfig",
    "SpeechConfig",
]
