"""The bench's outputs: ``results.json`` (every figure), ``results.md`` (the table) and ``throughput.png``.

Ratios are computed here from the runs of one bench invocation only: each loader's samples/s over the
page-cache read limit's samples/s (the same files read into one buffer), over headrace's samples/s
(on the output contract) at the same worker count and batch size, and, for headrace's rows, over the
best peer's at the same worker count and batch size (``vs_best_peer``). The table opens with the
output contract every loader produced (``headrace.dataio.bench.contract``). The plot is samples/s against worker count per loader, log scale, with the
page-cache limit as a dashed line (matplotlib's Agg backend: no display needed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from headrace.dataio.bench import fixedcost
from headrace.dataio.bench.extra import bench_import
from headrace.dataio.bench.table import cell, markdown_table

RUN_FIELDS = (
    "loader",
    "workers",
    "batch_size",
    "shuffle",
    "samples",
    "batches",
    "units",
    "seconds",
    "first_batch_s",
    "samples_per_s",
    "mb_per_s",
    "units_per_s",
    "latency_p50_ms",
    "latency_p99_ms",
    "peak_rss_mb",
    "cpu_util",
    "main_cpu_us_per_batch",
    "samples_per_cpu_s",
    "data_wait_fraction",
    "stage_fractions",
    "vs_page_cache",
    "vs_headrace",
    "vs_best_peer",
    "prepare_s",
)


def add_ratios(runs: list[dict], limit_samples_per_s: float, bytes_per_sample: float) -> None:
    """Fill ``mb_per_s``, ``samples_per_cpu_s``, ``vs_page_cache``, ``vs_headrace`` and ``vs_best_peer`` of
    every run in place.

    ``samples_per_cpu_s`` (samples over the CPU seconds of all the run's processes) is the figure that
    survives a shared machine: samples/s follows whatever CPU share the other jobs leave, work per
    CPU-second does not."""
    headrace = {
        (r["workers"], r["batch_size"], r["shuffle"]): r["samples_per_s"] for r in runs if r["loader"] == "headrace"
    }
    best: dict[tuple, float] = {}  # the fastest peer (not a headrace row) per setting
    for r in runs:
        setting = (r["workers"], r["batch_size"], r["shuffle"])
        if not r["loader"].startswith("headrace") and r["samples_per_s"]:
            best[setting] = max(best.get(setting, 0.0), r["samples_per_s"])
    for r in runs:
        rate = r["samples_per_s"]
        r["mb_per_s"] = rate * bytes_per_sample / 1e6 if rate else None
        cpu = (r["cpu_util"] or 0.0) * r["seconds"]
        r["samples_per_cpu_s"] = r["samples"] / cpu if cpu > 0 else None
        r["vs_page_cache"] = rate / limit_samples_per_s if rate and limit_samples_per_s else None
        ours = headrace.get((r["workers"], r["batch_size"], r["shuffle"]))
        r["vs_headrace"] = rate / ours if rate and ours else None
        peer = best.get((r["workers"], r["batch_size"], r["shuffle"]))
        r["vs_best_peer"] = rate / peer if rate and peer and r["loader"].startswith("headrace") else None


def markdown(result: dict) -> str:
    data, limit = result["data"], result["page_cache"]
    audio_bytes = data.get("audio") == "bytes"
    unit = "tokens/s" if data["kind"] == "text" else "audio MB/s" if audio_bytes else "audio s/s"
    header = [
        "loader",
        "workers",
        "batch",
        "samples/s",
        "MB/s",
        unit,
        "first batch s",
        "p50 ms",
        "p99 ms",
        "peak RSS MB",
        "CPU cores",
        "main CPU us/batch",
        "samples/CPU-s",
        "data wait",
        "x page cache",
        "x headrace",
        "x best peer",
    ]
    rows = [
        [
            r["loader"] + (", shuffled" if r["shuffle"] else ""),
            _workers(r),
            r["batch_size"],
            cell(r["samples_per_s"], ",.0f"),
            cell(r["mb_per_s"], ",.1f"),
            cell(r["units_per_s"], ",.1f" if audio_bytes else ",.0f"),
            cell(r["first_batch_s"], ".2f"),
            cell(r["latency_p50_ms"], ".1f"),
            cell(r["latency_p99_ms"], ".1f"),
            cell(r["peak_rss_mb"], ",.0f"),
            cell(r["cpu_util"], ".2f"),
            cell(r["main_cpu_us_per_batch"], ",.0f"),
            cell(r["samples_per_cpu_s"], ",.0f"),
            cell(r["data_wait_fraction"], ".1%"),
            cell(r["vs_page_cache"], ".4f"),
            cell(r["vs_headrace"], ".2f"),
            cell(r["vs_best_peer"], ".2f"),
        ]
        for r in result["runs"]
    ]
    lines = [
        f"Data: `{data['path']}` ({data['kind']}{', audio left encoded' if audio_bytes else ''}, "
        f"{data['samples']:,} samples, {data['bytes'] / 1e6:,.1f} MB in "
        f"{data['shards']} shards, batch {', '.join(map(str, data['batch_sizes']))}); cache {result['cache']}; "
        f"{result['machine']['cpus']} CPUs, load average {result['machine']['load_before']:.1f} before the run.",
        "",
        f"Page-cache read limit: {limit['bytes_per_s'] / 1e9:,.2f} GB/s = {limit['samples_per_s']:,.0f} samples/s.",
        "",
        f"Output contract ({result['contract']['kind']}), what every loader returns per batch and nothing else: "
        f"{result['contract']['batch']}. `headrace` is the loader turned into it; `headrace-full` the loader's own "
        "batch layout (keys, references, validity, positions, every member).",
        "",
        *markdown_table(header, rows, align="l" + "r" * (len(header) - 1)),
    ]
    for s in result["skipped"]:
        lines.append(f"| {s['loader']} | - | - | skipped: {s['reason']} |" + " |" * (len(header) - 4))
    staged = [r for r in result["runs"] if r.get("stage_fractions")]
    if staged:
        lines += [
            "",
            "Loader stages (seconds each stage spent on the batches, over the run's time after the first batch):",
            "",
        ]
        lines += [
            f"- {r['loader']}, {_workers(r)} workers, batch {r['batch_size']}: "
            + ", ".join(f"{stage} {fraction:.1%}" for stage, fraction in r["stage_fractions"].items())
            for r in staged
        ]
    auto = [r for r in result["runs"] if "auto" in r]
    if auto:
        lines += [
            "",
            "`auto` (`num_workers: auto`): the loader's measurement before the run, then the run with the "
            "count it chose:",
            "",
        ]
        lines += [f"- {r['loader']}, batch {r['batch_size']}: {r['auto']['line']}" for r in auto]
    if result.get("fixed_cost"):
        lines += [
            "",
            "Fixed cost per batch and cost per sample (least-squares fit of time per batch over the batch sizes):",
            "",
            *fixedcost.markdown(result["fixed_cost"]),
        ]
    for t in result.get("trainer", []):
        lines += [
            "",
            f"Trainer path ({t['device']}, packing {t['packing']}, seq_len {t['seq_len']}, {t['batch_size']} "
            f"rows, step {t['step_ms']:.0f} ms, {t['workers']} workers): data wait "
            f"{cell(t['data_wait_fraction'], '.2%')} over {t['batches']} batches, first batch "
            f"{t['first_batch_s']:.2f} s, {cell(t['tokens_per_s'], ',.0f')} tokens/s.",
        ]
    return "\n".join(lines) + "\n"


def _workers(run: dict) -> str:
    """The workers cell: the count, or ``auto`` with the count it chose."""
    return f"auto ({run['auto']['num_workers']})" if "auto" in run else str(run["workers"])


def plot(result: dict, path: Path) -> None:
    bench_import("matplotlib", "dataio bench's plot").use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    series: dict[str, list[tuple[int, float]]] = {}
    several = len({r["batch_size"] for r in result["runs"]}) > 1
    for r in result["runs"]:
        if r["samples_per_s"] and "auto" not in r:  # auto is one of the plotted counts
            name = (
                r["loader"] + (", shuffled" if r["shuffle"] else "") + (f", batch {r['batch_size']}" if several else "")
            )
            series.setdefault(name, []).append((r["workers"], r["samples_per_s"]))
    for name, points in series.items():
        points.sort()
        ax.plot(
            [w for w, _ in points],
            [v for _, v in points],
            marker="o",
            linewidth=2.5 if name.startswith("headrace") else 1.2,
            label=name,
        )
    ax.axhline(result["page_cache"]["samples_per_s"], color="gray", linestyle="--", label="page-cache read limit")
    ax.set_yscale("log")
    ax.set_xlabel("DataLoader worker processes")
    ax.set_ylabel("samples/s (log)")
    workers = sorted({r["workers"] for r in result["runs"] if "auto" not in r})
    ax.set_xticks(workers)
    data = result["data"]
    kind = data["kind"] + (", audio left encoded" if data.get("audio") == "bytes" else "")
    ax.set_title(f"{kind}: {data['samples']:,} samples, {data['bytes'] / data['samples'] / 1e3:.1f} KB each")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: dict, out: Path) -> None:
    """Write the three files into ``out`` (each to a temporary name, then renamed)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("results.json", json.dumps(result, indent=1)), ("results.md", markdown(result))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    tmp = out / ".throughput.tmp.png"
    plot(result, tmp)
    os.replace(tmp, out / "throughput.png")


__all__ = ["RUN_FIELDS", "add_ratios", "markdown", "plot", "write"]
