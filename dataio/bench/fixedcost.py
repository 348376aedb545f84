"""A loader's fixed cost per batch and its cost per sample, from runs at several batch sizes.

Time per batch ``t(B) = B / samples_per_s`` is fitted by least squares as ``fixed + per_sample * B``
over the batch sizes of one loader at one worker count: ``fixed`` is what a batch costs whatever its
samples (index look-up, checks, bookkeeping, the hand-over), ``per_sample`` what each sample adds
(its read and copy). With workers, times are wall time per batch as the consumer sees it, so both
figures are per the whole loader, not per process. Cost: a 2x2 solve per loader.
"""

from __future__ import annotations

from headrace.dataio.bench.table import cell, markdown_table


def fit(points: list[tuple[int, float]]) -> dict | None:
    """``{"fixed_us", "per_sample_us"}`` of ``(batch size, seconds per batch)`` points (None: fewer than
    two distinct batch sizes)."""
    if len({b for b, _ in points}) < 2:
        return None
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / sum((b - mean_b) ** 2 for b, _ in points)
    return {"fixed_us": (mean_t - slope * mean_b) * 1e6, "per_sample_us": slope * 1e6}


def fixed_costs(runs: list[dict]) -> list[dict]:
    """Per loader, worker count and shuffle: microseconds per batch at each batch size measured, and the
    fit (``fixed_us``, ``per_sample_us``; None with one batch size)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["samples_per_s"]:
            groups.setdefault((r["loader"], r["workers"], r["shuffle"]), []).append(r)
    out = []
    for (loader, workers, shuffle), rs in groups.items():
        points = sorted((r["batch_size"], r["batch_size"] / r["samples_per_s"]) for r in rs)
        out.append(
            {
                "loader": loader,
                "workers": workers,
                "shuffle": shuffle,
                "us_per_batch": {str(b): t * 1e6 for b, t in points},
                **(fit(points) or {"fixed_us": None, "per_sample_us": None}),
            }
        )
    return out


def markdown(costs: list[dict]) -> list[str]:
    """The table: us per batch at each batch size, then the fitted fixed and per-sample costs."""
    sizes = sorted({int(b) for c in costs for b in c["us_per_batch"]})
    header = ["loader", "workers", *(f"us/batch at {b}" for b in sizes), "fixed us/batch", "us/sample"]
    rows = [
        [
            c["loader"] + (", shuffled" if c["shuffle"] else ""),
            c["workers"],
            *(cell(c["us_per_batch"].get(str(b)), ",.1f") for b in sizes),
            cell(c["fixed_us"], ",.1f"),
            cell(c["per_sample_us"], ",.2f"),
        ]
        for c in costs
    ]
    return markdown_table(header, rows, align="l" + "r" * (len(header) - 1))


__all__ = ["fit", "fixed_costs", "markdown"]
