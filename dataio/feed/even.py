"""Even tails: every DP rank runs as many batches of a finite stream as the rank with the most.

A finite packed stream (``data.epochs``, a val stream) gives the DP ranks different batch counts: each rank
packs its own documents. A consumer whose steps are collectives (FSDP's all-gathers, a loss all-reduce)
needs every rank to run the same number of steps, so a rank that ran out runs loss-free copies of its last
batch (``loss_free``: labels all -100, no documents) until every rank is done.

The ranks agree in the thread that consumes the batches, between batches: before each batch one
all_reduce (MAX) of ``[this rank has a batch, this rank never had one]``. An agreement anywhere else (in
the loader, run by a read-ahead thread at the end of the rank's stream) waits for a peer whose read-ahead
thread is blocked on its full queue while the peer's main thread waits in a step collective for this rank:
a deadlock once the counts differ by more than the queue's depth. Here every rank's main thread reaches
the same agreement in the same order, so nothing can wait on a peer that waits on it.

Cost: one all_reduce of two integers per batch on a gloo group, only for finite streams (an endless stream
never ends: no agreement needed); ``tools/bench_even_tail`` measures it (BENCHMARKS.md: 0.57 ms per batch
with 2 ranks on a 2-core machine under a load average of ~46, where every collective waits for the
scheduler; a fraction of a forward pass either way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from headrace.config import ConfigError
from headrace.dataio.batching.packing import IGNORE_INDEX


def loss_free(batch: dict) -> dict:
    """A copy of ``batch`` that adds no loss and no document: labels -100, fill 0, no documents, every
    sample invalid. Tensors stay on their device."""
    out = dict(batch)
    out["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    if "fill" in batch:
        out["fill"] = 0.0
    if "num_docs" in batch:
        out["num_docs"] = 0
    if "__docs__" in batch:
        out["__docs__"] = [[] for _ in batch["__docs__"]]
    if "__valid__" in batch:
        out["__valid__"] = torch.zeros_like(torch.as_tensor(batch["__valid__"]), dtype=torch.bool)
    return out


def even_batches(
    batches: Iterable[dict], group, *, pad: Callable[[dict], dict] = loss_free, empty: Callable[[], dict] | None = None
) -> Iterator[dict]:
    """``batches``, then ``pad(last batch)`` until every rank of ``group`` has run out (module docstring).
    Call ``next`` on every rank of ``group`` in the same thread that runs the steps. A rank that had no batch at
    all while others had some runs ``empty()`` (a batch that counts nothing: a val pass over a one-document
    set on two ranks) and ``pad`` copies of it; without ``empty``, a ConfigError (the data's, one line) on
    every rank."""
    source = iter(batches)
    last = None
    while True:
        batch = next(source, None)
        flags = torch.tensor([batch is not None, batch is None and last is None], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        if not flags[0]:
            return
        if flags[1] and empty is not None:
            if batch is None and last is None:  # this rank's stream had nothing: its first padding batch
                batch = empty()
        elif flags[1]:
            raise ConfigError(
                "data: a DP rank got no batch at all while others did: too little data for "
                f"{dist.get_world_size(group)} ranks (fewer ranks, or a smaller batch_size)"
            )
        if batch is None:
            batch = pad(last)
        else:
            last = batch
        yield batch


__all__ = ["even_batches", "loss_free"]
