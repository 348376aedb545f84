"""Which libsndfile build soundfile decodes with (``decode.libsndfile``).

The ``soundfile`` wheel ships its own libsndfile (1.2.2 with libFLAC linked in) and loads it before any
copy on the system. That build decodes 16-bit FLAC at about half the speed of Debian's libsndfile 1.2.0
(libFLAC 1.4) or the build NVIDIA DALI bundles: ~1.27 ms against ~0.62 ms of CPU for a 4.5 s 16 kHz
utterance on the benchmark machine (BENCHMARKS.md, "Decoded audio straight into the batch"). The
decoded values are the same: FLAC, WAV and MP3 bit for bit, Ogg Vorbis within one float32 ulp
(checked in tests/test_audio_batch.py).

``decode.libsndfile``:

- ``auto`` (default): the system's libsndfile (from the dynamic linker's cache, ``ldconfig -p``) when it
  is 1.1.0 or newer (the first release that reads MP3, so it decodes every format the wheel's does),
  else the wheel's. It is opened by full path: by its bare name ``libsndfile.so.1`` the dynamic linker
  hands back the wheel's copy, already loaded under that soname;
- ``bundled``: the wheel's own;
- a path: that ``libsndfile.so``.

soundfile keeps one library handle per process (``soundfile._snd``, which every soundfile call goes
through, encoding included); ``use`` swaps it once per process, before the first decode, so the whole
process then uses the chosen build. Cost after the first call: one string comparison.
"""

from __future__ import annotations

import os
import re
import subprocess

import soundfile

MIN_SYSTEM_VERSION = (1, 1, 0)  # libsndfile 1.1.0 added MP3; older system builds decode less than the wheel's

_BUNDLED = soundfile._snd  # the handle soundfile opened at import
_chosen: str | None = None  # the choice applied in this process


def version(handle) -> tuple[int, ...]:
    """``(major, minor, patch)`` of a loaded libsndfile."""
    text = soundfile._ffi.string(handle.sf_version_string()).decode()
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def system_paths() -> list[str]:
    """Full paths of the libsndfile builds in the dynamic linker's cache."""
    try:
        listing = subprocess.run(
            ["ldconfig", "-p"],
            capture_output=True,
            text=True,
            timeout=30,
            env=dict(os.environ, PATH=os.environ.get("PATH", "") + ":/sbin:/usr/sbin"),
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [
        line.rsplit("=>", 1)[1].strip()
        for line in listing.splitlines()
        if line.strip().startswith("libsndfile.so") and "=>" in line
    ]


def _system():
    """The system's libsndfile if it is new enough, else None."""
    for path in system_paths():
        try:
            handle = soundfile._ffi.dlopen(path)
        except OSError:  # another architecture's build
            continue
        if version(handle) >= MIN_SYSTEM_VERSION:
            return handle
    return None


def use(choice: str) -> None:
    """Make soundfile decode with the libsndfile ``choice`` names (see the module docstring)."""
    global _chosen
    if choice == _chosen:
        return
    if choice == "auto":
        handle = _system() or _BUNDLED
    elif choice == "bundled":
        handle = _BUNDLED
    else:
        handle = soundfile._ffi.dlopen(choice)
    soundfile._snd, _chosen = handle, choice


def check(choice: str) -> None:
    """ValueError naming ``decode.libsndfile`` unless ``choice`` is a keyword or an existing file."""
    if choice not in ("auto", "bundled") and not os.path.isfile(choice):
        raise ValueError(f"decode.libsndfile must be auto, bundled or the path of a libsndfile.so; no file {choice!r}")


def loaded() -> str:
    """The version string of the libsndfile soundfile uses now (for benchmark reports)."""
    return soundfile._ffi.string(soundfile._snd.sf_version_string()).decode()


__all__ = ["MIN_SYSTEM_VERSION", "check", "loaded", "system_paths", "use", "version"]
