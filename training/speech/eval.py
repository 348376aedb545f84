"""Speech eval of an exported SALM (or of a released Qwen2-Audio / Voxtral checkpoint as it is): greedy transcripts,
WER, per-utterance JSONL; data-parallel under torchrun.

    torchrun --nproc-per-node 2 -m headrace.training.speech.eval --model runs/speech_demo --data demo/shards/audio \
        --split val --out runs/speech_demo/eval.jsonl

Every rank loads the exported pair (``headrace.training.speech.job.load_salm``: the model is small enough to
replicate for decoding), reads its share of the split through the loader's duration bucketing with
``epochs: 1`` (each utterance exactly once across ranks), and decodes greedily with transformers'
``generate`` from the prompt embeddings (left-padded prompt, audio frames in the placeholder's slots,
KV cache). Each batch also runs two forwards for the listening signal (``headrace.training.speech.listening``: the
answer loss with its own audio and with another utterance's). Rank 0 gathers the hypotheses, writes one
JSON line per utterance (key, reference, hypothesis, word errors) and prints the corpus WER, both losses
and their ratio.

WER = (substitutions + deletions + insertions) / reference words, summed over the corpus, after
lower-casing and dropping punctuation; ``word_errors`` is a word-level Levenshtein distance
(O(len(ref) * len(hyp)) per utterance).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from headrace.dataio.loader import build_loader
from headrace.dataio.usererror import EXIT_USER_ERROR, debug_requested, is_user_error, one_line
from headrace.training.components.data import open_data
from headrace.training.distributed.parallel_dims import gather_objects
from headrace.training.distributed.process_group import init_distributed
from headrace.training.errors import JobInputError
from headrace.training.models.loss import unwrap_ddp
from headrace.training.speech.checkpoints import speech_llm_kind
from headrace.training.speech.job import SpeechBatches, load_salm
from headrace.training.speech.listening import listening_sums
from headrace.training.speech.prompt import build_batch

_PUNCT = re.compile(r"[^\w\s']")


def normalize(text: str) -> list[str]:
    return _PUNCT.sub(" ", text.lower()).split()


def word_errors(reference: list[str], hypothesis: list[str]) -> int:
    """Minimum substitutions + deletions + insertions turning ``reference`` into ``hypothesis``."""
    row = list(range(len(hypothesis) + 1))
    for i, ref_word in enumerate(reference, 1):
        prev_diag, row[0] = row[0], i
        for j, hyp_word in enumerate(hypothesis, 1):
            prev_diag, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev_diag + (ref_word != hyp_word))
    return row[-1]


def corpus_wer(pairs: list[tuple[str, str]]) -> float:
    """Summed word errors over summed reference words of (reference, hypothesis) pairs."""
    errors = sum(word_errors(normalize(r), normalize(h)) for r, h in pairs)
    words = sum(len(normalize(r)) for r, _ in pairs)
    return errors / max(words, 1)


def token_caps(audio_lens: torch.Tensor, sample_rate: int, tokens_per_second: float, max_new_tokens: int) -> list[int]:
    """Each utterance's most answer tokens: ``ceil(seconds * tokens_per_second) + 4`` (a short utterance still
    gets a few), never above ``max_new_tokens``. Speech cannot say more tokens than its duration holds, so a
    model that does not stop is cut near the length of what it heard rather than at a fixed limit."""
    seconds = audio_lens.double().cpu() / sample_rate
    return [min(max_new_tokens, math.ceil(s * tokens_per_second) + 4) for s in seconds.tolist()]


@torch.no_grad()
def greedy_transcripts(
    model,
    template,
    tokenizer,
    audio: torch.Tensor,
    audio_lens: torch.Tensor,
    max_new_tokens: int,
    *,
    synced: bool = False,
) -> list[tuple[str, bool]]:
    """Greedy decoding of a batch of utterances: each one's text and whether it ended (the end token came
    within its ``token_caps`` length, ``model.speech.max_tokens_per_second``). ``synced``: every rank keeps
    stepping until all ranks' rows are done (``generate(synced_gpus=True)``), so FSDP2's per-layer collectives
    stay matched (every rank then generates up to ``max_new_tokens``; the caps still cut each row)."""
    caps = token_caps(audio_lens, model.cfg.sample_rate, model.cfg.max_tokens_per_second, max_new_tokens)
    prompt = build_batch(template, model.audio_slots(audio_lens), left_pad=True)
    prompt = {k: v.to(audio.device) for k, v in prompt.items()}
    embeds = model.llm.embed(prompt["input_ids"], model.encode(audio, audio_lens), prompt["audio_mask"])
    out = model.llm.causal_lm.generate(
        inputs_embeds=embeds,
        attention_mask=prompt["attention_mask"],
        max_new_tokens=max_new_tokens if synced else max(caps),
        do_sample=False,
        synced_gpus=synced,
        eos_token_id=template.eos_id,
        pad_token_id=template.pad_id,
    )
    texts = []
    for row, cap in zip(out.tolist(), caps):
        row = row[: cap + 1]  # the cap's tokens and, if it came then, the end token
        ended = template.eos_id in row
        row = row[: row.index(template.eos_id)] if ended else row[:cap]
        texts.append((tokenizer.decode(row, skip_special_tokens=True), ended))
    return texts


def listening_line(result: dict) -> str:
    """Both losses to 5 significant digits (a model that transcribes well has losses of 1e-4 and below)."""
    return (
        f"answer loss {result['loss']:.5g} with its own audio, {result['mismatched_loss']:.5g} with another "
        f"utterance's: listening ratio {result['listening_ratio']:.3f}"
    )


def eval_loader(data: str, split: str, sample_rate: int, batch_duration: float):
    """This rank's share of ``split``: duration-bucketed batches, one pass, each utterance once across ranks."""
    return build_loader(
        dict(
            datasets=[dict(path=data, split=split)],
            epochs=1,
            shuffle=False,
            num_workers=0,
            decode=dict(sample_rate=sample_rate),
            bucketing=dict(max_duration=batch_duration, num_buckets=1),
        ),
        dist.get_rank(),
        dist.get_world_size(),
    )


def decode_split(
    model, cfg, tokenizer_path: str, loader, *, max_new_tokens: int, out: str | None, synced: bool = False
) -> dict:
    """Decode every batch of ``loader`` and take its answer-token losses with its own and with mismatched
    audio (``headrace.training.speech.listening``); rank 0 gathers, writes the JSONL and returns ``{"wer",
    "utterances", "ended" (hypotheses that ended with the end token), "words", "loss", "mismatched_loss", "listening_ratio"}`` (other ranks: ``{}``). A collective."""
    speech = SpeechBatches([], model, cfg, tokenizer_path)
    rows, sums = [], torch.zeros(3, dtype=torch.float64)
    for batch in loader:
        device = next(model.parameters()).device
        hyps = greedy_transcripts(
            model,
            speech.template,
            speech.tokenizer,
            batch["audio"].to(device),
            batch["audio_lens"].to(device),
            max_new_tokens,
            synced=synced,
        )
        sums += listening_sums(model, speech.convert(batch), device)
        valid = batch.get("__valid__", [True] * len(hyps))
        for key, ref, (hyp, ended), ok in zip(batch["__key__"], batch["text"], hyps, valid):
            if ok:  # not a rank's tail padding sample
                rows.append(
                    {
                        "key": key,
                        "reference": ref,
                        "hypothesis": hyp,
                        "ended": ended,
                        "errors": word_errors(normalize(ref), normalize(hyp)),
                        "words": len(normalize(ref)),
                    }
                )
    everyone = gather_objects((rows, sums.tolist()))
    if dist.get_rank() != 0:
        return {}
    rows = sorted((r for part, _ in everyone for r in part), key=lambda r: r["key"])
    own, mismatched, tokens = (sum(s[i] for _, s in everyone) for i in range(3))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    words = sum(r["words"] for r in rows)
    loss, mismatched_loss = own / max(tokens, 1), mismatched / max(tokens, 1)
    return {
        "wer": sum(r["errors"] for r in rows) / max(words, 1),
        "utterances": len(rows),
        "ended": sum(r["ended"] for r in rows),
        "words": words,
        "loss": loss,
        "mismatched_loss": mismatched_loss,
        "listening_ratio": loss / max(mismatched_loss, 1e-12),
    }


def check_window(model, loader) -> None:
    """JobInputError naming the first utterance of the split (by its indexed duration) longer than the encoder's
    fixed window: every rank refuses it alike, before decoding (a rank failing alone mid-split would leave the
    others waiting in the gather)."""
    from headrace.training.components.data import shard_sources
    from headrace.training.errors import JobInputError

    limit = model.front.max_seconds(model.encoder)
    for source in shard_sources(loader) if limit is not None else ():
        durations = np.asarray(source.index.samples["duration"], dtype=np.float64)
        rows = np.concatenate(
            [np.arange(a, a + n) for a, n in zip(source.shard_starts, source.shard_sizes)]
            or [np.zeros(0, dtype=np.int64)]
        )
        long = rows[durations[rows] > limit]
        if len(long):
            raise JobInputError(
                f"--data: utterance {source.index.key(int(long[0]))!r} is "
                f"{durations[long[0]]:.2f} s, longer than the {model.cfg.encoder.kind} encoder's window "
                f"of {limit:g} s"
                + (f" ({len(long) - 1} more such)" if len(long) > 1 else "")
                + "; cut or drop such utterances from the split"
            )


def evaluate(
    model_dir: str, data: str, *, split: str, batch_duration: float, out: str | None, max_new_tokens: int | None = None
) -> dict:
    """Decode ``split`` of ``data`` with the SALM in ``model_dir`` (an export, or a Qwen2-Audio / Voxtral checkpoint
    directory: ``load_salm``), replicated on every rank."""
    if not Path(model_dir).is_dir():
        raise JobInputError(
            f"--model: {model_dir} is not a directory (a SALM export, or a Qwen2-Audio / Voxtral checkpoint directory)"
        )
    if "://" not in data and not Path(data).is_dir():
        raise JobInputError(f"--data: {data} is not a directory")
    model, cfg = load_salm(model_dir)
    loader = open_data("--data", lambda: eval_loader(data, split, cfg.sample_rate, batch_duration))
    check_window(model, loader)
    tokenizer = model_dir if speech_llm_kind(model_dir) else Path(model_dir) / "hf"  # the checkpoint's, or the export's
    return decode_split(
        model, cfg, str(tokenizer), loader, max_new_tokens=max_new_tokens or cfg.max_new_tokens, out=out
    )


def eval_in_training(model, cfg, step: int) -> dict:
    """``model.speech.eval_every``: decode ``eval_split`` of ``eval_data`` (default: the training dataset) with the FSDP2-sharded model
    being trained (its root units unsharded for the duration; ranks decode in step, see
    ``greedy_transcripts``). Rank 0 prints the WER and returns ``decode_split``'s result (other ranks: ``{}``).
    Not under sequence parallel (one-token decoding steps cannot split over tp ranks)."""
    from torch.distributed.fsdp import FSDPModule

    salm = unwrap_ddp(model)
    speech = cfg.model.speech
    roots = [m for m in (salm, salm.llm) if isinstance(m, FSDPModule)]
    loader = eval_loader(
        speech.eval_data or cfg.data.datasets[0].path, speech.eval_split, speech.sample_rate, speech.eval_batch_duration
    )
    salm.eval()
    for m in roots:
        m.unshard()
    try:
        out = Path(cfg.trainer.output_dir) / f"eval-{speech.eval_split}-step{step:08d}.jsonl"
        result = decode_split(
            salm, speech, cfg.model.tokenizer, loader, max_new_tokens=speech.max_new_tokens, out=str(out), synced=True
        )
    finally:
        for m in roots:
            m.reshard()
        salm.train()
    if result:
        print(
            f"step {step} {speech.eval_split} WER {result['wer']:.3f} over {result['utterances']} utterances, "
            f"{listening_line(result)} ({out})",
            flush=True,
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m headrace.training.speech.eval", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model",
        required=True,
        help="an exported SALM (a SALM run's output_dir), or a transformers Qwen2-Audio / Voxtral checkpoint directory",
    )
    parser.add_argument("--data", required=True, help="an audio shard directory with transcripts")
    parser.add_argument("--split", default="val")
    parser.add_argument("--batch-duration", type=float, default=60.0, help="seconds of padded audio per batch")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the model's max_new_tokens")
    parser.add_argument("--out", default=None, help="per-utterance JSONL (default: MODEL/eval-SPLIT.jsonl)")
    args = parser.parse_args(argv)
    init_distributed("cpu")
    try:
        out = args.out or str(Path(args.model) / f"eval-{args.split}.jsonl")
        result = evaluate(
            args.model,
            args.data,
            split=args.split,
            batch_duration=args.batch_duration,
            out=out,
            max_new_tokens=args.max_new_tokens,
        )
        if result:
            print(
                f"WER {result['wer']:.3f} over {result['utterances']} utterances ({result['words']} words), "
                f"{listening_line(result)}; hypotheses in {out}",
                flush=True,
            )
    except Exception as e:  # the trainer's rule: the user's errors (found alike on every rank) in one line, exit 2
        if not is_user_error(e) or debug_requested():
            raise
        if dist.get_rank() == 0:
            print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
