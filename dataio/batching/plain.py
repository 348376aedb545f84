"""The plain batching stage (``packing: none`` without ``seq_len``, no bucketing): the collated
batches of ``headrace.dataio.stream.reading.collate`` as the rank's stream makes them, ``batch_size`` samples each.

State: none of its own (the position is the stream's ``consumed``).
"""

from __future__ import annotations

from typing import Iterator

from headrace.dataio.stream.rank import RankStream


class PlainBatches:
    def __init__(self, stream: RankStream):
        self.stream = stream

    def __iter__(self) -> Iterator[dict]:
        for batch in self.stream.plain():
            self.stream.consumed = batch.pop("__end__")
            if not batch["__key__"]:  # its samples were all bad (counted): nothing stands in for them
                continue
            yield batch
            del batch  # a worker's ring bytes come back once the consumer drops the batch too

    def __len__(self) -> int:
        """Batches left in a finite stream, the same on every DP rank: an upper bound, as a batch whose every
        sample is bad is skipped, not delivered."""
        n = self.stream.num_batches()
        if n is None:
            raise TypeError("len() of an endless stream (epochs: null)")
        return n

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, old: list[dict | None], dp_rank: int, dp_size: int) -> None:
        pass


__all__ = ["PlainBatches"]
