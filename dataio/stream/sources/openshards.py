"""The open shards of one process: a least-recently-used set of maps and remote files, shared by every
source of a loader, with a budget that keeps descriptors and maps bounded whatever the shard count.

Each open shard costs one descriptor (Python's ``mmap`` keeps its own duplicate of the file's; the
loader closes the one it opened right after mapping) and one map (``vm.max_map_count``), or one fsspec
file for a shard read by ranged GETs. A process holds at most ``budget`` of them; opening one more
closes the least recently used first. A map some view still points at (a payload of the batch being
read) cannot be closed: a local shard's map is then left to the views (it is unmapped, and its
descriptor closed, when the last one is dropped, so at most the shards of the batches in flight
outlive the budget); a cached shard's map is kept in a closing list and retried on every open, its
cache lock held until it really is unmapped (``headrace.dataio.stream.sources.shardcache``).

Budget: ``data.max_open_shards``, or derived from the process's limits: 1/8 of ``RLIMIT_NOFILE``'s soft
limit and 1/16 of ``vm.max_map_count``, between 8 and 4096 (128 shards at ``ulimit -n 1024``: at most a
quarter of the limit with one descriptor each and the views in flight). The limits are read, never
raised. Each worker process has its own set (maps and descriptors are per process); after a fork the
parent's entries are forgotten, not closed or unlocked (the parent still uses them).

Cost: a dictionary look-up and ``move_to_end`` per shard per batch; an open or close is a syscall or
two, and a shard read in turn by a shuffled epoch over more shards than the budget is reopened as
often as it is evicted (an ``open`` + ``mmap`` + ``stat``, tens of microseconds).
"""

from __future__ import annotations

import itertools
import os
import resource
from collections import OrderedDict
from typing import Protocol

MIN_BUDGET, MAX_BUDGET = 8, 4096
DEFAULT_MAX_MAP_COUNT = 65530  # Linux's default where /proc/sys/vm/max_map_count cannot be read

_owners = itertools.count()


class OpenShard(Protocol):
    def close(self) -> bool:
        """Release the shard; False when it cannot be yet (a view of it is alive): retried later."""

    def forget(self) -> None:
        """In a forked child: drop the parent's entry without unlocking what the parent still holds."""


def max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return DEFAULT_MAX_MAP_COUNT


def default_budget() -> int:
    """Open shards a process may hold: 1/8 of the soft descriptor limit, 1/16 of the map limit, 8..4096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = MAX_BUDGET * 8 if soft == resource.RLIM_INFINITY else soft
    return max(MIN_BUDGET, min(MAX_BUDGET, files // 8, max_map_count() // 16))


def new_owner() -> int:
    """A number naming one source's entries (sources come and go; ``id()`` values are reused)."""
    return next(_owners)


class OpenShards:
    """At most ``budget`` open shards (None: ``default_budget()``), keyed ``(owner, shard)``."""

    def __init__(self, budget: int | None = None):
        self.budget = budget or default_budget()
        self._open: OrderedDict[tuple[int, int], OpenShard] = OrderedDict()
        self._closing: list[OpenShard] = []
        self._pid = os.getpid()
        self.peak = 0  # most entries open at once in this process (for benchmarks and tests)

    def __len__(self) -> int:
        return len(self._open)

    def get(self, owner: int, shard: int) -> OpenShard | None:
        """The open entry, now the most recently used; None when closed (open it, then ``add``)."""
        self._forget_if_forked()
        entry = self._open.get((owner, shard))
        if entry is not None:
            self._open.move_to_end((owner, shard))
        return entry

    def make_room(self) -> None:
        """Close the least recently used entries until one more fits (call before opening one)."""
        self._forget_if_forked()
        self._closing = [e for e in self._closing if not e.close()]
        while len(self._open) >= self.budget:
            self._close(self._open.popitem(last=False)[1])

    def add(self, owner: int, shard: int, entry: OpenShard) -> None:
        self._open[(owner, shard)] = entry
        self.peak = max(self.peak, len(self._open))

    def discard(self, owner: int, shard: int) -> None:
        entry = self._open.pop((owner, shard), None)
        if entry is not None:
            self._close(entry)

    def trim(self, owner: int, keep: int) -> None:
        """Close ``owner``'s least recently used entries until it holds at most ``keep``."""
        self._forget_if_forked()
        mine = [k for k in self._open if k[0] == owner]
        for key in mine[: max(0, len(mine) - keep)]:
            self._close(self._open.pop(key))
        self._closing = [e for e in self._closing if not e.close()]

    def _close(self, entry: OpenShard) -> None:
        if not entry.close():
            self._closing.append(entry)

    def _forget_if_forked(self) -> None:
        if self._pid != os.getpid():  # a worker: the entries are the parent's
            for entry in [*self._open.values(), *self._closing]:
                entry.forget()
            self._open, self._closing, self._pid, self.peak = OrderedDict(), [], os.getpid(), 0


__all__ = ["OpenShards", "default_budget", "max_map_count", "new_owner"]
