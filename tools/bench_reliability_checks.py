"""The cost of issue 25's new checks, each beside what it replaced, in interleaved rounds in one
process (the ratio per round is what to quote on a shared machine):

1. the shard version check in ``ShardSource._map`` (per batch and distinct shard): before, one
   ``mmap.size()`` (an fstat returning the size); now one ``os.fstat`` of the kept descriptor and a
   compare of (inode, mtime_ns);
2. ``dataio verify``'s audio check: before, the header probe (``headrace.dataio.prepare.audio.probe``); now a
   full decode (``check_decodes``) of a synthetic 10 s 16 kHz FLAC (sine + noise).

    python -m tools.bench_reliability_checks SHARD.tar [--calls 200000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import io
import mmap
import os
import statistics
import time

import numpy as np
import soundfile as sf

from headrace.dataio.shards.audioheader import check_decodes, probe


def _interleaved(a, b, calls: int, rounds: int) -> tuple[list[float], list[float]]:
    """ns a call of ``a`` and of ``b``, per round."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in zip((a, b), times):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - start) / calls * 1e9)
    return times


def _report(what: str, times: tuple[list[float], list[float]], unit: float, unit_name: str) -> None:
    before, after = times
    ratios = [round(b / a, 2) for a, b in zip(before, after)]
    print(
        f"{what}: before median {statistics.median(before) / unit:,.1f} {unit_name}, after median "
        f"{statistics.median(after) / unit:,.1f} {unit_name}; after/before per round {ratios}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shard")
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    fd = os.open(args.shard, os.O_RDONLY)
    mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    st = os.fstat(fd)
    stamp = (st.st_ino, st.st_mtime_ns)

    def before() -> None:
        if mapped.size() < 1:
            raise SystemExit("empty shard")

    def after() -> None:
        st = os.fstat(fd)
        if st.st_size < 1 or (st.st_ino, st.st_mtime_ns) != stamp:
            raise SystemExit("shard changed")

    _report("shard check (mmap.size -> fstat + stamp)", _interleaved(before, after, args.calls, args.rounds), 1, "ns")

    rng = np.random.default_rng(0)
    wave = (np.sin(np.arange(160_000) / 7.0) * 0.3 + rng.standard_normal(160_000) * 0.05).astype(np.float32)
    out = io.BytesIO()
    sf.write(out, wave, 16_000, format="FLAC")
    flac = out.getvalue()
    _report(
        f"verify's audio check of 10 s of FLAC, {len(flac):,} bytes (probe -> check_decodes)",
        _interleaved(lambda: probe(flac), lambda: check_decodes(flac), 10, args.rounds),
        1e6,
        "ms",
    )


if __name__ == "__main__":
    main()
