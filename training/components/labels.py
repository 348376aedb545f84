"""Label-level helpers of a batch, shared by validation and the speech listening signal: the labelled
(loss-taking) tokens, and a rank's tail-padding rows masked out of the loss."""

from __future__ import annotations

import torch

from headrace.kernels.loss import IGNORE_INDEX


def labelled_tokens(batch: dict) -> int:
    return int((batch["labels"] != IGNORE_INDEX).sum())


def mask_invalid_rows(batch: dict) -> dict:
    """Labels of the rows flagged ``__valid__ = False`` (a rank's tail padding sample) set to -100."""
    valid = batch.get("__valid__")
    if valid is None or bool(torch.as_tensor(valid).all()):
        return batch
    labels = batch["labels"].clone()
    labels[~torch.as_tensor(valid, dtype=torch.bool)] = IGNORE_INDEX
    return {**batch, "labels": labels}


__all__ = ["labelled_tokens", "mask_invalid_rows"]
