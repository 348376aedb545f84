"""The physical read limit of a set of files, and dropping the page cache for cold runs.

``read_limit(paths)`` reads every file sequentially into one preallocated ``READ_CHUNK`` buffer
(``readinto`` on an unbuffered file: one ``read`` syscall per MiB, no allocation, no Python work per
byte), which is what any loader of those files would do if it spent nothing on parsing, decoding or
moving data. From a warm page cache this is the kernel's copy into a buffer that stays in the CPU's
cache (GB/s); after ``drop_page_cache()`` it is the disk. Every loader's rate is reported as a
fraction of it. The buffer is small on purpose: one as large as an 84 MB shard measured 2.2 GB/s here
against 12.6 GB/s for 1 MiB (every byte then also goes out to DRAM and back), a limit loaders beat.

Cost: one pass over the files per repeat; memory: one 1 MiB buffer.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


READ_CHUNK = 1 << 20


def read_seconds(paths: list[Path]) -> float:
    """Seconds to read all ``paths`` once, a ``READ_CHUNK`` at a time into the same buffer."""
    view = memoryview(bytearray(READ_CHUNK))
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - start


def read_limit(paths: list[Path], *, repeats: int = 5, warm: bool = True) -> dict:
    """``{"bytes", "seconds", "bytes_per_s"}``: the fastest of ``repeats`` passes (a limit is what the
    machine can do; slower passes are other processes' noise), after one warm-up pass when ``warm``;
    with ``warm=False`` a single pass, the caller having dropped the cache."""
    if warm:
        read_seconds(paths)
    seconds = min(read_seconds(paths) for _ in range(repeats if warm else 1))
    total = sum(p.stat().st_size for p in paths)
    return {"bytes": total, "seconds": seconds, "bytes_per_s": total / seconds if seconds > 0 else float("inf")}


def drop_page_cache() -> str | None:
    """Drop the page cache (``sync``, then 3 into ``/proc/sys/vm/drop_caches``); None on success, else
    the reason it could not (not root, or no such file: not Linux, or a container without it)."""
    if os.geteuid() != 0:
        return "not root: cannot write /proc/sys/vm/drop_caches"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        return f"/proc/sys/vm/drop_caches: {e.strerror or e}"
    return None


__all__ = ["drop_page_cache", "read_limit", "read_seconds"]
