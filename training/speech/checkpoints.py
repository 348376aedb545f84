"""Released transformers speech LLMs (Qwen2-Audio, Voxtral) as SALMs: one mapping of their checkpoint directory
onto the SALM's parts, read in place by a training job or written out as a SALM export.

A checkpoint directory (config.json ``model_type`` ``qwen2_audio`` / ``voxtral``) holds ``audio_tower.*`` (the
encoder), ``multi_modal_projector.*`` (the adapter; Voxtral's ``linear_1`` / ``linear_2`` are the mlp adapter's
``proj_in`` / ``proj_out``) and ``language_model.{model,lm_head}.*`` (the LLM, its ``text_config``), with its
tokenizer and chat template. ``PARTS`` / ``salm_name`` are that mapping, used both ways:

- in place: a ``model.kind: salm`` job with ``model.pretrained_path: CKPT`` (``with_speech_llm``, run by the
  trainer after ``check_job``) takes the encoder (``speech.encoder: {kind: qwen2_audio | voxtral,
  pretrained_path: CKPT}``: its ``audio_config``, ``audio_tower.*``), the projector (``speech.adapter``, its
  kind / stacking / bias, ``pretrained_path: CKPT``), the LLM (``model.pretrained_path``: ``text_config``,
  ``language_model.*``), the tokenizer and the prompt from the checkpoint; each rank reads only its own slices
  of each part from the checkpoint's safetensors (``headrace.training.models.build.load_safetensors`` with the
  part's prefix), so nothing is written. A setting the user gave that contradicts the checkpoint (another encoder
  kind, an adapter stacking, another tokenizer) is a ``ConfigError`` naming the key. ``job.load_salm(CKPT)``
  builds the same SALM for decoding.
- ``python -m headrace.training.speech.checkpoints CKPT OUT`` writes the SALM export ``OUT/{hf,encoder,adapter}``
  + ``OUT/salm.json`` (what ``job.load_salm(OUT)`` and ``init`` exports read). Cost: one read and one write of the
  weights (tensor by tensor through safetensors).

Encoders: ``Qwen2AudioEncoder`` is Whisper's encoder plus a 2x average pooling and a final LayerNorm; unlike plain
Whisper it attends only over the frames the audio covers (a bidirectional mask over the conv frames, as
``Qwen2AudioModel`` builds it). Features are Whisper's, over its fixed window (``WhisperFrontEnd``):
``ceil(samples / 160)`` mel frames -> ``(frames - 1) // 2 + 1`` conv frames -> ``(conv - 2) // 2 + 1``
pooled frames, one LLM position each through the projector (``adapter.kind: linear``).
``VoxtralEncoder`` is Whisper's encoder without a mask; Voxtral feeds every frame of the window to its
projector, which stacks ``audio_config.intermediate_size / d_model`` (4) consecutive frames and applies
Linear-GELU-Linear without biases: the SALM ``mlp`` adapter with ``subsampling: 4, bias: false``. So a
Voxtral SALM gives each utterance ``max_source_positions / 4`` slots (375 per 30 s window), whatever its length,
as Voxtral's processor does.

Prompt: the checkpoint's own layout around its audio token (Qwen2-Audio: ``<|audio_bos|>`` + the audio +
``<|audio_eos|>``, in the chat template's user turn for a chat checkpoint; Voxtral's default is
``[INST][BEGIN_AUDIO]<|audio|>[/INST]``); ``speech.prompt`` (``--prompt``) gives another. Each answer ends with the
tokenizer's ``eos_token`` (a chat checkpoint's turn end, e.g. ``<|im_end|>``) unless ``speech.answer_end`` says.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from headrace.config import ConfigError, to_dict
from headrace.dataio.usererror import one_line
from headrace.training.config.speech import AUDIO_PLACEHOLDER, SpeechConfig
from headrace.training.dir_files import file_inside, files_inside, read_json_object
from headrace.training.errors import JobInputError

MANIFEST = "salm.json"  # the speech config of a SALM export (job.load_salm reads it)
SPEECH_LLMS = ("qwen2_audio", "voxtral")  # transformers model_types read as SALMs
PARTS = {"audio_tower.": "encoder", "multi_modal_projector.": "adapter", "language_model.": "hf"}
PREFIX = {part: prefix for prefix, part in PARTS.items()}
ADAPTER_NAMES = {"linear_1.": "proj_in.", "linear_2.": "proj_out."}  # Voxtral's projector -> the mlp adapter
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
)
# without a chat template: the base checkpoint's ASR prompt (Qwen2-Audio's processor layout: the audio between
# its markers, then the task), or Voxtral's instruction turn around its audio
BASE_PROMPTS = {
    "qwen2_audio": f"<|audio_bos|>{AUDIO_PLACEHOLDER}<|audio_eos|>Detect the language and recognize the speech: <|en|>",
    "voxtral": f"[INST][BEGIN_AUDIO]{AUDIO_PLACEHOLDER}[/INST]",
}
AUDIO_TOKENS = {"qwen2_audio": "<|AUDIO|>", "voxtral": "[AUDIO]"}
# A chat template is a program from the checkpoint's author (jinja2, sandboxed by transformers, but its loops are not
# bounded: two nested range(100000) run for hours). A real one renders a turn in milliseconds; past this many
# seconds (wall clock: CPU time crawls on a loaded machine) the template is refused.
TEMPLATE_SECONDS = 10.0


def speech_llm_kind(path: str | Path | None) -> str | None:
    """The ``model_type`` of the transformers speech LLM whose checkpoint directory ``path`` is, else None."""
    if path is None or not Path(path).is_dir() or (config := file_inside(path, "config.json")) is None:
        return None
    kind = read_json_object(config).get("model_type")
    return kind if kind in SPEECH_LLMS else None


def part_prefix(path: str | Path, part: str) -> str:
    """The prefix of ``part``'s weights in the directory ``path``: ``PREFIX[part]`` in a speech LLM's checkpoint,
    nothing in a part's own directory (an export's ``hf/``, ``adapter/``)."""
    return PREFIX[part] if speech_llm_kind(path) else ""


def salm_name(part: str, name: str) -> str:
    """The SALM module's name of the checkpoint's ``part`` weight ``name`` (its prefix already removed)."""
    if part == "adapter":
        return next((new + name[len(old) :] for old, new in ADAPTER_NAMES.items() if name.startswith(old)), name)
    return name


def sub_configs(checkpoint: Path) -> tuple[dict, dict]:
    """The checkpoint's ``audio_config`` and ``text_config`` (JobInputError naming config.json and the key when one
    is missing or not an object)."""
    path = file_inside(checkpoint, "config.json")
    config = read_json_object(path)
    found = [config.get(key) for key in ("audio_config", "text_config")]
    for key, value in zip(("audio_config", "text_config"), found):
        if not isinstance(value, dict):
            raise JobInputError(
                f"{path}: {key} is {'missing' if value is None else 'not an object'}; a speech-LLM "
                "checkpoint's config.json has its encoder's audio_config and its LLM's text_config"
            )
    return found[0], found[1]


def _positive_int(section: dict, key: str, where: str) -> int:
    value = section.get(key)
    if type(value) is not int or value < 1:
        raise JobInputError(f"{where}: {key} is {value!r}; it must be a positive integer")
    return value


def adapter_fields(checkpoint: Path, kind: str) -> dict:
    """The ``speech.adapter`` settings that are the checkpoint's projector."""
    if kind == "qwen2_audio":
        return {"kind": "linear", "subsampling": 1, "hidden_size": None, "bias": True}
    audio, text = sub_configs(checkpoint)
    where = f"{checkpoint / 'config.json'}: audio_config"
    # stacks intermediate_size / d_model frames (VoxtralModel.get_audio_features)
    stacked, width = _positive_int(audio, "intermediate_size", where), _positive_int(audio, "hidden_size", where)
    if stacked % width:
        raise JobInputError(
            f"{where}: intermediate_size {stacked} is not a multiple of hidden_size {width} (Voxtral's "
            "projector stacks intermediate_size / hidden_size encoder frames)"
        )
    return {
        "kind": "mlp",
        "subsampling": stacked // width,
        "hidden_size": _positive_int(text, "hidden_size", f"{checkpoint / 'config.json'}: text_config"),
        "bias": False,
    }


class TemplateTooSlow(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """Raise ``TemplateTooSlow`` in the block once it has run ``seconds``: a timer thread sends SIGVTALRM to the
    main thread, whose handler raises (SIGALRM, ``signal.alarm``, stays free for the caller). Main thread only: a
    signal cannot stop another thread, so elsewhere the limit cannot be kept and the call is refused."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("a checkpoint's chat template is rendered only in the main thread (its time limit)")
    main = threading.get_ident()
    fired = threading.Event()

    def fire(signum, frame):
        if fired.is_set():
            raise TemplateTooSlow

    def send():
        fired.set()
        signal.pthread_kill(main, signal.SIGVTALRM)

    old = signal.signal(signal.SIGVTALRM, fire)
    timer = threading.Timer(seconds, send)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        fired.clear()  # a signal still on its way after the block meets a handler that ignores it
        signal.signal(signal.SIGVTALRM, old)


def load_tokenizer(checkpoint: Path):
    """The checkpoint's tokenizer; JobInputError naming the directory when it has none or transformers cannot read
    it (its own several-line message shortened to one)."""
    from transformers import AutoTokenizer

    for name in TOKENIZER_FILES:  # a link out of the directory is refused before transformers follows it
        file_inside(checkpoint, name)
    if not any(file_inside(checkpoint, name) for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise JobInputError(
            f"{checkpoint}: no tokenizer (tokenizer.json, tokenizer.model or vocab.json); a speech-LLM "
            "checkpoint carries its own tokenizer and chat template"
        )
    try:
        return AutoTokenizer.from_pretrained(checkpoint)
    # RecursionError: a tokenizer_config.json nested past Python's recursion limit
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise JobInputError(
            f"{checkpoint}: transformers cannot read its tokenizer: {' '.join(str(e).split())[:300]}"
        ) from None


def chat_prompt(tokenizer, checkpoint: Path, kind: str) -> str:
    """The prompt the checkpoint's chat template gives one user turn of audio (``apply_chat_template`` with the
    audio and no text, its audio token as the placeholder), else ``BASE_PROMPTS[kind]``."""
    from jinja2 import TemplateError

    if tokenizer.chat_template is None:
        return BASE_PROMPTS[kind]
    try:
        with time_limit(TEMPLATE_SECONDS):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": [{"type": "audio", "audio_url": "x"}]}],
                add_generation_prompt=True,
                tokenize=False,
            )
    except TemplateTooSlow:
        raise JobInputError(
            f"{checkpoint}: its chat template ran past {TEMPLATE_SECONDS:g} s for one user turn "
            "(unbounded loops?); refused"
        ) from None
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as e:
        raise JobInputError(
            f"{checkpoint}: its chat template fails on one user turn with audio: "
            f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        ) from None
    if not isinstance(text, str):
        raise JobInputError(f"{checkpoint}: its chat template gives no text for one user turn with audio")
    token = AUDIO_TOKENS[kind]
    if token not in text:
        raise JobInputError(f"{checkpoint}: its chat template puts no {token} token in a user turn with audio")
    return text.replace(token, AUDIO_PLACEHOLDER, 1)


def _refuse_contradiction(section: str, given, theirs: dict, checkpoint: Path, kind: str) -> None:
    """ConfigError for the first field of ``given`` (the user's ``speech.<section>``) that is set and is not the
    checkpoint's (``theirs``)."""
    for key, value in theirs.items():
        mine = getattr(given, key)
        if key == "pretrained_path" and mine is not None:
            mine = str(Path(mine).resolve())
        if mine is not None and mine != value:
            shown = repr(mine) if len(repr(mine)) < 60 else repr(mine)[:57] + "..."
            raise ConfigError(
                f"model.speech.{section}.{key}: {shown} contradicts model.pretrained_path {checkpoint}, "
                f"a {kind} checkpoint whose {section} has {key} {value!r}; leave it unset"
            )


def speech_from_checkpoint(checkpoint: str | Path, speech: SpeechConfig) -> SpeechConfig:
    """``speech`` with its unset encoder / adapter settings and prompt taken from the speech-LLM checkpoint; a
    ConfigError naming the key of a given one that contradicts it."""
    checkpoint = Path(checkpoint).resolve()
    kind = speech_llm_kind(checkpoint)
    theirs = {
        "encoder": {"kind": kind, "config": None, "config_path": None, "pretrained_path": str(checkpoint)},
        "adapter": {**adapter_fields(checkpoint, kind), "pretrained_path": str(checkpoint)},
    }
    for section, fields in theirs.items():
        _refuse_contradiction(section, getattr(speech, section), fields, checkpoint, kind)
    tokenizer = load_tokenizer(checkpoint)
    prompt = speech.prompt or chat_prompt(tokenizer, checkpoint, kind)
    try:
        return dataclasses.replace(
            speech,
            encoder=dataclasses.replace(speech.encoder, kind=kind, pretrained_path=str(checkpoint)),
            adapter=dataclasses.replace(speech.adapter, **theirs["adapter"]),
            prompt=prompt,
            answer_end=speech.answer_end or tokenizer.eos_token,
        )
    except ValueError as e:  # SpeechConfig's own rules (e.g. features with Whisper's encoder) against the result
        raise ConfigError(f"model.speech: {e}") from None


def with_speech_llm(cfg):
    """The SALM kind's ``prepare_job``: ``cfg`` (a ``JobConfig``), or, when its ``model.pretrained_path`` is a
    speech LLM's checkpoint, the job with the checkpoint's encoder, adapter, prompt and tokenizer filled in (module docstring); the same
    job again for a job already filled in. ConfigError for a setting that contradicts the checkpoint, or an
    encoder left unset without such a checkpoint."""
    model = cfg.model
    kind = speech_llm_kind(model.pretrained_path)
    if kind is None:
        if model.speech.encoder.from_checkpoint:
            raise ConfigError(
                f"model.speech.encoder: set one of config / config_path / pretrained_path "
                f"(model.pretrained_path {model.pretrained_path} is not the checkpoint of a "
                f"transformers speech LLM, {' / '.join(SPEECH_LLMS)}, whose encoder could be used)"
            )
        return cfg
    checkpoint = Path(model.pretrained_path).resolve()
    if model.tokenizer is not None and Path(model.tokenizer).resolve() not in (
        checkpoint,
        checkpoint / "tokenizer.json",
    ):
        raise ConfigError(
            f"model.tokenizer: {model.tokenizer} contradicts model.pretrained_path {checkpoint}, a "
            f"{kind} checkpoint with its own tokenizer (its audio token and chat template); leave it "
            "unset"
        )
    speech = speech_from_checkpoint(checkpoint, model.speech)
    return dataclasses.replace(cfg, model=dataclasses.replace(model, tokenizer=str(checkpoint), speech=speech))


def write_manifest(speech: SpeechConfig, out_dir: Path) -> None:
    """``out_dir/salm.json``: ``speech`` with its encoder and adapter in ``out_dir/encoder`` / ``adapter``."""
    raw = to_dict(speech)
    raw["encoder"] = {"kind": speech.encoder.kind, "pretrained_path": "encoder"}
    raw["adapter"] = {**raw["adapter"], "pretrained_path": "adapter"}
    (out_dir / MANIFEST).write_text(json.dumps(raw, indent=1))


def read_parts(checkpoint: Path, kind: str) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's weights split into the SALM's parts (``PARTS``); JobInputError naming the file for a file
    safetensors cannot read, a weight of no part, a weight stored twice, or a part without weights."""
    from safetensors import SafetensorError, safe_open

    parts: dict[str, dict[str, torch.Tensor]] = {part: {} for part in PARTS.values()}
    stored_in: dict[str, Path] = {}
    for file in files_inside(checkpoint, "*.safetensors"):
        try:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    prefix = next((p for p in PARTS if key.startswith(p)), None)
                    if prefix is None:
                        raise JobInputError(f"{file}: {key} belongs to no part of {kind} ({', '.join(PARTS)})")
                    if key in stored_in:
                        raise JobInputError(
                            f"{file}: {key} is also stored in {stored_in[key].name}; which one is meant is unknown"
                        )
                    stored_in[key] = file
                    parts[PARTS[prefix]][salm_name(PARTS[prefix], key[len(prefix) :])] = f.get_tensor(key)
        except SafetensorError as e:
            raise JobInputError(f"{file}: not a readable safetensors file ({' '.join(str(e).split())[:200]})") from None
    for prefix, part in PARTS.items():
        if not parts[part]:
            raise JobInputError(
                f"{checkpoint}: no {prefix}* weights in its *.safetensors files (the {part} of a {kind} checkpoint)"
            )
    return parts


def convert(checkpoint: str | Path, out: str | Path, prompt: str | None = None) -> Path:
    """Write the SALM export of a speech-LLM checkpoint directory (module docstring); returns ``out``. Everything that
    can refuse the checkpoint is read before anything is written; the export is built in a temporary sibling of
    ``out`` and renamed into place, so a refused or failed conversion leaves no partial ``out``."""
    from safetensors.torch import save_file

    checkpoint, out = Path(checkpoint), Path(out)
    kind = speech_llm_kind(checkpoint)
    if kind is None:
        raise JobInputError(f"{checkpoint}: not the checkpoint directory of a {' or '.join(SPEECH_LLMS)} model")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise JobInputError(f"{out}: already exists and is not an empty directory; choose a new output directory")
    audio, text = (dict(c) for c in sub_configs(checkpoint))
    speech = speech_from_checkpoint(checkpoint, SpeechConfig(prompt=prompt))
    parts = read_parts(checkpoint, kind)
    tokenizer_files = [path for name in TOKENIZER_FILES if (path := file_inside(checkpoint, name)) is not None]
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        for part, state in parts.items():
            (tmp / part).mkdir(parents=True)
            save_file(state, str(tmp / part / "model.safetensors"), metadata={"format": "pt"})
        audio["model_type"] = f"{kind}_encoder"
        (tmp / "encoder" / "config.json").write_text(json.dumps(audio, indent=1))
        text.setdefault("model_type", "qwen2" if kind == "qwen2_audio" else "llama")
        (tmp / "hf" / "config.json").write_text(json.dumps(text, indent=1))
        for path in tokenizer_files:
            shutil.copyfile(path, tmp / "hf" / path.name)
        write_manifest(speech, tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m headrace.training.speech.checkpoints",
        description="a Qwen2-Audio or Voxtral checkpoint directory -> a SALM export",
    )
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--prompt", default=None, help=f"with one {AUDIO_PLACEHOLDER} (default: the checkpoint's)")
    args = parser.parse_args(argv)
    try:
        convert(args.checkpoint, args.out, args.prompt)
    except (OSError, ValueError) as e:  # JobInputError is a ValueError; OSError: unreadable input, disk full
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"SALM export of {args.checkpoint} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "MANIFEST",
    "PARTS",
    "SPEECH_LLMS",
    "chat_prompt",
    "convert",
    "part_prefix",
    "salm_name",
    "speech_from_checkpoint",
    "speech_llm_kind",
    "with_speech_llm",
    "write_manifest",
]
