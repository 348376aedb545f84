"""Conversations as packer documents: the trained-token mask rides in the token array, and the over-long rule.

A conversation sample (``dataio shard`` of chat data, ``headrace.dataio.prepare.chat``) holds its token ids
(``npy``) and a uint8 mask of the tokens trained on (``trained.npy``: the assistant's turns). The packer moves
documents as one integer array each and keeps only ``(ref, offset, length)`` in its resumable state, so the mask
travels inside that array: ``conversation_document`` sets bit ``UNTRAINED_BIT`` (32) of every token that is not
trained, and the packer, when told its documents may carry the bit (``Packer(masked=True)``), labels a position
-100 when the token it predicts has the bit, and clears the bit from ``input_ids`` (``split_untrained``: two
whole-array operations per batch). Plain text documents have no bit: every token is trained, so text and
conversations blend in one stream. Token ids stay below 2**32 (every vocabulary does).

A conversation is never cut across rows: the packer splits only documents longer than ``seq_len``, and for a
conversation that is what ``long_conversations`` (the ``data:`` key) decides first:

- ``skip`` (default): left out, counted (``skipped_conversations`` in the batches and the metrics);
- ``truncate``: its first ``seq_len`` tokens, as one full row (the tail's labels are lost, nothing else);
- ``error``: the loader stops with a one-line error naming the dataset and sample key.
"""

from __future__ import annotations

import numpy as np

from headrace.dataio.config import LONG_CONVERSATION_POLICIES
from headrace.kernels.loss import IGNORE_INDEX

UNTRAINED_BIT = 32
TOKEN_ID_MASK = (1 << UNTRAINED_BIT) - 1


def conversation_document(tokens: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """int64 token ids with ``UNTRAINED_BIT`` set where ``trained`` is 0; ValueError when the lengths differ."""
    if len(tokens) != len(trained):
        raise ValueError(f"trained-token mask has {len(trained)} entries for {len(tokens)} tokens")
    doc = tokens.astype(np.int64)
    doc |= (trained == 0).astype(np.int64) << UNTRAINED_BIT
    return doc


def split_untrained(input_ids: np.ndarray, labels: np.ndarray) -> None:
    """In place: labels of untrained tokens -> -100, the bit cleared from ``input_ids`` (padding has no bit)."""
    labels[labels > TOKEN_ID_MASK] = IGNORE_INDEX
    input_ids &= TOKEN_ID_MASK


def fit_conversation(doc: np.ndarray, seq_len: int, policy: str) -> np.ndarray | None:
    """``doc`` as it enters the packer under ``policy`` (module docstring): itself when it fits, its first ``seq_len``
    tokens (truncate), None (skip); the caller raises for ``error``."""
    if len(doc) <= seq_len:
        return doc
    if policy == "truncate":
        return doc[:seq_len]
    return None


__all__ = [
    "LONG_CONVERSATION_POLICIES",
    "TOKEN_ID_MASK",
    "UNTRAINED_BIT",
    "conversation_document",
    "fit_conversation",
    "split_untrained",
]
