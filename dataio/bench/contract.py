"""The output contract of ``dataio bench``: what every loader hands the trainer per batch, and the
cheapest code that builds it from each loader's samples.

Every loader in a comparison returns batches of exactly this, and nothing else (no keys, masks or
references), so no loader is charged for another's batch layout:

- text: ``{"tokens": 1-D tensor, "lengths": int64 (B,)}``: the batch's token documents end to end in
  their stored dtype (int32 for ``dataio shard``'s tokens), and each document's token count;
- decoded audio: ``{"audio": float32 (B, T), "lengths": int64 (B,), "sample_rate": int}``: waveforms
  zero-padded to the batch's longest, and each one's sample count;
- audio left encoded (``--audio-bytes``): ``{"bytes": uint8 1-D, "lengths": int64 (B,)}``: the members'
  encoded bytes end to end.

Peers build it from their samples with ``token_batch`` / ``audio_batch`` / ``bytes_batch``: one
``np.concatenate`` (or one padded copy) and a lengths array, the least work that yields these
tensors. headrace's loader yields its full batch layout (``headrace.dataio.stream.reading.collate``); ``from_headrace``
turns it into the contract: views of its tensors for tokens and bytes (no copy), one padded copy for
decoded audio (headrace keeps audio flat, unpadded). ``count`` reads (samples, units) off a contract
batch: tokens, seconds of audio, or MB of encoded audio. Cost: one copy of the batch's data per peer
batch (the concatenation itself), ~1 us of Python per batch for headrace's tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

CONTRACT = {
    "text": "tokens: 1-D tensor of the batch's documents end to end (stored dtype, int32 here) + lengths: int64 (B,)",
    "audio": "audio: float32 (B, T) zero-padded + lengths: int64 (B,) samples + sample_rate: int",
    "bytes": "bytes: uint8 1-D of the encoded audio members end to end + lengths: int64 (B,)",
}


def contract_kind(kind: str, audio_bytes: bool) -> str:
    """The contract's name for data of ``kind`` ("text", "audio"), audio left encoded or not."""
    return "bytes" if audio_bytes else kind


def token_batch(arrays: Sequence[np.ndarray]) -> dict:
    """1-D token arrays -> the text contract."""
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    return {"tokens": torch.from_numpy(np.concatenate(arrays)), "lengths": torch.from_numpy(lengths)}


def bytes_batch(buffers: Sequence) -> dict:
    """Encoded members (bytes-like) -> the audio-bytes contract."""
    arrays = [np.frombuffer(b, dtype=np.uint8) for b in buffers]
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    return {"bytes": torch.from_numpy(np.concatenate(arrays)), "lengths": torch.from_numpy(lengths)}


def audio_batch(waves: Sequence, sample_rate: int) -> dict:
    """1-D float waveforms (arrays or tensors) -> the decoded-audio contract (zero-padded)."""
    lengths = np.fromiter(map(len, waves), dtype=np.int64, count=len(waves))
    padded = torch.zeros((len(waves), int(lengths.max(initial=0))), dtype=torch.float32)
    for row, wave, n in zip(padded, waves, lengths.tolist()):
        row[:n] = torch.as_tensor(wave)
    return {"audio": padded, "lengths": torch.from_numpy(lengths), "sample_rate": int(sample_rate)}


def from_headrace(batch: dict, field: str, kind: str, default_rate: int | None) -> dict:
    """headrace's batch layout -> the contract of ``kind`` (see ``contract_kind``) for member ``field``."""
    values, lengths = batch[field], batch["__lengths__"].get(field)
    if kind != "audio":
        if lengths is None:  # every document of one length: headrace stacks them (B, L)
            lengths = torch.full((values.shape[0],), values.shape[1], dtype=torch.int64)
        return {"tokens" if kind == "text" else "bytes": values.view(-1), "lengths": lengths}
    rate = batch["__sample_rate__"][field][0] or default_rate or 1
    if lengths is None:  # equal lengths: already (B, T)
        return {
            "audio": values,
            "lengths": torch.full((values.shape[0],), values.shape[1], dtype=torch.int64),
            "sample_rate": rate,
        }
    return audio_batch(torch.split(values, lengths.tolist()), rate)


def count(batch: dict, kind: str) -> tuple[int, float]:
    """(samples, units) of a contract batch: tokens (text), seconds (audio), MB (bytes)."""
    lengths = batch["lengths"]
    units = float(lengths.sum())
    if kind == "audio":
        return len(lengths), units / batch["sample_rate"]
    return len(lengths), units / 1e6 if kind == "bytes" else units


__all__ = ["CONTRACT", "audio_batch", "bytes_batch", "contract_kind", "count", "from_headrace", "token_batch"]
