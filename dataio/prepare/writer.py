"""Write one planned shard: load its samples, tokenize, stream them into a tar, save its index part.

Order of operations (what makes a crash at any point harmless):

1. in chunks of CHUNK samples: load (readers.py; a sample that fails to load is skipped and counted,
   and the shard fails outright once its skips exceed the job's budget), tokenize with one
   ``encode_batch`` call per ~1M characters (Rust, no per-sample Python loop; memory bounded by
   headrace.dataio.prepare.tokenize whatever the text lengths), and append to ``SHARD.tmp-HOST-PID`` (tarwriter.py),
   recording offsets and the largest token id as it goes;
2. fsync, rename to ``SHARD``;
3. save the skip report of the shard (if any), then its ``ShardPart`` sidecar; the part is the
   completion marker a resumed job looks for, so a shard without one is simply written again
   (identical bytes: the tar content is a pure function of the plan).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from headrace.dataio.shards.formats import TRAINED_MASK_MEMBER, npy_bytes
from headrace.dataio.prepare.chat import ChatSample
from headrace.dataio.prepare.chat_template import encode_conversations, tokenizer_json
from headrace.dataio.prepare.plan import PlannedShard
from headrace.dataio.prepare.readers import Input, SampleError, skip_budget_error
from headrace.dataio.prepare.tokenize import MAX_PIECE_CHARS, encode_texts
from headrace.dataio.shards.index import MEMBER_DTYPE, PARTS_DIR, SAMPLE_DTYPE, ShardInfo, ShardPart
from headrace.dataio.shards.tarwriter import TarWriter, write_atomically

STATE_DIR = ".nv-meta/headrace-shard"  # job fingerprint and per-shard skip reports
SKIPPED_DIR = f"{STATE_DIR}/skipped"
CHUNK = 256  # samples loaded and tokenized at a time


@dataclass(kw_only=True)
class ShardJob:
    """Everything a worker needs besides the shard itself (inherited by forked workers)."""

    root: Path
    inputs: list[Input]
    tokenizer_path: str | None = None
    skip_errors: int = 0
    sha256: bool = False


@dataclass(kw_only=True)
class ShardResult:
    name: str
    samples: int
    bytes: int
    skipped: list[dict]


class TooManySkips(SampleError):
    pass


_TOKENIZERS: dict[str, tuple[object, np.dtype]] = {}


def load_tokenizer(path: str):
    """``(tokenizers.Tokenizer, token dtype)`` of a tokenizer.json or a tokenizer directory, cached per process:
    uint16 when the vocabulary fits."""
    if path not in _TOKENIZERS:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer_json(path))
        dtype = np.dtype("<u2") if tok.get_vocab_size(with_added_tokens=True) <= 1 << 16 else np.dtype("<i4")
        _TOKENIZERS[path] = (tok, dtype)
    return _TOKENIZERS[path]


def is_complete(root: Path, name: str) -> bool:
    """A shard is done when its index part exists (saved after the tar's rename) and its tar is there
    (or every one of its samples was skipped)."""
    part = root / PARTS_DIR / f"{name}.npz"
    if not part.exists():
        return False
    return (root / name).exists() or ShardPart.load(part).info.samples == 0


def _load_chunk(job: ShardJob, shard: PlannedShard, entries, skipped: list[dict]) -> list:
    samples = []
    for entry in entries:
        try:
            samples.append(job.inputs[entry.input_id].load(entry))
        except SampleError as e:
            skipped.append(
                {
                    "source": job.inputs[entry.input_id].path,
                    "line": entry.line,
                    "key": entry.key,
                    "shard": shard.name,
                    "reason": str(e),
                }
            )
            if (message := skip_budget_error(str(e), len(skipped), job.skip_errors, f" in {shard.name}")) is not None:
                raise TooManySkips(message)
    return samples


def _tokenize(job: ShardJob, samples: list) -> tuple[list[np.ndarray | None], list[np.ndarray | None]]:
    """Token ids per sample, and the trained-token mask of each conversation (None for other samples)."""
    tokens: list[np.ndarray | None] = [None] * len(samples)
    masks: list[np.ndarray | None] = [None] * len(samples)
    if job.tokenizer_path:
        tok, dtype = load_tokenizer(job.tokenizer_path)
        chats = [i for i, s in enumerate(samples) if isinstance(s, ChatSample)]
        texts = [i for i, s in enumerate(samples) if s.text and not isinstance(s, ChatSample)]
        for i, ids in zip(texts, encode_texts(tok, [samples[i].text for i in texts], dtype)):
            tokens[i] = ids
        encoded = encode_conversations(
            tok, [samples[i].text for i in chats], [samples[i].spans for i in chats], dtype, MAX_PIECE_CHARS
        )
        for i, (ids, mask) in zip(chats, encoded):
            tokens[i], masks[i] = ids, mask
    return tokens, masks


def write_shard(job: ShardJob, shard: PlannedShard, progress=None) -> ShardResult:
    """Write ``shard`` (see the module docstring); raises SampleError once its skips exceed the budget.

    ``progress(n)`` is called after each chunk of ``n`` samples (written or skipped).
    """
    skipped: list[dict] = []
    ext_id: dict[str, int] = {}
    rows: list[tuple] = []
    members: list[tuple[int, int, int]] = []
    keys: list[bytes] = []
    max_token = -1

    def write(stream) -> tuple[int, str | None]:
        nonlocal max_token
        tar = TarWriter(stream, sha256=job.sha256)
        # Chunks bound memory to CHUNK samples (not a whole shard) and give the tokenizer batches.
        for start in range(0, len(shard.entries), CHUNK):
            samples = _load_chunk(job, shard, shard.entries[start : start + CHUNK], skipped)
            for sample, ids, mask in zip(samples, *_tokenize(job, samples)):
                payloads = dict(sample.members)
                if ids is not None:
                    payloads["npy"] = npy_bytes(ids)
                    max_token = max(max_token, int(ids.max()) if len(ids) else -1)
                if mask is not None:
                    payloads[TRAINED_MASK_MEMBER] = npy_bytes(mask)
                first_member, first_byte = len(members), tar.position
                for ext, payload in payloads.items():
                    try:
                        span = tar.add(f"{sample.key}.{ext}", payload)
                    except OSError as e:  # a source file that changed under us, a full disk: one line, no tar
                        raise SampleError(f"{shard.name}: sample {sample.key!r}: {e.strerror or e}") from None
                    members.append((ext_id.setdefault(ext, len(ext_id)), span.offset, span.size))
                rows.append(
                    (
                        0,
                        first_byte,
                        tar.position - first_byte,
                        first_member,
                        len(payloads),
                        -1 if ids is None else len(ids),
                        np.nan if sample.duration is None else sample.duration,
                    )
                )
                keys.append(sample.key.encode())
            if progress is not None:
                progress(min(CHUNK, len(shard.entries) - start))
        return tar.close(), tar.hexdigest()

    size, digest = write_atomically(job.root / shard.name, write, what="the shard")
    if not rows:  # every sample was skipped: no (empty) tar, only the part that says so
        (job.root / shard.name).unlink()
        size, digest = 0, None
    skip_report = job.root / SKIPPED_DIR / f"{shard.name}.jsonl"
    if skipped:
        skip_report.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(
            skip_report, "".join(json.dumps(s) + "\n" for s in skipped).encode(), what="its skipped-sample report"
        )
    else:
        skip_report.unlink(missing_ok=True)
    ShardPart(
        info=ShardInfo(
            name=shard.name,
            split=shard.split,
            bytes=size,
            samples=len(rows),
            sha256=digest,
            max_token=max_token if max_token >= 0 else None,
        ),
        extensions=list(ext_id),
        samples=np.array(rows, dtype=SAMPLE_DTYPE),
        members=np.array(members, dtype=MEMBER_DTYPE),
        keys=np.array(keys, dtype=np.bytes_) if keys else np.zeros(0, "S1"),
    ).save(job.root)
    return ShardResult(name=shard.name, samples=len(rows), bytes=size, skipped=skipped)
