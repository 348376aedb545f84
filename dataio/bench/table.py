"""Plain-text tables for the benchmark drivers: one cell format, one Markdown row format.

Figures print as Markdown table rows so that they paste into BENCHMARKS.md as they are; a missing
figure (a run that did not happen, a ratio without a denominator) prints as ``-``.
"""

from __future__ import annotations

from collections.abc import Iterable


def cell(value, spec: str = "") -> str:
    """``value`` formatted with ``spec``, or ``-`` when it is None."""
    return "-" if value is None else format(value, spec)


def markdown_row(cells: Iterable) -> str:
    """``| a | b | c |``."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_table(header: list[str], rows: Iterable[Iterable], align: str = "") -> list[str]:
    """Header, separator (``align``: one ``l``/``r`` per column, default left) and rows."""
    marks = [("---:" if a == "r" else "---") for a in (align or "l" * len(header))]
    return [markdown_row(header), markdown_row(marks), *(markdown_row(r) for r in rows)]


__all__ = ["cell", "markdown_row", "markdown_table"]
