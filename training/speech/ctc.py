"""``model.kind: ctc``: the SALM's speech encoder trained alone with CTC, to start a SALM's encoder from.

The model is ``model.speech``'s encoder on its front end's features (the SALM's own ``encoder_frames``: the same
log-mel, SpecAugment, frame counts) and one Linear to the units + blank (blank = the last class). Units
(``model.ctc.units``): ``chars`` (``CHARS`` of the WER-normalized transcript) or ``tokens`` (``model.tokenizer``'s
pieces). What the trainer calls, as for a SALM (``headrace.training.speech.job``):

- ``build_ctc``: meta model -> FSDP2 per encoder block + root (or DDP) -> materialize (the encoder from
  ``speech.encoder.pretrained_path`` when set);
- ``CTCBatches``: the loader's bucketed audio batches -> ``{audio, audio_lens, labels}``, labels the padded
  units (-100 past each row's), so the step's token count is the units count and the logged loss is CTC nats
  per unit; its state is the loader's;
- ``ctc_loss_sum``: the step's forward; ``validate_ctc``: the val loss plus greedy decodes (argmax per frame,
  repeats merged, blanks dropped: no search, one argmax per frame) and their WER and CER, every rank decoding
  its own share, one all-reduce of the counts;
- ``export_ctc``: ``encoder/`` (config.json + model.safetensors: a SALM's ``speech.encoder.pretrained_path``),
  ``head/model.safetensors`` and ``ctc.json`` (the units).

Cost: the encoder's forward and backward only; validation adds an argmax and a Levenshtein distance per
utterance (O(words^2) and O(chars^2) on the host).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from headrace.dataio.stream.ordering.seeding import rank_seed
from headrace.config import ConfigError, to_dict
from headrace.kernels.loss import IGNORE_INDEX
from headrace.training.config.speech import SpeechConfig
from headrace.training.distributed.dense import apply_ac, apply_ddp, apply_fsdp, uses_fsdp
from headrace.training.distributed.parallel_dims import ParallelDims
from headrace.training.errors import refused_as
from headrace.training.models.build import load_safetensors, param_dtype
from headrace.training.models.loss import bf16_autocast, unwrap_ddp
from headrace.training.speech.encoders import front_end
from headrace.training.speech.eval import normalize, word_errors
from headrace.training.speech.job import ConvertedBatches, save_parts
from headrace.training.speech.model import ctc_targets_loss_sum, encoder_frames
from headrace.training.step import eval_mode

CHARS = " abcdefghijklmnopqrstuvwxyz'0123456789"  # index = unit id; blank = len(CHARS)
CTC_INPUTS = ("audio", "audio_lens", "labels")
MANIFEST = "ctc.json"


class CTCModel(nn.Module):
    """Encoder + a Linear to ``units`` classes + blank (module docstring). ``forward`` -> the summed CTC loss of
    ``labels``; without labels, ``logits``' pair (through ``forward`` so that FSDP2's root hooks gather the head)."""

    def __init__(self, encoder: nn.Module, head: nn.Linear, cfg: SpeechConfig, front):
        super().__init__()
        self.encoder, self.head = encoder, head
        self.cfg, self.front = cfg, front  # (the names ``encoder_frames`` reads, as on a SALM)
        self.config = encoder.config
        self.augment_generator: torch.Generator | None = None

    def logits(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T, units + 1]`` and each utterance's frame count."""
        hidden, frames = encoder_frames(self, audio, audio_lens)
        return self.head(hidden), frames

    def forward(self, audio: torch.Tensor, audio_lens: torch.Tensor, labels: torch.Tensor | None = None):
        logits, frames = self.logits(audio, audio_lens)
        if labels is None:
            return logits, frames
        return ctc_targets_loss_sum(logits, frames, labels.clamp(min=0), (labels != IGNORE_INDEX).sum(1))


def greedy_ctc(logits: torch.Tensor, frames: torch.Tensor) -> list[list[int]]:
    """Best path of each row: argmax per frame over its first ``frames[b]`` frames, repeats merged, blanks
    (the last class) dropped."""
    blank = logits.shape[-1] - 1
    best = logits.argmax(-1).tolist()
    out = []
    for row, n in zip(best, frames.tolist()):
        units, previous = [], None
        for unit in row[:n]:
            if unit != previous and unit != blank:
                units.append(unit)
            previous = unit
        out.append(units)
    return out


class Units:
    """Transcript <-> unit ids for ``model.ctc.units`` (module docstring)."""

    def __init__(self, kind: str, tokenizer_path: str | None):
        self.kind, self.tokenizer = kind, None
        if kind == "tokens":
            if tokenizer_path is None:
                raise ConfigError("model.ctc.units: tokens needs model.tokenizer")
            from headrace.training.speech.prompt import load_tokenizer

            self.tokenizer = load_tokenizer(tokenizer_path)
        self.size = len(CHARS) if self.tokenizer is None else self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.tokenizer is not None:
            return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        return [[CHARS.index(c) for c in " ".join(normalize(t)) if c in CHARS] for t in texts]

    def decode(self, units: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(units, skip_special_tokens=True)
        return "".join(CHARS[u] for u in units)


class CTCBatches(ConvertedBatches):
    """Loader audio batches (``audio``, ``audio_lens``, ``text``) -> CTC step batches (module docstring);
    ``state_dict`` / ``load_state_dict`` are the loader's."""

    def __init__(self, loader, units: Units):
        self.loader, self.units = loader, units

    def convert(self, batch: dict) -> dict:
        texts = batch.get("text")
        if texts is None or any(t is None for t in texts):
            raise ValueError(
                f"model.kind: ctc needs each utterance's transcript (text): a batch has samples without "
                f"it (keys {batch.get('__key__', [])[:3]}...)"
            )
        ids = self.units.encode(texts)
        labels = torch.full((len(ids), max(1, max(map(len, ids)))), IGNORE_INDEX, dtype=torch.long)
        for row, units in enumerate(ids):
            labels[row, : len(units)] = torch.tensor(units, dtype=torch.long)
        return {
            "audio": batch["audio"],
            "audio_lens": batch["audio_lens"],
            "labels": labels,
            **{k: batch[k] for k in ("__key__", "__valid__", "text") if k in batch},
        }


def ctc_units(model) -> Units:
    """The units of ``model`` (a ``ModelConfig`` of kind ctc): ``model.ctc.units``, characters by default."""
    return Units(model.ctc.units if model.ctc is not None else "chars", model.tokenizer)


def build_ctc(cfg, dims: ParallelDims, device: torch.device):
    """meta model -> FSDP2 (encoder blocks, then the root) or DDP -> this rank's shards -> init / load.
    Returns (model, the encoder's config with ``vocab_size`` = units + blank)."""
    if dims.tp_enabled or dims.pp_enabled or dims.cp_enabled or dims.ep_enabled:
        raise ValueError(
            "model.kind: ctc trains data-parallel only (FSDP2 / HSDP / DDP): set tp / pp / cp / ep sizes to 1"
        )
    speech = cfg.model.speech
    front = front_end(speech.encoder.kind, speech.features)
    enc_config = front.config(speech.encoder)
    units = ctc_units(cfg.model)
    with torch.device("meta"), refused_as("model.speech.encoder.config"):  # e.g. a subsampling_factor of 0
        model = CTCModel(front.build(enc_config), nn.Linear(enc_config.hidden_size, units.size + 1), speech, front)
    apply_ac(model.encoder.layers, cfg.distributed)
    dtype = param_dtype(cfg.trainer.precision)
    if uses_fsdp(dims, cfg.distributed, dtype):
        mesh = dims.get_mesh("fsdp")
        apply_fsdp(model.encoder, model.encoder.layers, mesh, dtype, cfg.distributed.reshard_after_forward)
        apply_fsdp(model, [], mesh, dtype, cfg.distributed.reshard_after_forward)
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.encoder.modules():
            module._is_hf_initialized = False
        front.initialize(model.encoder)
        model.head.reset_parameters()
        if path := speech.encoder.pretrained_path:
            load_safetensors(model.encoder, path, prefix=front.checkpoint_prefix(path))
    model.augment_generator = torch.Generator().manual_seed(
        rank_seed(cfg.trainer.seed, dims.get_mesh("dp").get_local_rank())
    )
    if cfg.distributed.strategy == "ddp":
        model = apply_ddp(model, dims)
    enc_config.vocab_size = units.size + 1
    return model, enc_config


def ctc_loss_sum(model: nn.Module, batch: dict, autocast: bool) -> torch.Tensor:
    """The step's forward for a CTC micro-batch (summed CTC loss over the batch's units)."""
    with bf16_autocast(batch["audio"].device.type, autocast):
        return model(**{k: batch[k] for k in CTC_INPUTS})


def wrap_ctc_loader(loader: Iterable, model: nn.Module, cfg, dims: ParallelDims) -> CTCBatches:
    """The kind's ``wrap_loader``: audio batches -> CTC step batches."""
    return CTCBatches(loader, ctc_units(cfg.model))


def error_counts(units: Units, references: list[str], hypotheses: list[list[int]]) -> list[int]:
    """``[word errors, reference words, char errors, reference chars]`` summed over the rows (both sides
    normalized as ``headrace.training.speech.eval.normalize``: lower case, no punctuation)."""
    counts = [0, 0, 0, 0]
    for ref, hyp_units in zip(references, hypotheses):
        ref_words, hyp_words = normalize(ref), normalize(units.decode(hyp_units))
        ref_chars, hyp_chars = list(" ".join(ref_words)), list(" ".join(hyp_words))
        for i, n in enumerate(
            (word_errors(ref_words, hyp_words), len(ref_words), word_errors(ref_chars, hyp_chars), len(ref_chars))
        ):
            counts[i] += n
    return counts


@torch.no_grad()
def validate_ctc(model: nn.Module, batches: Iterable[dict], units: Units, device: torch.device, *, dp_group) -> dict:
    """One pass over this rank's val batches (``headrace.training.validation``'s: ``__val_docs__`` /
    ``__val_tokens__`` counted, tail rows ``__valid__`` False loss-free): ``val_loss`` (CTC nats per unit),
    ``val_wer``, ``val_cer``, ``val_tokens``, ``val_docs`` over every dp rank. A collective."""

    sums = torch.zeros(7, dtype=torch.float64)  # loss, units, docs, word errors, words, char errors, chars
    with eval_mode(model):
        for batch in batches:
            logits, frames = model(batch["audio"], batch["audio_lens"])
            labels = batch["labels"]
            sums[0] += float(ctc_targets_loss_sum(logits, frames, labels.clamp(min=0), (labels != IGNORE_INDEX).sum(1)))
            sums[1] += batch["__val_tokens__"]
            sums[2] += batch["__val_docs__"]
            valid = [bool(v) for v in batch.get("__valid__", [True] * len(labels))]
            rows = [i for i, ok in enumerate(valid) if ok]
            hyps = greedy_ctc(logits, frames)
            sums[3:] += torch.tensor(
                error_counts(units, [batch["text"][i] for i in rows], [hyps[i] for i in rows]), dtype=torch.float64
            )
    sums = sums.to(device)
    dist.all_reduce(sums, group=dp_group)
    loss, tokens, docs, werr, words, cerr, chars = sums.tolist()
    return {
        "val_loss": loss / max(tokens, 1),
        "val_tokens": int(tokens),
        "val_docs": int(docs),
        "val_wer": werr / max(words, 1),
        "val_cer": cerr / max(chars, 1),
    }


def export_ctc(model: nn.Module, cfg, out_dir: str | Path) -> None:
    """``out_dir/{encoder,head,ctc.json}`` (module docstring). Collective; rank 0 writes."""
    ctc = unwrap_ddp(model)
    out_dir = Path(out_dir)
    if save_parts(ctc, ("encoder", "head"), out_dir):
        speech = to_dict(cfg.model.speech)
        speech["encoder"] = {"kind": cfg.model.speech.encoder.kind, "pretrained_path": "encoder"}
        (out_dir / MANIFEST).write_text(
            json.dumps({"units": ctc_units(cfg.model).kind, "chars": CHARS, "speech": speech}, indent=1)
        )


__all__ = [
    "CHARS",
    "CTCBatches",
    "CTCModel",
    "Units",
    "build_ctc",
    "ctc_loss_sum",
    "error_counts",
    "export_ctc",
    "greedy_ctc",
    "validate_ctc",
    "wrap_ctc_loader",
]
