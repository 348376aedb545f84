"""Scale simulation: synthetic datasets of many shards and samples, and what the loader costs on them.

    .venv/bin/python -m tools.scale_sim --grid 1e3:1e5,1e4:1e5,1e4:1e6 --dir /tmp/scale_sim [--json out.json]

For each ``SHARDS:SAMPLES`` point: writes ``SAMPLES`` small samples (one ``tokens.npy`` member of 8
int32 tokens, 1 KiB of tar a sample) into ``SHARDS`` tars with a minimal ustar writer (plain tars that
webdataset and energon read), then measures

- ``dataio index DIR`` (2 workers, a fresh process): wall time and peak RSS (``/usr/bin/time``);
  then the incremental re-index after adding one shard;
- index bytes per sample (``.nv-meta/headrace``) and all metadata bytes (energon's sqlite, the
  ``.tar.idx`` files, the per-shard sidecars) per sample;
- one loader rank (``build_loader``, 0 workers, batch 256, shuffled, under ``ulimit -n 1024``) in a
  fresh process: start-up (``build_loader`` to the first batch), steady samples/s over ``--batches``
  batches, RSS and PSS beyond the interpreter with torch and headrace imported, the most descriptors
  and maps open at a batch, the loader state's bytes;
- four ranks of one node at once (``dp_size=4``): each rank's RSS and PSS beyond the interpreter
  (PSS < RSS: the mapped index and shards are shared through the page cache).

``--peers DIR`` instead runs headrace, webdataset and energon (``headrace.dataio.bench.peers``' adapters,
0 workers, shuffled) on one indexed dataset, each in a fresh process: start-up + first batch, RSS
beyond the imports, descriptors at peak (litdata needs its own copy of the data: not run here).

Then fits ``figure = a * n^b`` (least squares in log-log) over the points, ``n`` = samples (and shards),
and extrapolates to 10^9 samples / 10^6 shards. Prints a Markdown table; ``--json`` keeps the figures.
Disk: ~1.1 KiB a sample plus ~10 KiB a shard of metadata; the datasets are removed unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BLOCK = 512
TOKENS = 8  # int32 tokens a sample: a 128-byte npy header + 32 bytes, one 512-byte tar block
NOFILE = 1024


def ustar_header(name: bytes, size: int) -> bytes:
    h = bytearray(BLOCK)
    h[: len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = h[116:124] = b"0000000\0"
    h[124:136] = b"%011o\0" % size
    h[136:148] = b"%011o\0" % 1700000000
    h[148:156] = b" " * 8
    h[156:157] = b"0"
    h[257:265] = b"ustar\x0000"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def npy_prefix() -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.zeros(TOKENS, np.int32))
    return buf.getvalue()[: -4 * TOKENS]


def write_dataset(root: Path, shards: int, samples: int, first: int = 0, name: str = "shard-{:07d}.tar") -> None:
    """``samples`` samples (keys ``s<first>``.. on 10 digits) spread evenly over ``shards`` tars."""
    root.mkdir(parents=True, exist_ok=True)
    prefix = npy_prefix()
    size = len(prefix) + 4 * TOKENS
    pad = b"\0" * (-size % BLOCK)
    tokens = np.arange(TOKENS, dtype=np.int32)
    bounds = first + np.linspace(0, samples, shards + 1).astype(np.int64)
    for s in range(shards):
        parts = []
        for i in range(int(bounds[s]), int(bounds[s + 1])):
            tokens[0] = i % 50000
            parts += [ustar_header(b"s%010d.tokens.npy" % i, size), prefix, tokens.tobytes(), pad]
        parts.append(b"\0" * (2 * BLOCK))
        (root / name.format(s)).write_bytes(b"".join(parts))


def timed(cmd: list[str]) -> tuple[float, int]:
    """``(wall seconds, peak RSS in bytes)`` of a command (``/usr/bin/time``: the largest process of its tree)."""
    run = subprocess.run(["/usr/bin/time", "-f", "@@ %e %M", *cmd], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
    wall, kb = run.stderr.strip().splitlines()[-1].split()[1:]
    return float(wall), int(kb) * 1024


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def memory(field: str = "") -> tuple[int, int]:
    """This process's ``(RSS, PSS)`` in bytes (``smaps_rollup``: PSS splits each shared page among its users);
    with ``field`` (e.g. ``Anonymous``), ``(that field, 0)``: the process's own heap, no mapped file pages."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[1].isdigit():
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return (fields[field], 0) if field else (fields["Rss"], fields["Pss"])


def rank(root: str, dp_rank: int, dp_size: int, batches: int) -> dict:
    """One loader rank in this (fresh) process: start-up, throughput, memory, descriptors, maps, state."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    import torch  # noqa: F401 (the baseline includes torch, as the issue's targets do)

    from headrace.dataio.loader import build_loader

    rss0, pss0 = memory()
    anon0, _ = memory("Anonymous")
    t0 = time.perf_counter()
    loader = build_loader(
        {"datasets": [{"path": root}], "batch_size": 256, "num_workers": 0, "shuffle": True},
        dp_rank=dp_rank,
        dp_size=dp_size,
    )
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    fds = maps = 0
    t1 = time.perf_counter()
    for n in range(batches):
        next(it)
        if n % 8 == 0:
            fds = max(fds, len(os.listdir("/proc/self/fd")))
            with open("/proc/self/maps") as f:
                maps = max(maps, sum(1 for _ in f))
    rate = batches * 256 / (time.perf_counter() - t1)
    rss, pss = memory()
    anon, _ = memory("Anonymous")
    return {
        "startup_first_batch_s": first,
        "samples_per_s": rate,
        "rss_beyond_MB": (rss - rss0) / 2**20,
        "pss_beyond_MB": (pss - pss0) / 2**20,
        "anon_beyond_MB": (anon - anon0) / 2**20,
        "fds_peak": fds,
        "maps_peak": maps,
        "state_bytes": len(json.dumps(loader.state_dict())),
    }


def peer(root: str, name: str, batches: int) -> dict:
    """One peer loader (``headrace.dataio.bench.peers``' adapter, 0 workers, shuffled, batch 256) in this
    fresh process under ``ulimit -n 1024``: start-up + first batch, RSS beyond the imports, descriptors."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    import torch  # noqa: F401

    from headrace.dataio.bench.data import describe
    from headrace.dataio.bench.peers import PEERS
    from headrace.dataio.config import DataConfig, DatasetSpec

    adapter = PEERS[name]
    __import__(adapter.module)
    cfg = DataConfig(datasets=[DatasetSpec(path=root)], batch_size=256, num_workers=0)
    rss0, _ = memory()
    t0 = time.perf_counter()
    data = describe(cfg, Path(root) / ".peers")
    it = adapter.open(data, 0, True, None)
    next(it)
    first = time.perf_counter() - t0
    fds = 0
    for n in range(batches):
        next(it)
        if n % 8 == 0:
            fds = max(fds, len(os.listdir("/proc/self/fd")))
    rss, _ = memory()
    return {"loader": name, "startup_first_batch_s": first, "rss_beyond_MB": (rss - rss0) / 2**20, "fds_peak": fds}


def peers(root: Path, batches: int) -> list[dict]:
    """headrace, webdataset and energon, each in a fresh process, on the indexed dataset ``root``."""
    out = []
    for name in ("headrace", "webdataset", "energon"):
        run = subprocess.run(
            [sys.executable, "-m", "tools.scale_sim", "--peer-child", str(root), name, "--batches", str(batches)],
            capture_output=True,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        out.append(
            json.loads(run.stdout.strip().splitlines()[-1])
            if run.returncode == 0
            else {"loader": name, "error": run.stderr.strip().splitlines()[-1][:200]}
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def ranks(root: Path, dp_size: int, batches: int) -> list[dict]:
    cmd = [sys.executable, "-m", "tools.scale_sim", "--rank-child", str(root), "--batches", str(batches)]
    procs = [
        subprocess.Popen(
            [*cmd, f"{r}/{dp_size}"], stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
        )
        for r in range(dp_size)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"rank child failed ({p.returncode})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def measure(base: Path, shards: int, samples: int, batches: int, keep: bool, reindex: bool = True) -> dict:
    root = base / f"s{shards}-n{samples}"
    shutil.rmtree(root, ignore_errors=True)
    t = time.perf_counter()
    write_dataset(root, shards, samples)
    row = {"shards": shards, "samples": samples, "write_s": time.perf_counter() - t, "tar_bytes": tree_bytes(root)}
    dataio = [sys.executable, "-m", "headrace.dataio", "index", str(root), "--workers", "2", "--quiet"]
    row["index_s"], row["index_peak_rss"] = timed(dataio)
    meta = root / ".nv-meta"
    row["index_bytes_per_sample"] = tree_bytes(meta / "headrace") / samples
    row["index_bytes_per_shard"] = (
        sum((meta / "headrace" / f).stat().st_size for f in ("shards.npy", "shard_names.npy")) / shards
    )
    row["metadata_bytes_per_sample"] = (
        tree_bytes(meta) + sum(p.stat().st_size for p in root.glob("*.tar.idx"))
    ) / samples
    if reindex:
        write_dataset(root, 1, max(1, samples // shards), first=samples, name="shard-more-{}.tar")  # only it is scanned
        row["reindex_one_more_shard_s"], _ = timed(dataio)
    one = ranks(root, 1, batches)[0]
    row.update(one)
    four = ranks(root, 4, max(1, batches // 4))
    row["rss_beyond_MB_4ranks"] = max(r["rss_beyond_MB"] for r in four)
    row["pss_beyond_MB_4ranks"] = max(r["pss_beyond_MB"] for r in four)
    row["anon_beyond_MB_4ranks"] = max(r.get("anon_beyond_MB", 0) for r in four)
    row["fds_peak_4ranks"] = max(r["fds_peak"] for r in four)
    if not keep:
        shutil.rmtree(root)
    return row


FIGURES = [
    "index_s",
    "index_peak_rss",
    "startup_first_batch_s",
    "samples_per_s",
    "rss_beyond_MB",
    "anon_beyond_MB",
    "pss_beyond_MB_4ranks",
    "fds_peak",
    "maps_peak",
    "index_bytes_per_sample",
    "state_bytes",
]


def fit(rows: list[dict], figure: str, by: str) -> tuple[float, float] | None:
    """``(a, b)`` of ``figure = a * by^b`` by least squares in log-log, over the rows that hold the other
    variable (shards for ``by="samples"``, and the reverse) at the value with most distinct ``by`` values;
    None where no value has 2."""
    other = "shards" if by == "samples" else "samples"
    groups: dict[int, list] = {}
    for r in rows:
        if r.get(figure, 0) > 0:
            groups.setdefault(r[other], []).append((r[by], r[figure]))
    pts = max(groups.values(), key=lambda g: len({x for x, _ in g}), default=[])
    if len({x for x, _ in pts}) < 2:
        return None
    x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    b, log_a = np.polyfit(x, y, 1)
    return float(math.exp(log_a)), float(b)


def table(rows: list[dict]) -> str:
    cols = [
        "shards",
        "samples",
        "index_s",
        "index_peak_rss",
        "reindex_one_more_shard_s",
        "startup_first_batch_s",
        "samples_per_s",
        "rss_beyond_MB",
        "pss_beyond_MB",
        "anon_beyond_MB",
        "rss_beyond_MB_4ranks",
        "pss_beyond_MB_4ranks",
        "fds_peak",
        "maps_peak",
        "index_bytes_per_sample",
        "metadata_bytes_per_sample",
        "state_bytes",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [
            "-"
            if c not in r
            else f"{r[c] / 2**20:.0f} MB"
            if c == "index_peak_rss"
            else f"{r[c]:,}"
            if isinstance(r[c], int)
            else f"{r[c]:.3g}"
            for c in cols
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Fits (``tools.scale_sim.fit``: log-log least squares over the points that hold the other variable fixed):",
        "",
        "| figure | fit in samples n | at 10^9 samples | fit in shards s | at 10^6 shards |",
        "|---|---|---|---|---|",
    ]
    for figure in FIGURES:
        cells = []
        for by, target in (("samples", 1e9), ("shards", 1e6)):
            f = fit(rows, figure, by)
            var = "n" if by == "samples" else "s"
            cells += ["-", "-"] if f is None else [f"{f[0]:.3g} * {var}^{f[1]:.2f}", f"{f[0] * target ** f[1]:.3g}"]
        lines.append(f"| {figure} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    """Log-log panels of the main figures against samples, one line per shard count, with the fits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        "index_s",
        "startup_first_batch_s",
        "samples_per_s",
        "rss_beyond_MB",
        "anon_beyond_MB",
        "index_bytes_per_sample",
    ]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for ax, figure in zip(axes.flat, panels):
        for shards in sorted({r["shards"] for r in rows}):
            pts = sorted((r["samples"], r[figure]) for r in rows if r["shards"] == shards and r.get(figure, 0) > 0)
            if pts:
                ax.plot(*zip(*pts), "o-", label=f"{shards:,} shards")
        f = fit(rows, figure, "samples")
        if f is not None:
            xs = np.logspace(5, 9, 20)
            ax.plot(xs, f[0] * xs ** f[1], "k--", lw=0.8, label=f"fit n^{f[1]:.2f}")
        ax.set(xscale="log", yscale="log", title=figure, xlabel="samples")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--grid", default="1e3:1e5,1e4:1e5,1e4:1e6", help="SHARDS:SAMPLES points, comma-separated")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/scale_sim"), help="scratch directory")
    parser.add_argument("--batches", type=int, default=200, help="steady-state batches of 256 timed per rank")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--keep", action="store_true", help="keep the datasets")
    parser.add_argument("--skip-reindex", action="store_true", help="do not time the re-index after adding a shard")
    parser.add_argument(
        "--peers",
        type=Path,
        metavar="DIR",
        help="instead of the grid: headrace, webdataset and energon on this indexed dataset",
    )
    parser.add_argument("--plot", type=Path, metavar="PNG", help="also plot the figures (with --from, no run)")
    parser.add_argument(
        "--from",
        dest="from_json",
        type=Path,
        metavar="JSON",
        help="print the table (and --plot) of the rows of an earlier --json instead of running",
    )
    parser.add_argument("--rank-child", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--peer-child", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("rank", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_child:
        r, size = (int(x) for x in args.rank.split("/"))
        print(json.dumps(rank(args.rank_child, r, size, args.batches)))
        return
    if args.peer_child:
        print(json.dumps(peer(args.peer_child, args.rank, args.batches)))
        return
    if args.peers:
        peers(args.peers, args.batches)
        return
    if args.from_json:
        rows = json.loads(args.from_json.read_text())
        print(table(rows))
        if args.plot:
            plot(rows, args.plot)
        return
    rows = []
    for point in args.grid.split(","):
        shards, samples = (int(float(x)) for x in point.split(":"))
        rows.append(measure(args.dir, shards, samples, args.batches, args.keep, not args.skip_reindex))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
