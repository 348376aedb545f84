"""The listening signal of a SALM: does the answer depend on the audio?

Two answer-token losses over the same utterances and the same token layout: with each utterance's own
audio (the validation / eval loss), and with another utterance's audio in its place. The replacement
audio of row ``i`` is row ``j = (i + 1) mod B``'s waveform, repeated or cut to row ``i``'s sample count
(so the audio slots, the prompt, the answer tokens and their positions are unchanged and only the
frames differ); a batch of one utterance gets silence of its length. A model that ignores the audio
gets the same loss either way: ``listening_ratio = own / mismatched`` is ~1; a model that listens gets
a higher loss from the wrong audio, so the ratio falls below 1.

Used by validation (``val_mismatched_loss``, ``val_listening_ratio``: a second pass over the val stream
through the same step forward, so every layout validation supports -- FSDP2, TP, SP -- computes it the
same way) and by ``python -m headrace.training.speech.eval`` (one extra forward per batch). Cost: one forward of
the val set more per validation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from headrace.training.components.labels import labelled_tokens, mask_invalid_rows
from headrace.training.speech.job import SALM_INPUTS, salm_loss_sum


def partner_rows(batch_size: int) -> torch.Tensor:
    """The row whose audio each row gets: ``i -> (i + 1) mod B`` (never itself when ``B > 1``)."""
    return (torch.arange(batch_size) + 1) % batch_size


def mismatched_audio(audio: torch.Tensor, audio_lens: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` audio where row ``i`` holds row ``partner_rows(B)[i]``'s waveform tiled to ``audio_lens[i]``
    samples (silence for a batch of one); zero past each row's length, like the loader's padding."""
    batch, width = audio.shape
    t = torch.arange(width, device=audio.device)[None, :]
    inside = t < audio_lens[:, None]
    if batch == 1:
        return torch.zeros_like(audio)
    partner = partner_rows(batch).to(audio.device)
    source, source_lens = audio[partner], audio_lens[partner].clamp(min=1)
    tiled = source.gather(1, (t % source_lens[:, None]).expand(batch, -1))
    return torch.where(inside, tiled, torch.zeros((), dtype=audio.dtype, device=audio.device))


def with_mismatched_audio(forward: Callable) -> Callable:
    """``forward(model, batch, autocast)`` run on the batch with ``mismatched_audio`` in place of its own."""

    def mismatched(model, batch: dict, autocast: bool) -> torch.Tensor:
        return forward(model, {**batch, "audio": mismatched_audio(batch["audio"], batch["audio_lens"])}, autocast)

    return mismatched


@torch.no_grad()
def listening_sums(model, step_batch: dict, device: torch.device) -> torch.Tensor:
    """``[own loss sum, mismatched loss sum, answer tokens]`` (float64, on the host) of one SALM step batch
    (``SpeechBatches.convert``'s), tail padding rows (``__valid__`` False) left out. Two forwards, in eval mode
    as the caller set it."""
    batch = mask_invalid_rows(step_batch)
    batch = {k: batch[k].to(device) for k in SALM_INPUTS}
    own = salm_loss_sum(model, batch, False)
    mismatched = with_mismatched_audio(salm_loss_sum)(model, batch, False)
    return torch.tensor([float(own), float(mismatched), labelled_tokens(batch)], dtype=torch.float64)


# At or above: the audio explains under a fifth of the answer loss. A model that transcribes (WER <= 0.2) has
# a ratio far below (its answers cost little with their own audio, a full sentence's worth with another's:
# BENCHMARKS.md "Speech recipe", the bridge runs at 0.1-0.4 by step 200), and one that writes transcript-like text
# unrelated to the audio sits near 1 (issue 42's run: 0.97 -> 0.951 with WER 2.6, which 0.98 missed).
NOT_LISTENING_RATIO = 0.8


def not_listening_warning(record: dict, after_step: int) -> str | None:
    """The warning for a validation ``record`` (``step``, ``val_listening_ratio``) at or past ``after_step`` whose
    ratio is still >= ``NOT_LISTENING_RATIO`` (its comment says why that value), in plain words with what to try; None otherwise. The trainer
    prints it once per run."""
    ratio = record.get("val_listening_ratio")
    if ratio is None or record["step"] < after_step or ratio < NOT_LISTENING_RATIO:
        return None
    return (
        f"warning: at step {record['step']} the model is still not listening to the audio: its validation "
        f"loss with each utterance's own audio is {ratio:.3f} of the loss with another utterance's audio "
        f"(1.0 = the audio is ignored), so it has learnt what transcripts look like, not what was said. "
        f"Try: start the encoder from a CTC-trained one (a model.kind: ctc run, then "
        f"model.speech.encoder.pretrained_path: RUN/encoder) and hand the LLM what its CTC head reads (a "
        f"ctc.units: tokens run, then model.speech.adapter: {{kind: ctc_bridge, head_path: RUN/head}}), and train "
        f"the LLM (or LoRA) rather than freeze it unless it already knows the language; see docs/speech-recipe.md"
    )


def listening_figures(own_loss: float, mismatched_loss: float) -> dict:
    return {"val_mismatched_loss": mismatched_loss, "val_listening_ratio": own_loss / max(mismatched_loss, 1e-12)}


def validate_listening(run: Callable[[Callable], dict], forward: Callable) -> dict:
    """Validation figures of ``run(forward)`` plus the mismatched pass's loss and the ratio (a collective:
    ``run`` is one pass over the val stream on every rank)."""
    figures = run(forward)
    mismatched = run(with_mismatched_audio(forward))
    if (mismatched["val_tokens"], mismatched["val_docs"]) != (figures["val_tokens"], figures["val_docs"]):
        raise RuntimeError(
            f"listening: the mismatched pass read other utterances ({mismatched['val_docs']} docs, "
            f"{mismatched['val_tokens']} tokens) than the validation pass ({figures['val_docs']}, "
            f"{figures['val_tokens']})"
        )
    return {**figures, **listening_figures(figures["val_loss"], mismatched["val_loss"])}


__all__ = [
    "NOT_LISTENING_RATIO",
    "listening_figures",
    "listening_sums",
    "mismatched_audio",
    "not_listening_warning",
    "partner_rows",
    "validate_listening",
    "with_mismatched_audio",
]
