"""One full shuffled epoch of one loader rank on a large dataset, under ``ulimit -n 1024``.

    .venv/bin/python -m tools.scale_epoch DIR --workers 0|2 --mode plain|packed

What the issue-44 targets ask at 10^5 shards: every sample served exactly once (plain: each ``__ref__``
once; packed, ``best_fit`` at ``seq_len`` 512: each document's pieces summing to its length, read from the
index), start-up (``build_loader`` to the first batch), samples/s over the rest of the epoch, the most
descriptors open in any process of the rank (the main process and its workers, sampled every 50
batches), samples per CPU-second (the main process and its joined workers, start-up included: what a
busy machine's wall clock hides), and the main process's RSS and anonymous memory beyond the imports (torch included).
Prints one line; ``--json`` prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import numpy as np

NOFILE = 1024


def memory() -> dict[str, float]:
    """This process's ``smaps_rollup`` fields in MB (Rss, Pss, Anonymous, ...)."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[1].isdigit():
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return fields


def descriptors() -> int:
    """The most descriptors open in this process or any of its children (the loader's workers)."""
    pids = [os.getpid()]
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    counts = []
    for pid in pids:
        try:
            counts.append(len(os.listdir(f"/proc/{pid}/fd")))
        except OSError:  # a worker that just exited
            pass
    return max(counts)


def epoch(root: str, workers: int, mode: str, window_shards: int | None = None) -> dict:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    import torch  # noqa: F401 (the baseline includes torch, as the targets do)

    from headrace.dataio.loader import build_loader

    before = memory()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime
    cfg = {"datasets": [{"path": root}], "batch_size": 256, "num_workers": workers, "shuffle": True, "epochs": 1}
    if mode == "packed":
        cfg.update(packing="best_fit", seq_len=512, batch_size=16)
    if window_shards is not None:
        cfg["shuffle_window_shards"] = window_shards
    t0 = time.perf_counter()
    loader = build_loader(cfg)
    source = loader.stream.sources[0]
    expected = np.asarray(source.index.samples["tokens"], dtype=np.int64)
    served = np.zeros(len(source), dtype=np.int64)
    first = t1 = None
    fds = rss = anon = 0.0
    for n, batch in enumerate(loader):
        if first is None:
            first, t1 = time.perf_counter() - t0, time.perf_counter()
        if mode == "packed":
            for row in batch["__docs__"]:
                for ref, _, length in row:
                    served[int(ref)] += length
        else:
            np.add.at(served, batch["__ref__"].numpy(), 1)
        if n % 50 == 0:
            now = memory()
            fds = max(fds, descriptors())
            rss, anon = max(rss, now["Rss"] - before["Rss"]), max(anon, now["Anonymous"] - before["Anonymous"])
    rest = time.perf_counter() - t1
    cpu = sum(
        resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    once = bool((served == (expected if mode == "packed" else 1)).all())
    return {
        "dir": root,
        "workers": workers,
        "mode": mode,
        "samples": len(served),
        "exactly_once": once,
        "startup_first_batch_s": round(first, 2),
        "samples_per_s": round(len(served) / rest),
        "samples_per_cpu_s": round(len(served) / (cpu - cpu0)),
        "descriptors_max": int(fds),
        "rss_beyond_mb": round(rss, 1),
        "anon_beyond_mb": round(anon, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--mode", choices=("plain", "packed"), default="plain")
    p.add_argument("--window-shards", type=int, default=None, help="data.shuffle_window_shards (default: the config's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = epoch(args.dir, args.workers, args.mode, args.window_shards)
    print(json.dumps(out) if args.json else " ".join(f"{k}={v}" for k, v in out.items()), flush=True)


if __name__ == "__main__":
    main()
