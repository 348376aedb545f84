"""DCP's load logs, on the root logger, a warning with the full traceback when a file's safetensors header does not
parse ("Global metadata is not found. Falling back to rank local metadata."), then raises the same failure as a
``CheckpointException``, which the checkpoint loader reports in one line (falling back to the previous checkpoint).
``quiet_metadata_fallback`` drops that one warning during a load, so the user reads the failure once, as a line."""

from __future__ import annotations

import contextlib
import logging

_FALLBACK = "Global metadata is not found"


class _DropFallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_FALLBACK)


@contextlib.contextmanager
def quiet_metadata_fallback():
    """Within the block, the root logger drops DCP's metadata-fallback warning (and only that)."""
    root, drop = logging.getLogger(), _DropFallback()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


__all__ = ["quiet_metadata_fallback"]
