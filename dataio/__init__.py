"""headrace.dataio: from corpus to device.

Corpus preparation (``dataio shard`` / ``index`` / ``inspect`` / ``verify``), the shard index, and the
streaming loader (rank/worker split, seeding, shuffle, blend, resumable state, decoding, packing,
bucketing, device prefetch). Importing this package is cheap: heavy modules load on first use.
"""

from __future__ import annotations

__all__ = ["build_loader"]


def __getattr__(name: str):
    # Lazy so that `import dataio` (and the `dataio` CLI's --help) does not pay for torch.
    if name == "build_loader":
        from dataio.loader import build_loader

        return build_loader
    raise AttributeError(f"module 'dataio' has no attribute {name!r}")
