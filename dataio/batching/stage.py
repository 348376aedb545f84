"""The batching stage interface: what ``headrace.dataio.loader.Loader`` composes over a rank's stream.

A stage turns the rank's ``RankStream`` (``headrace.dataio.stream.rank``: sources, position, plain batches,
worker processes) into the batches the trainer gets, and owns its own resumable state:

- iterate: ``iter(stage)`` yields batches, advancing ``stream.consumed`` as it hands samples on;
- ``state_dict() -> dict``: its own keys only (JSON-sized), merged into the loader's state;
- ``load_state_dict(old, dp_rank, dp_size)``: ``old`` is the list of the old ranks' loader states,
  indexed by old DP rank; an entry is None only when the layout is unchanged and that rank's state was
  not given (``headrace.dataio.stream.ordering.split.same_layout``). A stage reads the keys its ``state_dict`` wrote.

``len(stage)`` is optional (only a stage that knows its batch count up front defines it).

The stages: ``plain`` (collated batches as read), ``packed`` (THD rows, ``headrace.dataio.batching.packing``),
``bucketed`` (duration buckets, ``headrace.dataio.batching.bucketing``). ``Loader`` picks one from the
``data:`` section in ``batching_stage``; adding a stage is a new module here plus one line there.
"""

from __future__ import annotations

from typing import Iterator, Protocol


class Stage(Protocol):
    def __iter__(self) -> Iterator[dict]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, old: list[dict | None], dp_rank: int, dp_size: int) -> None: ...


__all__ = ["Stage"]
