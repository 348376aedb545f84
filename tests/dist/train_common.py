"""Shared pieces of the trainer tests: a tiny model, packed batches from headrace.dataio's Packer, a list loader.

``ListLoader`` serves a fixed list of micro-batches so that any layout sees the same global batch: dp rank
r of dp_size, with k micro-steps, reads micro-batches ``(step * dp_size + r) * k + m``; a single process
with k' = dp_size * k reads the same set per step. Its state is the step it has reached, so it also
restores into a different dp world size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from headrace.dataio.batching.packing import Packer
from headrace.dataio.config import PackingConfig

VOCAB = 256
TINY_LLAMA = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                  tie_word_embeddings=False, attention_dropout=0.0)


def save_pretrained_tiny(path, fields=TINY_LLAMA, seed: int = 0) -> None:
    """A seeded random HF checkpoint (config.json + model.safetensors) every layout starts from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def packed_batches(count: int, *, seq_len: int = 32, rows: int = 2, seed: int = 0) -> list[dict]:
    """``count`` packed micro-batches of random documents (3..40 tokens) from the real Packer."""
    rng = np.random.default_rng(seed)
    packer = Packer(PackingConfig(seq_len=seq_len, packing="greedy"), rows_per_batch=rows)
    out, ref = [], 0
    while len(out) < count:
        packer.push(ref, rng.integers(1, VOCAB, size=int(rng.integers(3, 41))))
        ref += 1
        while (batch := packer.pop()) is not None and len(out) < count:
            out.append(batch)
    return out


def full_logits_loss_sum(hf_model, batch: dict) -> torch.Tensor:
    """The reference loss: HF's forward to full logits, then summed fp32 cross-entropy over labelled tokens."""
    from headrace.kernels.hf_attention import packed_attention_kwargs

    logits = hf_model(input_ids=batch["input_ids"], use_cache=False, **packed_attention_kwargs(batch)).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100,
                           reduction="sum")


class ListLoader:
    def __init__(self, batches: list[dict], dp_rank: int, dp_size: int, grad_accum: int):
        self.batches, self.dp_rank, self.dp_size, self.k = batches, dp_rank, dp_size, grad_accum
        self.consumed = 0  # micro-batches handed out by this rank

    def __iter__(self):
        while True:
            step, m = divmod(self.consumed, self.k)
            self.consumed += 1
            yield self.batches[(step * self.dp_size + self.dp_rank) * self.k + m]

    def state_dict(self) -> dict:
        return {"step": self.consumed // self.k}

    def load_state_dict(self, states: list[dict]) -> None:
        assert len({s["step"] for s in states}) == 1, states
        self.consumed = states[0]["step"] * self.k


def copy_checkpoint(src_step: Path, dest_step: Path) -> None:
    """Copy checkpoint ``src_step`` (``.../checkpoints/step-N``) to ``dest_step``: another run of this user resumes
    from it (the seal key is the user's, headrace.training.checkpoint.seal)."""
    import shutil

    shutil.copytree(src_step, dest_step)
