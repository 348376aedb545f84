"""Progress bars for the long ``dataio`` verbs (shard, index, verify): one look, one switch.

A rich progress bar on stderr (stdout stays free for the verb's summary line and ``--json``), shown only
when stderr is a terminal and ``--quiet`` was not given; otherwise every call here is a no-op that does
not even import rich (~0.3 s of start-up saved for scripted runs). Columns: what, bar, done/total,
rate, elapsed, remaining. The bar is transient: it disappears when the work is done, leaving the
verb's one-line summary.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


def shown(quiet: bool = False) -> bool:
    """Whether a bar would be drawn: not ``quiet`` and stderr is a terminal."""
    return not quiet and sys.stderr.isatty()


@contextmanager
def progress_bar(
    description: str, *, total: int | None, unit: str = "", quiet: bool = False
) -> Iterator[Callable[[int], None]]:
    """A context that yields ``advance(n)``; draws a bar on stderr only when ``shown(quiet)``.

    ``unit`` names what is counted in the rate column (``"samples"`` -> ``"1,234 samples/s"``).
    """
    if not shown(quiet):
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task) -> Text:
            rate = task.finished_speed or task.speed
            return Text("" if rate is None else f"{rate:,.0f} {unit}/s".replace(" /s", "/s"))

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


def track(
    items: Iterable[T], *, total: int | None, description: str, unit: str = "", quiet: bool = False
) -> Iterator[T]:
    """``items`` unchanged, advancing a ``progress_bar`` by one per item."""
    with progress_bar(description, total=total, unit=unit, quiet=quiet) as advance:
        for item in items:
            yield item
            advance(1)
