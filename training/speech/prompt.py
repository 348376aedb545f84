"""Token layout of a SALM batch: prompt prefix, audio slots, prompt suffix, answer, eos.

Each sample's sequence is ``prefix + [slot] * n_b + suffix + answer_b + [eos]`` where ``n_b`` is the
number of adapter frames of its audio (computed from its length alone, before any model code runs):
the prompt's audio placeholder expands into ``n_b`` slots whose embeddings the model replaces by the
frames (``audio_mask`` marks them; their ``input_ids`` hold ``pad_id``, never embedded for real).
Labels are next-token aligned and cover the answer and its eos only (-100 elsewhere), so the loss is
on the answer tokens. Training rows are right-padded (causal attention never looks right, so no
attention mask is needed); generation rows are left-padded with an ``attention_mask`` (what
``generate`` expects). Built with tensor ops over ``[B, L]`` (no per-token Python).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headrace.kernels.loss import IGNORE_INDEX
from headrace.training.config.speech import AUDIO_PLACEHOLDER

EOS_NAMES = ("<|eos|>", "<|endoftext|>", "<|im_end|>", "</s>", "<eos>")
PAD_NAMES = ("<|pad|>", "<pad>", "<|endoftext|>")


@dataclass(kw_only=True)
class PromptTemplate:
    prefix: list[int]  # token ids before the audio
    suffix: list[int]  # token ids after the audio, before the answer
    eos_id: int
    pad_id: int


def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` or a directory holding one."""
    from pathlib import Path

    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def make_template(tokenizer, prompt: str, answer_end: str | None = None) -> PromptTemplate:
    """Split ``prompt`` at the audio placeholder and tokenize both sides; eos (``answer_end``, else the first of
    ``EOS_NAMES`` the vocabulary has) and pad from the vocabulary."""
    before, after = prompt.split(AUDIO_PLACEHOLDER)

    def special(names: tuple[str, ...], what: str) -> int:
        for name in names:
            if (token := tokenizer.token_to_id(name)) is not None:
                return token
        raise ValueError(f"model.tokenizer has no {what} token (looked for {', '.join(names)})")

    eos = special((answer_end,) if answer_end else EOS_NAMES, "end-of-sequence")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids if text.strip() else []  # noqa: E731
    return PromptTemplate(
        prefix=encode(before.rstrip()),
        suffix=encode(after),
        eos_id=eos,
        pad_id=special(PAD_NAMES, "padding") if any(tokenizer.token_to_id(n) is not None for n in PAD_NAMES) else eos,
    )


def build_batch(
    template: PromptTemplate,
    audio_slots: torch.Tensor,
    answers: list[list[int]] | None = None,
    *,
    multiple_of: int = 1,
    left_pad: bool = False,
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``audio_mask``, ``position_ids`` ``[B, L]`` (+ ``labels`` with ``answers``; +
    ``attention_mask`` with ``left_pad``) for samples with ``audio_slots[b]`` frames each. ``L`` is the
    longest row rounded up to ``multiple_of`` (sequence parallelism splits it evenly)."""
    slots = audio_slots.to(torch.long).cpu()
    batch = len(slots)
    P, S = len(template.prefix), len(template.suffix)
    if answers is None:
        ans_len = torch.zeros(batch, dtype=torch.long)
        ans = torch.zeros(batch, 1, dtype=torch.long)
    else:
        ans_len = torch.tensor([len(a) + 1 for a in answers], dtype=torch.long)  # + eos
        ans = torch.full((batch, int(ans_len.max())), template.eos_id, dtype=torch.long)
        for row, a in zip(ans, answers):
            row[: len(a)] = torch.as_tensor(a, dtype=torch.long)
    lengths = P + slots + S + ans_len
    width = -(-int(lengths.max()) // multiple_of) * multiple_of
    t = torch.arange(width)[None, :].expand(batch, -1)
    if left_pad:  # shift so every row ends at width
        t = t - (width - lengths)[:, None]
    audio_end = P + slots[:, None]
    suffix_end = audio_end + S
    prefix_ids = torch.tensor(template.prefix + [0], dtype=torch.long)
    suffix_ids = torch.tensor(template.suffix + [0], dtype=torch.long)
    ids = torch.full((batch, width), template.pad_id, dtype=torch.long)
    in_prefix = (t >= 0) & (t < P)
    ids[in_prefix] = prefix_ids[t.clamp(0, P)][in_prefix]
    audio = (t >= P) & (t < audio_end)
    in_suffix = (t >= audio_end) & (t < suffix_end)
    ids[in_suffix] = suffix_ids[(t - audio_end).clamp(0, S)][in_suffix]
    in_answer = (t >= suffix_end) & (t < lengths[:, None])
    ids[in_answer] = ans.gather(1, (t - suffix_end).clamp(0, ans.shape[1] - 1))[in_answer]
    out = {"input_ids": ids, "audio_mask": audio}
    if left_pad:
        out["attention_mask"] = (t >= 0).long()
        out["position_ids"] = t.clamp(min=0)
    else:
        out["position_ids"] = torch.arange(width)[None, :].expand(batch, -1).contiguous()
    if answers is not None:
        labels = torch.full_like(ids, IGNORE_INDEX)
        target = torch.zeros_like(in_answer)
        target[:, :-1] = in_answer[:, 1:]  # position t predicts token t + 1
        labels[:, :-1] = torch.where(target[:, :-1], ids[:, 1:], IGNORE_INDEX)
        out["labels"] = labels
    return out


__all__ = ["PromptTemplate", "build_batch", "load_tokenizer", "make_template"]
