"""The speech encoders a SALM can use, one small front end per ``model.speech.encoder.kind``: its transformers
config, the module, its input features, how many output frames an utterance gets, and where a checkpoint
keeps its weights. Model code stays transformers'.

- ``parakeet``: ``ParakeetEncoder`` (FastConformer) on ``headrace.kernels.log_mel.log_mel`` (the loader's DALI
  features; ``features.kind: nemo``: ``nemo_log_mel``, NeMo's, as transformers' ``ParakeetFeatureExtractor``
  computes them) of the batch's longest utterance, with an attention mask over each utterance's frames; its
  output frames come from its conv subsampling. ``pretrained_path`` may be a transformers ``ParakeetForCTC``
  checkpoint directory (its ``encoder_config``, its ``encoder.*`` weights; the CTC head is not read); such an
  encoder was trained on NeMo's features.
- ``whisper``: ``WhisperEncoder`` on ``headrace.kernels.log_mel.whisper_log_mel`` (transformers'
  ``WhisperFeatureExtractor`` computed on the device). Every utterance is padded to the encoder's fixed
  window, ``max_source_positions * 2`` mel frames (30 s for the released checkpoints), as Whisper was
  trained and as Qwen2-Audio feeds it: ``WhisperEncoder`` refuses any other length and takes no attention
  mask (every position attends over the silence after the utterance, so trimming the window would change
  what a pretrained encoder computes). Only the frames the real audio covers go on: ``ceil(samples / 160)``
  mel frames -> ``(frames - 1) // 2 + 1`` encoder frames (its stride-2 conv) -> the adapter's stacking.
  Cost: the encoder always runs the whole window (1500 positions, quadratic attention) per utterance, so
  batches of short utterances pay for 30 s each; a from-scratch encoder can choose a shorter window
  through ``max_source_positions``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from headrace.kernels.log_mel import (
    WHISPER_HOP,
    WHISPER_SAMPLE_RATE,
    LogMelConfig,
    feature_frames,
    log_mel,
    nemo_log_mel,
    whisper_log_mel,
    whisper_num_frames,
)
from headrace.training.config.speech import EncoderConfig
from headrace.training.speech.checkpoints import PREFIX as PARTS_PREFIX
from headrace.training.speech.checkpoints import SPEECH_LLMS

WHISPER_CHECKPOINT_PREFIX = "model.encoder."  # a whole Whisper model's (WhisperForConditionalGeneration) names
# whole transformers models whose checkpoint directory is read for its encoder: model_type -> (the encoder's
# sub-config, its weights' prefix)
WHOLE_MODELS = {
    "parakeet_ctc": ("encoder_config", "encoder."),
    **{kind: ("audio_config", PARTS_PREFIX["encoder"]) for kind in SPEECH_LLMS},
}
LAYERDROP_KEYS = ("layerdrop", "encoder_layerdrop")


def _read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as f:
        return json.load(f)


def whole_model_prefix(path: str) -> str:
    """The prefix of the encoder's weights in ``path``: ``WHOLE_MODELS``' for a whole model's checkpoint, else none
    (an encoder's own directory, an export's ``encoder/``)."""
    return WHOLE_MODELS.get(_read_config(path).get("model_type"), (None, ""))[1]


def _config_fields(cfg: EncoderConfig, model_types: tuple[str, ...]) -> dict:
    """The encoder config's fields: inline, or a config.json / a directory holding one (of ``model_types``, or a
    whole model of ``WHOLE_MODELS`` holding one)."""
    if cfg.config is not None:
        return dict(cfg.config)
    fields = _read_config(cfg.config_path or cfg.pretrained_path)
    if (whole := WHOLE_MODELS.get(fields.get("model_type"))) is not None:
        # the encoder of a released model: its LayerDrop, if any, was a regularizer of that model's own training
        # (ParakeetEncoderConfig's default is 0.1) and is off here, where FSDP2 ranks cannot skip layers apart
        fields = {k: 0.0 if k in LAYERDROP_KEYS else v for k, v in fields[whole[0]].items()}
    model_type = fields.pop("model_type", model_types[0])
    if model_type not in model_types:
        raise ValueError(
            f"model.speech.encoder: {cfg.config_path or cfg.pretrained_path} holds a {model_type!r} "
            f"config, not one of {list(model_types)} "
            f"(encoder.kind: {cfg.kind})"
        )
    return fields


def _no_layerdrop(fields: dict, key: str) -> None:
    # LayerDrop skips layers at random per rank: FSDP2 ranks would then gather different layers and hang.
    if fields.setdefault(key, 0.0):
        raise ValueError(
            f"model.speech.encoder.config.{key} must be 0 (ranks would skip different layers "
            "and FSDP2's collectives would not match)"
        )


def masked_frames(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]``: True at the first ``lengths[b]`` frames of row ``b``."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


class ParakeetFrontEnd:
    """FastConformer on the DALI-matched log-mel (see the module docstring)."""

    def __init__(self, features: LogMelConfig):
        self.cfg = features

    def config(self, cfg: EncoderConfig) -> PretrainedConfig:
        from transformers import ParakeetEncoderConfig

        fields = _config_fields(cfg, ("parakeet_encoder",))
        _no_layerdrop(fields, "layerdrop")
        fields.setdefault("num_mel_bins", self.cfg.n_mels)
        if fields["num_mel_bins"] != self.cfg.n_mels:
            raise ValueError(
                f"model.speech.encoder num_mel_bins {fields['num_mel_bins']} != features.n_mels {self.cfg.n_mels}"
            )
        return ParakeetEncoderConfig(**fields)

    def build(self, config: PretrainedConfig) -> nn.Module:
        from transformers import ParakeetEncoder

        return ParakeetEncoder(config)

    def initialize(self, encoder: nn.Module) -> None:
        """transformers' init, then torch's fan-in-scaled default for every convolution (in-place random ops:
        each FSDP2 shard draws its own values). transformers draws conv weights from N(0, 0.02) whatever their
        fan-in, which is for fine-tuning released weights: from scratch, the 8x subsampling stack then shrinks
        the features' variation ~10^4-fold (std 0.044 -> 2.9e-6 on the recipe's encoder) and the encoder's
        output stops depending on the audio within the first training steps. torch's default keeps it at
        ~0.1 of the input's, as NeMo's from-scratch FastConformer has it."""
        encoder.initialize_weights()
        for module in encoder.modules():
            if isinstance(module, (nn.Conv1d, nn.Conv2d)):
                module.reset_parameters()

    def features(
        self, encoder: nn.Module, audio: torch.Tensor, audio_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return (nemo_log_mel if self.cfg.kind == "nemo" else log_mel)(audio, audio_lens, self.cfg)

    def hidden(self, encoder: nn.Module, feats: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        mask = masked_frames(frames, feats.shape[-1])
        return encoder(feats.transpose(1, 2), attention_mask=mask.long()).last_hidden_state

    def output_frames(self, encoder: nn.Module, audio_lens: torch.Tensor) -> torch.Tensor:
        return encoder._get_subsampling_output_length(feature_frames(audio_lens, self.cfg)).long()

    def checkpoint_prefix(self, path: str) -> str:
        return whole_model_prefix(path)  # ParakeetForCTC's encoder.*, or an encoder's own directory

    def max_seconds(self, encoder: nn.Module) -> float | None:
        return None  # any length (the batch's longest sets the feature width)


class WhisperFrontEnd:
    """Whisper's encoder on Whisper's features over its fixed window (see the module docstring)."""

    def config(self, cfg: EncoderConfig) -> PretrainedConfig:
        from transformers import WhisperConfig

        fields = _config_fields(cfg, ("whisper",))
        _no_layerdrop(fields, "encoder_layerdrop")
        return WhisperConfig(**fields)

    def build(self, config: PretrainedConfig) -> nn.Module:
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        return WhisperEncoder(config)

    def initialize(self, encoder: nn.Module) -> None:
        """transformers' init, except the fixed sinusoidal position table: its init copies the whole table into
        the parameter, which under FSDP2 is a shard (every rank would get the first rows); each rank writes
        its own rows of the table instead (computed locally, no communication)."""
        from torch.distributed.tensor import DTensor, distribute_tensor
        from transformers.models.whisper.modeling_whisper import sinusoids

        weight = encoder.embed_positions.weight
        weight._is_hf_initialized = True  # transformers' init functions skip a tensor marked so
        encoder.initialize_weights()
        table = sinusoids(*weight.shape).to(weight.device)
        if isinstance(weight, DTensor):
            table = distribute_tensor(table, weight.device_mesh, weight.placements, src_data_rank=None)
        with torch.no_grad():
            weight.copy_(table)

    @staticmethod
    def window_frames(encoder: nn.Module) -> int:
        """Mel frames of the fixed input window (what ``WhisperEncoder.forward`` insists on)."""
        return encoder.config.max_source_positions * encoder.conv1.stride[0] * encoder.conv2.stride[0]

    def max_seconds(self, encoder: nn.Module) -> float | None:
        return self.window_frames(encoder) * WHISPER_HOP / WHISPER_SAMPLE_RATE

    def features(
        self, encoder: nn.Module, audio: torch.Tensor, audio_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return whisper_log_mel(audio, audio_lens, encoder.config.num_mel_bins, self.window_frames(encoder))

    def hidden(self, encoder: nn.Module, feats: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        return encoder(feats).last_hidden_state  # no mask: Whisper attends over the whole window

    def output_frames(self, encoder: nn.Module, audio_lens: torch.Tensor) -> torch.Tensor:
        return encoder._get_feat_extract_output_lengths(whisper_num_frames(audio_lens)).long()

    def checkpoint_prefix(self, path: str) -> str:
        """``model.encoder.`` for a whole Whisper checkpoint, nothing for an encoder-only one (an export's)."""
        from safetensors import safe_open

        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                if any(key.startswith(WHISPER_CHECKPOINT_PREFIX) for key in f.keys()):
                    return WHISPER_CHECKPOINT_PREFIX
        return ""


class Qwen2AudioFrontEnd(WhisperFrontEnd):
    """Whisper's features and window; Qwen2-Audio's encoder, mask and frame counts (module docstring)."""

    def config(self, cfg: EncoderConfig) -> PretrainedConfig:
        from transformers import Qwen2AudioEncoderConfig

        fields = _config_fields(cfg, ("qwen2_audio_encoder",))
        _no_layerdrop(fields, "encoder_layerdrop")
        return Qwen2AudioEncoderConfig(**fields)

    def build(self, config: PretrainedConfig) -> nn.Module:
        from transformers import Qwen2AudioEncoder

        return Qwen2AudioEncoder(config)

    def initialize(self, encoder: nn.Module) -> None:
        encoder.initialize_weights()

    def hidden(self, encoder: nn.Module, feats: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        conv_frames = (frames - 1) // 2 + 1
        width = (feats.shape[-1] - 2) // 2 + 1  # what Qwen2AudioModel sizes the mask by
        mask = create_bidirectional_mask(
            config=encoder.config,
            inputs_embeds=feats.new_zeros(len(feats), width, 1),
            attention_mask=masked_frames(conv_frames, width).long(),
        )
        return encoder(feats, attention_mask=mask).last_hidden_state

    def output_frames(self, encoder: nn.Module, audio_lens: torch.Tensor) -> torch.Tensor:
        return encoder._get_feat_extract_output_lengths(whisper_num_frames(audio_lens))[1].long()

    def checkpoint_prefix(self, path: str) -> str:
        return whole_model_prefix(path)  # Qwen2-Audio's audio_tower.*, or an export's encoder/


class VoxtralFrontEnd(WhisperFrontEnd):
    """Whisper's features and window; Voxtral's encoder, every window frame an output (module docstring)."""

    def config(self, cfg: EncoderConfig) -> PretrainedConfig:
        from transformers import VoxtralEncoderConfig

        fields = _config_fields(cfg, ("voxtral_encoder",))
        _no_layerdrop(fields, "encoder_layerdrop")
        return VoxtralEncoderConfig(**fields)

    def build(self, config: PretrainedConfig) -> nn.Module:
        from transformers import VoxtralEncoder

        return VoxtralEncoder(config)

    def initialize(self, encoder: nn.Module) -> None:
        encoder.initialize_weights()

    def output_frames(self, encoder: nn.Module, audio_lens: torch.Tensor) -> torch.Tensor:
        return torch.full_like(audio_lens, encoder.config.max_source_positions, dtype=torch.long)

    def checkpoint_prefix(self, path: str) -> str:
        return whole_model_prefix(path)


def front_end(kind: str, features: LogMelConfig | None) -> ParakeetFrontEnd | WhisperFrontEnd:
    """The front end of ``model.speech.encoder.kind``."""
    if kind in ("qwen2_audio", "voxtral"):
        return Qwen2AudioFrontEnd() if kind == "qwen2_audio" else VoxtralFrontEnd()
    return WhisperFrontEnd() if kind == "whisper" else ParakeetFrontEnd(features)


__all__ = ["ParakeetFrontEnd", "Qwen2AudioFrontEnd", "VoxtralFrontEnd", "WhisperFrontEnd", "front_end"]
