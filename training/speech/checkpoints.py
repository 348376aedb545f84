"""Released speech-LLM checkpoints as SALMs (Qwen2-Audio, Voxtral): their encoders as front ends, and a
checkpoint directory converted to a SALM export.

``Qwen2AudioEncoder`` is Whisper's encoder plus a 2x average pooling and a final LayerNorm; unlike plain
Whisper it attends only over the frames the audio covers (a bidirectional mask over the conv frames, as
``Qwen2AudioModel`` builds it). Features are Whisper's, over its fixed window (``WhisperFrontEnd``):
``ceil(samples / 160)`` mel frames -> ``(frames - 1) // 2 + 1`` conv frames -> ``(conv - 2) // 2 + 1``
pooled frames, one LLM position each through the projector (``adapter.kind: linear``).

``VoxtralEncoder`` is Whisper's encoder without a mask; Voxtral feeds every frame of the window to its
projector, which stacks ``audio_config.intermediate_size / d_model`` (4) consecutive frames and applies
Linear-GELU-Linear without biases: the SALM ``mlp`` adapter with ``subsampling: 4, bias: false``. So a
Voxtral SALM gives each utterance ``max_source_positions / 4`` slots (375 per 30 s window), whatever its length,
as Voxtral's processor does.

``python -m headrace.training.speech.checkpoints CHECKPOINT OUT`` rewrites a transformers Qwen2-Audio or Voxtral
checkpoint directory (``audio_tower.*``, ``multi_modal_projector.*``, ``language_model.{model,lm_head}.*``) as
a SALM export: ``OUT/hf`` (the LLM: its text config, its weights renamed, the checkpoint's tokenizer files),
``OUT/encoder`` (the audio config + weights), ``OUT/adapter`` (the projector, names mapped) and
``OUT/salm.json`` whose prompt is the checkpoint's own layout around its audio token (Qwen2-Audio:
``<|audio_bos|>`` + the audio + ``<|audio_eos|>``, in the chat template's user turn for a chat checkpoint;
``--prompt`` gives another; Voxtral's default is ``[INST][BEGIN_AUDIO]<|audio|>[/INST]``).
``headrace.training.speech.job.load_salm(OUT)`` rebuilds it; a training job starts from it with
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

from headrace.training.config.speech import AUDIO_PLACEHOLDER

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.json", "chat_template.jinja", "generation_config.json")
PARTS = {"audio_tower.": "encoder", "multi_modal_projector.": "adapter", "language_model.": "hf"}
ADAPTER_NAMES = {"linear_1.": "proj_in.", "linear_2.": "proj_out."}  # Voxtral's projector -> the mlp adapter
# without a chat template: the base checkpoint's ASR prompt (Qwen2-Audio's processor layout: the audio between
# its markers, then the task), or Voxtral's instruction turn around its audio
BASE_PROMPTS = {"qwen2_audio": f"<|audio_bos|>{AUDIO_PLACEHOLDER}<|audio_eos|>Detect the language and recognize the "
                               "speech: <|en|>",
                "voxtral": f"[INST][BEGIN_AUDIO]{AUDIO_PLACEHOLDER}[/INST]"}
AUDIO_TOKENS = {"qwen2_audio": "<|AUDIO|>", "voxtral": "[AUDIO]"}


def chat_prompt(checkpoint: Path, kind: str) -> str:
    """The prompt a chat checkpoint's template gives one user turn of audio (``apply_chat_template`` with the
    audio and no text, its audio token as the placeholder), else ``BASE_PROMPTS[kind]``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if tokenizer.chat_template is None:
        return BASE_PROMPTS[kind]
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "audio", "audio_url": "x"}]}],
                                         add_generation_prompt=True, tokenize=False)
    token = AUDIO_TOKENS[kind]
    if token not in text:
        raise ValueError(f"{checkpoint}: its chat template puts no {token} token in a user turn with audio")
    return text.replace(token, AUDIO_PLACEHOLDER, 1)


def convert(checkpoint: str | Path, out: str | Path, prompt: str | None = None) -> Path:
    """Write the SALM export of a Qwen2-Audio checkpoint directory (module docstring); returns ``out``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    checkpoint, out = Path(checkpoint), Path(out)
    config = json.loads((checkpoint / "config.json").read_text())
    kind = config.get("model_type")
    if kind not in ("qwen2_audio", "voxtral"):
        raise ValueError(f"{checkpoint}: a {kind!r} checkpoint, not qwen2_audio or voxtral")
    parts: dict[str, dict[str, torch.Tensor]] = {part: {} for part in PARTS.values()}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                prefix = next((p for p in PARTS if key.startswith(p)), None)
                if prefix is None:
                    raise ValueError(f"{file}: {key} belongs to no part of Qwen2-Audio ({', '.join(PARTS)})")
                name = key[len(prefix):]
                if PARTS[prefix] == "adapter":
                    name = next((new + name[len(old):] for old, new in ADAPTER_NAMES.items() if name.startswith(old)),
                                name)
                parts[PARTS[prefix]][name] = f.get_tensor(key)
    for part, state in parts.items():
        (out / part).mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / part / "model.safetensors"), metadata={"format": "pt"})
    audio, text = dict(config["audio_config"]), dict(config["text_config"])
    audio["model_type"] = f"{kind}_encoder"
    (out / "encoder" / "config.json").write_text(json.dumps(audio, indent=1))
    text.setdefault("model_type", "qwen2" if kind == "qwen2_audio" else "llama")
    (out / "hf" / "config.json").write_text(json.dumps(text, indent=1))
    for name in TOKENIZER_FILES:
        if (checkpoint / name).exists():
            shutil.copy(checkpoint / name, out / "hf" / name)
    if kind == "qwen2_audio":
        adapter = {"kind": "linear", "subsampling": 1}
    else:  # stacks intermediate_size / d_model frames (VoxtralModel.get_audio_features' reshape)
        adapter = {"kind": "mlp", "subsampling": audio["intermediate_size"] // audio["hidden_size"],
                   "hidden_size": text["hidden_size"], "bias": False}
    speech = {"encoder": {"kind": kind, "pretrained_path": "encoder"},
              "adapter": {**adapter, "pretrained_path": "adapter"}, "prompt": prompt or chat_prompt(checkpoint, kind)}
    (out / "salm.json").write_text(json.dumps(speech, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m headrace.training.speech.checkpoints",
                                     description="a Qwen2-Audio or Voxtral checkpoint directory -> a SALM export")
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


__all__ = ["chat_prompt", "convert"]
