"""What the trainer calls for ``model.kind: salm``: build, batches, the step's forward, export, load.

``headrace.training.train`` stays one loop for every model kind; the SALM's spec (``headrace.training.speech.kind``)
hands it:

- ``build_salm``: meta SALM -> ``parallelize_salm`` -> materialize (LLM / encoder / adapter from local
  safetensors when configured) -> DDP if asked;
- ``SpeechBatches``: wraps the loader's bucketed audio batches and adds the token layout
  (``headrace.training.speech.prompt``: tokenized transcript, prompt, audio slots from the audio lengths) on the
  host, inside the prefetcher's thread, so it overlaps the step; its state is the loader's;
- ``salm_loss_sum``: the step's forward (log-mel on the device happens inside the model);
- ``export_salm``: ``hf/`` (the LLM, loadable by ``AutoModelForCausalLM``), ``encoder/`` (config.json +
  model.safetensors, loadable by ``ParakeetEncoder`` / ``WhisperEncoder.from_pretrained``),
  ``adapter/model.safetensors`` and ``salm.json`` (the speech config) -- ``load_salm(dir)`` rebuilds the pair for
  inference (also straight from a Qwen2-Audio / Voxtral checkpoint directory).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from headrace.dataio.stream.ordering.seeding import rank_seed
from headrace.config import from_dict
from headrace.training.checkpoint.export import export_hf
from headrace.training.config.job_config import ModelConfig
from headrace.training.config.speech import SpeechConfig
from headrace.training.distributed.dense import apply_ddp
from headrace.training.dir_files import read_json_object
from headrace.training.distributed.parallel_dims import ParallelDims
from headrace.training.errors import JobInputError
from headrace.training.models.build import build_hf_config, param_dtype
from headrace.training.models.converters import build_converters
from headrace.training.models.loss import bf16_autocast, unwrap_ddp
from headrace.training.speech.checkpoints import MANIFEST, speech_from_checkpoint, speech_llm_kind, write_manifest
from headrace.training.speech.model import SALM, build_meta_salm, materialize_salm
from headrace.training.speech.parallelize import parallelize_salm
from headrace.training.speech.prompt import build_batch, load_tokenizer, make_template

SALM_INPUTS = ("audio", "audio_lens", "input_ids", "labels", "audio_mask", "position_ids")


def build_salm(cfg, dims: ParallelDims, device: torch.device):
    """meta SALM -> parallelize -> this rank's shards -> init / load (-> DDP). Returns (model, LLM config)."""
    if cfg.model.speech.eval_every and dims.sequence_parallel:
        raise ValueError(
            "model.speech.eval_every needs sequence_parallel: false (one-token decoding steps cannot "
            "split over the tp ranks); evaluate the export with python -m headrace.training.speech.eval"
        )
    llm_config = build_hf_config(cfg.model, text_model=True)
    model = build_meta_salm(llm_config, cfg.model.speech)
    check_audio_input(model, cfg.data.decode)
    # no whole-model convert point: the config refuses, for a SALM, the converters that need one (KindConfig)
    converters = build_converters(cfg)
    model = parallelize_salm(
        model,
        dims,
        cfg.distributed,
        param_dtype(cfg.trainer.precision),
        after_tp=converters.after_tp(converted_parts),
    )
    materialize_salm(model, device, cfg.model.pretrained_path)
    converters.after_materialize(converted_parts(model))
    model.augment_generator = torch.Generator().manual_seed(
        rank_seed(cfg.trainer.seed, dims.get_mesh("dp").get_local_rank())
    )
    if cfg.distributed.strategy == "ddp":
        model = apply_ddp(model, dims)
    return model, llm_config


def converted_parts(salm: SALM) -> dict[str, nn.Module]:
    """The SALM's parts a model converter may change (by these names)."""
    return {"llm": salm.llm, "encoder": salm.encoder}


def check_audio_input(model: SALM, decode) -> None:
    """The loader's audio suits the encoder: its sample rate (when set), and no utterance longer than the
    encoder's fixed window (Whisper's), which ``data.decode.max_duration`` turns into counted skips."""
    kind, rate = model.cfg.encoder.kind, model.cfg.sample_rate
    if decode.sample_rate is not None and decode.sample_rate != rate:
        raise ValueError(
            f"data.decode.sample_rate {decode.sample_rate} != {rate} Hz, the rate the {kind} encoder's "
            "features are computed at"
        )
    limit = model.front.max_seconds(model.encoder)
    if limit is not None and (decode.max_duration is None or decode.max_duration > limit):
        raise ValueError(
            f"model.speech.encoder ({kind}) takes at most {limit:g} s of audio: set "
            f"data.decode.max_duration <= {limit:g} (longer utterances become counted decode skips)"
        )


class ConvertedBatches:
    """``self.loader``'s batches through ``self.convert``; its state is the loader's (a SALM's and a CTC stage's step
    batches: ``SpeechBatches``, ``headrace.training.speech.ctc.CTCBatches``)."""

    loader: Iterable

    def convert(self, batch: dict) -> dict:
        raise NotImplementedError

    def __iter__(self):
        return map(self.convert, self.loader)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state) -> None:
        self.loader.load_state_dict(state)


class SpeechBatches(ConvertedBatches):
    """Loader audio batches (``audio``, ``audio_lens``, and the answer as ``text`` or ``tokens``) -> SALM
    step batches; ``state_dict`` / ``load_state_dict`` are the loader's."""

    def __init__(self, loader, model: nn.Module, cfg: SpeechConfig, tokenizer_path: str, multiple_of: int = 1):
        if tokenizer_path is None:
            raise ValueError("model.tokenizer is required with model.kind: salm (prompt and transcripts)")
        self.loader, self.cfg, self.multiple_of = loader, cfg, multiple_of
        self.salm = unwrap_ddp(model)
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.template = make_template(self.tokenizer, cfg.prompt, cfg.answer_end)

    def answers(self, batch: dict) -> list[list[int]]:
        if "tokens" in batch and self.cfg.answer_field == "text":  # the shards carry token ids already
            return [t[:n].tolist() for t, n in zip(batch["tokens"], batch["token_lens"])]
        texts = batch.get(self.cfg.answer_field)
        if texts is None or any(t is None for t in texts):
            raise ValueError(
                f"model.speech.answer_field {self.cfg.answer_field!r}: a batch has samples without "
                f"it (keys {batch.get('__key__', [])[:3]}...)"
            )
        return [
            e.ids[: self.cfg.max_answer_tokens] for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)
        ]

    def convert(self, batch: dict) -> dict:
        slots = self.salm.audio_slots(batch["audio_lens"])
        out = build_batch(self.template, slots, self.answers(batch), multiple_of=self.multiple_of)
        return {
            "audio": batch["audio"],
            "audio_lens": batch["audio_lens"],
            **out,
            **{k: batch[k] for k in ("__key__", "__valid__", "text") if k in batch},
        }


def salm_loss_sum(model: nn.Module, batch: dict, autocast: bool) -> torch.Tensor:
    """The step's forward for a SALM micro-batch (summed answer cross-entropy)."""
    with bf16_autocast(batch["audio"].device.type, autocast):
        return model(**{k: batch[k] for k in SALM_INPUTS})


def export_salm(model: nn.Module, cfg, out_dir: str | Path) -> Path | None:
    """``out_dir/{hf,encoder,adapter,salm.json}`` (see the module docstring). Collective; rank 0 writes."""
    salm: SALM = unwrap_ddp(model)
    out_dir = Path(out_dir)
    converters = build_converters(cfg)
    export_hf(salm.llm, salm.config, out_dir / "hf", cfg.model.tokenizer, transform=converters.export_transform("llm"))
    encoder_transform = converters.export_transform("encoder")  # encoder/ holds the merged weights, no adapter

    def merged(name: str, state: dict) -> dict:
        return encoder_transform(state) if encoder_transform is not None and name == "encoder" else state

    if not save_parts(salm, ("encoder", "adapter"), out_dir, merged):
        return None
    write_manifest(salm.cfg, out_dir)
    return out_dir


def save_parts(model: nn.Module, names: tuple[str, ...], out_dir: Path, transform=None) -> bool:
    """``out_dir/<name>/model.safetensors`` for each named submodule of ``model`` (full state dicts gathered from
    every rank; ``transform(name, state)`` the state written, when given), and ``encoder/config.json``: what
    ``model.speech.encoder.pretrained_path`` reads. Collective; rank 0 writes and returns True."""
    parts = {
        name: get_model_state_dict(
            getattr(model, name), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        for name in names
    }
    if transform is not None:
        parts = {name: transform(name, state) for name, state in parts.items()}
    if dist.get_rank() != 0:
        return False
    for name, state in parts.items():
        (out_dir / name).mkdir(parents=True, exist_ok=True)
        state = {k.replace("._checkpoint_wrapped_module", ""): v.contiguous() for k, v in state.items()}
        save_file(state, str(out_dir / name / "model.safetensors"), metadata={"format": "pt"})
    model.encoder.config.save_pretrained(out_dir / "encoder")
    return True


def load_salm(path: str | Path, device: str | torch.device = "cpu") -> tuple[SALM, SpeechConfig]:
    """The SALM in ``path`` (an export, or a transformers speech LLM's checkpoint directory read in place:
    ``headrace.training.speech.checkpoints``) as one plain module in eval mode (for decoding), with its config."""
    path = Path(path)
    if speech_llm_kind(path):
        speech, llm_path = speech_from_checkpoint(path, SpeechConfig()), path
    else:
        raw = read_json_object(path / MANIFEST)
        for part in ("encoder", "adapter"):
            if not isinstance(raw.get(part), dict) or not isinstance(raw[part].get("pretrained_path"), str):
                raise JobInputError(f"{path / MANIFEST}: {part}.pretrained_path is missing or not a string")
            raw[part]["pretrained_path"] = str(path / raw[part]["pretrained_path"])
        speech, llm_path = from_dict(SpeechConfig, raw, "salm.json"), path / "hf"
    llm_config = build_hf_config(ModelConfig(pretrained_path=str(llm_path)), text_model=True)
    model = build_meta_salm(llm_config, speech)
    materialize_salm(model, torch.device(device), str(llm_path))
    return model.eval(), speech


def wrap_loader(loader: Iterable, model: nn.Module, cfg, dims: ParallelDims) -> SpeechBatches:
    """The trainer's hook: audio batches -> SALM step batches (rows padded to a multiple of tp under SP)."""
    return SpeechBatches(
        loader, model, cfg.model.speech, cfg.model.tokenizer, multiple_of=dims.tp if dims.sequence_parallel else 1
    )


__all__ = [
    "SALM_INPUTS",
    "ConvertedBatches",
    "SpeechBatches",
    "build_salm",
    "check_audio_input",
    "export_salm",
    "load_salm",
    "salm_loss_sum",
    "save_parts",
    "wrap_loader",
]
