"""Qwen2-Audio as a SALM: its encoder as a front end, and a released checkpoint converted to a SALM export.

``Qwen2AudioEncoder`` is Whisper's encoder plus a 2x average pooling and a final LayerNorm; unlike plain
Whisper it attends only over the frames the audio covers (a bidirectional mask over the conv frames, as
``Qwen2AudioModel`` builds it). Features are Whisper's, over its fixed window (``WhisperFrontEnd``):
``ceil(samples / 160)`` mel frames -> ``(frames - 1) // 2 + 1`` conv frames -> ``(conv - 2) // 2 + 1``
pooled frames, one LLM position each through the projector (``adapter.kind: linear``).

``python -m training.speech.qwen2_audio CHECKPOINT OUT`` rewrites a transformers Qwen2-Audio checkpoint
directory (``Qwen2AudioForConditionalGeneration``: ``audio_tower.*``, ``multi_modal_projector.linear.*``,
``language_model.{model,lm_head}.*``) as a SALM export: ``OUT/hf`` (the Qwen2 LLM: its text config, its
weights renamed, the checkpoint's tokenizer files), ``OUT/encoder`` (the audio config + weights),
``OUT/adapter`` (the projector) and ``OUT/salm.json`` whose prompt is the checkpoint's own layout around its
audio token (``<|audio_bos|>`` + the audio + ``<|audio_eos|>``, in the chat template's user turn for a chat
checkpoint). ``training.speech.job.load_salm(OUT)`` rebuilds it; a training job starts from it with
``model.pretrained_path: OUT/hf``, ``speech.encoder: {kind: qwen2_audio, pretrained_path: OUT/encoder}``,
``speech.adapter: {kind: linear, subsampling: 1, pretrained_path: OUT/adapter}``. Cost: one read and one
write of the weights (tensor by tensor through safetensors).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from training.speech.config import AUDIO_PLACEHOLDER, EncoderConfig
from training.speech.encoders import WhisperFrontEnd, _config_fields, _no_layerdrop, masked_frames

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.json", "chat_template.jinja", "generation_config.json")
PARTS = {"audio_tower.": "encoder", "multi_modal_projector.": "adapter", "language_model.": "hf"}
# the base checkpoint's ASR prompt (its processor's layout): audio between its markers, then the task
BASE_PROMPT = f"<|audio_bos|>{AUDIO_PLACEHOLDER}<|audio_eos|>Detect the language and recognize the speech: <|en|>"


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
        mask = create_bidirectional_mask(config=encoder.config, inputs_embeds=feats.new_zeros(len(feats), width, 1),
                                         attention_mask=masked_frames(conv_frames, width).long())
        return encoder(feats, attention_mask=mask).last_hidden_state

    def output_frames(self, encoder: nn.Module, audio_lens: torch.Tensor) -> torch.Tensor:
        from kernels.log_mel import whisper_num_frames

        return encoder._get_feat_extract_output_lengths(whisper_num_frames(audio_lens))[1].long()

    def checkpoint_prefix(self, path: str) -> str:
        return ""  # an encoder-only directory (``convert`` writes one)


def chat_prompt(checkpoint: Path) -> str:
    """The prompt a chat checkpoint's template gives one user turn of audio (its processor's
    ``apply_chat_template`` with the audio and no text), else the base checkpoint's ASR prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if tokenizer.chat_template is None:
        return BASE_PROMPT
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "audio", "audio_url": "x"}]}],
                                         add_generation_prompt=True, tokenize=False)
    if "<|AUDIO|>" not in text:
        raise ValueError(f"{checkpoint}: its chat template puts no <|AUDIO|> token in a user turn with audio")
    return text.replace("<|AUDIO|>", AUDIO_PLACEHOLDER, 1)


def convert(checkpoint: str | Path, out: str | Path, prompt: str | None = None) -> Path:
    """Write the SALM export of a Qwen2-Audio checkpoint directory (module docstring); returns ``out``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    checkpoint, out = Path(checkpoint), Path(out)
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("model_type") != "qwen2_audio":
        raise ValueError(f"{checkpoint}: a {config.get('model_type')!r} checkpoint, not qwen2_audio")
    parts: dict[str, dict[str, torch.Tensor]] = {part: {} for part in PARTS.values()}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                prefix = next((p for p in PARTS if key.startswith(p)), None)
                if prefix is None:
                    raise ValueError(f"{file}: {key} belongs to no part of Qwen2-Audio ({', '.join(PARTS)})")
                parts[PARTS[prefix]][key[len(prefix):]] = f.get_tensor(key)
    for part, state in parts.items():
        (out / part).mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / part / "model.safetensors"), metadata={"format": "pt"})
    audio, text = dict(config["audio_config"]), dict(config["text_config"])
    audio["model_type"] = "qwen2_audio_encoder"
    (out / "encoder" / "config.json").write_text(json.dumps(audio, indent=1))
    text.setdefault("model_type", "qwen2")
    text.setdefault("architectures", ["Qwen2ForCausalLM"])
    (out / "hf" / "config.json").write_text(json.dumps(text, indent=1))
    for name in TOKENIZER_FILES:
        if (checkpoint / name).exists():
            shutil.copy(checkpoint / name, out / "hf" / name)
    speech = {"encoder": {"kind": "qwen2_audio", "pretrained_path": "encoder"},
              "adapter": {"kind": "linear", "subsampling": 1, "pretrained_path": "adapter"},
              "prompt": prompt or chat_prompt(checkpoint)}
    (out / "salm.json").write_text(json.dumps(speech, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.speech.qwen2_audio",
                                     description="a Qwen2-Audio checkpoint directory -> a SALM export")
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--prompt", default=None, help=f"with one {AUDIO_PLACEHOLDER} (default: the checkpoint's)")
    args = parser.parse_args(argv)
    try:
        convert(args.checkpoint, args.out, args.prompt)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"SALM export of {args.checkpoint} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Qwen2AudioFrontEnd", "chat_prompt", "convert"]
