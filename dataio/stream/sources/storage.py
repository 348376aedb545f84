"""Faults of shard storage: transient errors retried with backoff, and the error for a broken shard.

Shared by the readers of shards (``headrace.dataio.stream.sources.shard_source``: maps and ranged reads) and the node's shard
cache (``headrace.dataio.stream.sources.shardcache``: downloads), which both fetch bytes from storage that may fail for
a moment (``OSError``, timeouts) and may find a shard that is not what its index says. Retrying costs
nothing until a call fails; then 0.5, 1, 2, 4 s of sleep before the fifth failure is raised.
"""

from __future__ import annotations

import time

from headrace.dataio.usererror import SampleDecodeError

RETRIES = 5
BACKOFF_S = 0.5


class ShardFormatError(SampleDecodeError):
    """A shard is broken where a sample lives: truncated, or its tar disagrees with its index. A
    ``SampleDecodeError``, so the loader counts it against ``max_bad_samples`` like any bad sample."""


def retry(fn, what: str):
    """Call ``fn()``; on a transient storage error retry with backoff 0.5, 1, 2, 4 s, then re-raise."""
    for attempt in range(RETRIES):
        try:
            return fn()
        except (OSError, TimeoutError) as e:
            if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)) or attempt == RETRIES - 1:
                raise OSError(f"{what}: {type(e).__name__}: {e} (after {attempt + 1} attempts)") from e
            time.sleep(BACKOFF_S * 2**attempt)


__all__ = ["BACKOFF_S", "RETRIES", "ShardFormatError", "retry"]
