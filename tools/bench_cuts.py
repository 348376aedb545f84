"""Opening a Lhotse cuts manifest: headrace's lazy index (first and later opens) vs lhotse's eager CutSet.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.bench_cuts --cuts 100000 --workdir /tmp/cuts_bench

Writes a ``cuts.jsonl.gz`` of ``--cuts`` whole-recording cuts (one short FLAC, distinct ids, a
supervision each), then times, each in a fresh process after its imports (peak RSS reset through ``/proc/self/clear_refs``): ``CutsIndex`` with no
cache (one streaming pass, writes the cache), ``CutsIndex`` again (reads the cache only), and
``list(CutSet.from_file(...))`` (what ``LhotseCutSource`` did before); each then reads cut 0 (the first
batch's cost). Prints seconds to the first cut and the process's peak RSS growth.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


MEASURE = """
import json, time
from lhotse import CutSet
from lhotse.serialization import deserialize_item
from headrace.dataio.stream.sources.cuts_index import CutsIndex

def status(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":")) / 1024

open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS (imports done)
before = status("VmRSS")
start = time.perf_counter()
if {mode!r} == "lhotse":
    cuts = list(CutSet.from_file({path!r})); first = cuts[0]
else:
    cuts = CutsIndex({path!r}); first = cuts.load(0)
print(json.dumps({{"seconds": time.perf_counter() - start, "rss_mib": status("VmHWM") - before, "cuts": len(cuts)}}))
"""


def write_manifest(path: Path, count: int) -> None:
    import numpy as np
    import soundfile
    from lhotse import CutSet, Recording, SupervisionSegment

    audio = path.parent / "a.flac"
    soundfile.write(audio, (np.sin(np.arange(16000) / 5) * 0.3).astype(np.float32), 16000)
    rec = Recording.from_file(audio, recording_id="rec")
    cut = rec.to_cut()
    cut.supervisions = [SupervisionSegment(id="s", recording_id=rec.id, start=0, duration=rec.duration, text="words")]
    CutSet.from_cuts([cut]).repeat(times=count, preserve_id=False).to_file(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cuts", type=int, default=100_000)
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    manifest = args.workdir / "cuts.jsonl.gz"
    from headrace.dataio.stream.sources.cuts_index import cache_paths

    for p in cache_paths(str(manifest)):
        p.unlink(missing_ok=True)
    write_manifest(manifest, args.cuts)
    for name, mode in (("headrace first open", "index"), ("headrace cached", "index"), ("lhotse eager", "lhotse")):
        out = subprocess.run(
            [sys.executable, "-c", MEASURE.format(mode=mode, path=str(manifest))],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(
            f"{name:20s} {r['cuts']:>8,} cuts: first cut after {r['seconds']:6.2f} s, peak RSS +{r['rss_mib']:7.1f} MiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
