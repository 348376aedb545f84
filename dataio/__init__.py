"""headrace.dataio: from corpus to device.

Subpackages in pipeline order: ``prepare`` (corpora -> shards: ``dataio shard``), ``shards`` (the
on-disk format both sides share: tar members, index, Energon metadata), ``stream`` (shards -> decoded,
collated samples on every rank and worker), ``batching`` (packing, bucketing), ``feed`` (between the
loader and the step: CP split, device prefetch, evening out a finite stream), ``commands`` (the ``dataio`` CLI
verbs) and ``bench`` (``dataio bench``). ``loader`` composes stream and batching behind ``build_loader``;
``config`` is the ``data:`` section; ``usererror`` (which errors are the user's) is the bottom every layer
raises through.
Importing this package is cheap: heavy modules load on first use.
"""

from __future__ import annotations

__all__ = ["build_loader"]


def __getattr__(name: str):
    # Lazy so that `import headrace.dataio` (and the `dataio` CLI's --help) does not pay for torch.
    if name == "build_loader":
        from headrace.dataio.loader import build_loader

        return build_loader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
