"""``model.speech.adapter.kind: ctc_bridge``: hand the LLM what a CTC head already reads in the audio.

A CTC head over the LLM's own tokens (+ blank, the last class) sits on the encoder frames: the head of a
``model.kind: ctc`` stage trained with ``ctc.units: tokens`` on the same tokenizer (``adapter.head_path``:
that stage's ``head/``), kept training with ``model.speech.ctc_weight``. Each LLM audio position then gets

    mlp(stacked frames) + sum_v p(v) * embed_tokens[v]

where ``p`` is the head's softmax over the tokens, summed over the ``subsampling`` frames the position
stacks (blank's mass adds nothing; CTC's posteriors are peaky, one frame per token, so a sum keeps a token's
whole embedding where a mean would halve it). The mlp's output layer starts at zero: at the first step the
audio positions are exactly the head's token embeddings, and the projection learns what to add (a random
projection's output is ~10x a fresh embedding's scale and would bury them). Where the head is sure, the
position holds that token's own input embedding: the LLM reads the transcript it would have to write, in order, and has to copy it (an operation a
causal LM learns in a few hundred steps) instead of learning an audio language through a fresh projection.
The slot count is the plain adapter's (the layout of ``headrace.training.speech.prompt`` is unchanged).

The adapter's output is ``[B, T', hidden + vocab]``: the projection and the token mass side by side;
``SpeechLMLoss.embed`` (which runs inside the LLM's forward, where its embedding table is whole under FSDP2)
turns the mass into embeddings. Cost: one ``[frames, vocab]`` head and a ``[positions, vocab] x [vocab,
hidden]`` matmul per utterance, small next to the encoder.
"""

from __future__ import annotations

import torch
from torch import nn


class CTCBridge(nn.Module):
    """The module docstring's adapter: ``mlp`` a stacking adapter (``subsampling``, ``output_lengths``), ``head``
    a Linear from the encoder's width to ``vocab_size`` + blank."""

    def __init__(self, mlp: nn.Module, head: nn.Linear):
        super().__init__()
        self.subsampling = mlp.subsampling
        self.vocab_size = head.out_features - 1
        self.head = head
        self.mlp = mlp

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        return self.mlp.output_lengths(lengths)

    def token_mass(self, frames: torch.Tensor) -> torch.Tensor:
        """``[B, T', vocab]``: the head's token probabilities (blank dropped), summed over each stack."""
        probs = self.head(frames).float().softmax(-1)[..., : self.vocab_size]
        batch, time, vocab = probs.shape
        pad = (-time) % self.subsampling
        probs = nn.functional.pad(probs, (0, 0, 0, pad))
        return probs.reshape(batch, (time + pad) // self.subsampling, self.subsampling, vocab).sum(2)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        projected = self.mlp(frames)
        return torch.cat([projected, self.token_mass(frames).to(projected.dtype)], -1)

    def reset_parameters(self) -> None:
        self.head.reset_parameters()
        self.mlp.reset_parameters()
        nn.init.zeros_(self.mlp.proj_out.weight)  # the module docstring: start as the head's token embeddings
        if self.mlp.proj_out.bias is not None:
            nn.init.zeros_(self.mlp.proj_out.bias)


def token_embeddings(audio_embeds: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
    """A ``CTCBridge``'s ``[N, hidden + vocab]`` output as ``[N, hidden]`` LLM inputs: the projection plus the
    token mass through the embedding table ``[vocab_llm, hidden]`` (its first ``vocab`` rows)."""
    hidden = embedding.shape[1]
    projected, mass = audio_embeds[..., :hidden], audio_embeds[..., hidden:]
    return projected + mass.to(embedding.dtype) @ embedding[: mass.shape[-1]]


__all__ = ["CTCBridge", "token_embeddings"]
