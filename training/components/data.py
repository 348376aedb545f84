"""The trainer's view of a ``dataio`` loader: opening one with its refusals as one-line job errors, the shard
sources whose recorded token ids the start-up vocabulary check reads, and what ``num_workers: auto`` chose."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from headrace.dataio.loader import Loader
from headrace.dataio.usererror import one_line
from headrace.training.errors import JobInputError


def open_data(key: str, make: Callable[[], Iterable]) -> Iterable:
    """``make()`` (a loader); what opening the data refuses (a missing or unindexed directory, an empty split, no
    token members for packing) is the same on every rank: a ``JobInputError`` line naming ``key``."""
    try:
        return make()
    except (OSError, ValueError) as e:
        raise JobInputError(f"{key}: {one_line(e)}") from e


def shard_sources(loader: Iterable) -> list:
    """The sources a ``dataio`` ``Loader`` reads (their indexes record each shard's largest token id); none for a
    hand-made loader (``train``'s ``make_loader``: batches made in memory, no shard to check)."""
    return loader.stream.sources if isinstance(loader, Loader) else []


def worker_choice_line(loader: Iterable) -> str | None:
    """The line saying what ``data.num_workers: auto`` chose and the rates behind it; None for a count that was
    written, or a hand-made loader."""
    if isinstance(loader, Loader) and loader.worker_choice is not None:
        return loader.worker_choice.line()
    return None


__all__ = ["open_data", "shard_sources", "worker_choice_line"]
