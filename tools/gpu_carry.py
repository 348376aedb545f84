"""What a GPU run of ``tools/gpu_check.sh`` carries to the lent machine, and whether it fits in one call.

The lent machine runs an image of its own (Python 3.12, torch 2.11, transformers 5.17; its packages, as last read,
are ``tools/gpu_image_packages.txt``). Some parts import packages it lacks: those travel as cp312 manylinux wheels
in ``.whl`` (ignored by git), beside the checkout's tracked files and the speech corpus the ``speech_recipe`` part
trains on; one device call carries at most 64 MiB of all that. This tool

1. downloads every carried wheel at its locked version (``constraints.txt``; ``EXTRA_PINS`` for what only the
   torchtitan part needs, which the project does not install),
2. checks the carry is closed: every requirement of a carried wheel (markers evaluated for Python 3.12 on Linux)
   is in the image, or carried at a version it accepts, or listed in ``NOT_IMPORTED`` with the reason the parts
   never import it,
3. adds the sizes up and exits 1 when they do not fit (2 on a wheel pip cannot fetch).

    python -m tools.gpu_carry --out .whl              # download (PyPI), check, print the table
    python -m tools.gpu_carry --out .whl --offline    # check the wheels already there
    python -m tools.gpu_carry --install-here DIR      # + the carried packages this Python lacks, into DIR
                                                      # (gpu_check.sh --dry-run puts DIR on PYTHONPATH)

Then the device call: ``carry: [".whl", "demo/corpus_asr_gpu"]`` and a command starting with
``python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
export PYTHONPATH=/tmp/site:$PYTHONPATH;`` (BENCHMARKS.md, GPU check).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20  # the device tool's limit on what one call carries
IMAGE_PACKAGES = REPO / "tools/gpu_image_packages.txt"
SPEECH_CORPUS = "demo/corpus_asr_gpu"  # built here (espeak-ng), trained on there

# carried distribution -> the parts that import it
CARRIED = {
    "webdataset": "train_webdataset, train_plain, smoke (tar shards read by webdataset)",
    "braceexpand": "webdataset's shard patterns",
    "lhotse": "smoke, speech_recipe (cut manifests, duration bucketing)",
    "audioread": "lhotse",
    "cytoolz": "lhotse",
    "intervaltree": "lhotse",
    "soundfile": "speech_recipe, smoke (audio decoding)",
    "cffi": "soundfile",
    "pycparser": "cffi",
    "soxr": "speech_recipe (resampling)",
    "torchao": "train_float8, train_float8_rowwise, float8_loss",
    "torchtitan": "train_torchtitan",
    "torchdata": "torchtitan",
    "torch-checkpointing": "torchtitan",
    "spmd-types": "torchtitan",
    "datasets": "torchtitan's HuggingFaceTextDataLoader",
    "dill": "datasets",
    "multiprocess": "datasets",
    "tyro": "torchtitan's config manager",
    "docstring-parser": "tyro",
    "typeguard": "tyro",
}
# versions of carried packages the lock does not hold (the project never installs torchtitan's stack); datasets
# 4.7 caps dill and multiprocess below their newest releases
EXTRA_PINS = {
    "torchtitan": "0.3.0",
    "torchdata": "0.11.0",
    "torch-checkpointing": "0.1.1",
    "spmd-types": "0.2.3",
    "datasets": "4.7.0",
    "dill": "0.4.0",
    "multiprocess": "0.70.18",
    "tyro": "1.0.17",
    "docstring-parser": "0.17.0",
    "typeguard": "4.4.4",
}
# requirements of carried wheels that no part imports: carrying them would only spend the 64 MiB
NOT_IMPORTED = {
    "wandb": "torchtitan imports it inside WandBLogger, which its wandb switch (off in tools.bench_torchtitan) builds",
}
# what the image has and a dry run on a CPU must add: torch's CUDA build brings triton, the CPU wheel does not, and
# torchtitan imports it at module level (its expert-parallel kernels)
DRY_RUN_ONLY = {"triton": "3.6.0"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64")
PLATFORMS += ("manylinux2014_x86_64", "manylinux1_x86_64")
TARGET_ENV = dict(default_environment(), python_version="3.12", python_full_version="3.12.3", sys_platform="linux")
TARGET_ENV.update(platform_system="Linux", platform_machine="x86_64", implementation_name="cpython", extra="")


@dataclass(frozen=True, kw_only=True)
class Wheel:
    name: str  # canonical distribution name
    version: Version
    path: Path


def locked_versions(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            pins[canonicalize_name(name)] = version.strip()
    return pins


def pins(lock: Path) -> dict[str, str]:
    """Carried distribution -> version: the lock's, else EXTRA_PINS'."""
    locked = locked_versions(lock)
    out = {}
    for name in CARRIED:
        version = locked.get(canonicalize_name(name)) or EXTRA_PINS.get(name)
        if version is None:
            raise SystemExit(f"gpu_carry: {name} is carried but neither constraints.txt nor EXTRA_PINS pins it")
        out[name] = version
    return out


def download(versions: dict[str, str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    specs = [f"{name}=={version}" for name, version in versions.items()]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *platforms]
    done = subprocess.run([*cmd, "-d", str(out), *specs], capture_output=True, text=True)
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
        raise SystemExit(f"gpu_carry: pip download failed: {last[-1] if last else done.returncode}")


def wheels_in(folder: Path) -> dict[str, Wheel]:
    found = {}
    for path in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        found[canonicalize_name(name)] = Wheel(name=canonicalize_name(name), version=version, path=path)
    return found


def requirements(wheel: Wheel) -> list[Requirement]:
    """The wheel's Requires-Dist lines that apply on the GPU image (Python 3.12, Linux, no extras)."""
    import zipfile

    with zipfile.ZipFile(wheel.path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode("utf-8", "replace").splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(TARGET_ENV)]


def open_requirements(wheels: dict[str, Wheel], image: set[str]) -> list[str]:
    """One line per requirement of a carried wheel that the lent machine would not satisfy."""
    problems = []
    for wheel in wheels.values():
        for req in requirements(wheel):
            name = canonicalize_name(req.name)
            if name in wheels:
                if req.specifier and wheels[name].version not in req.specifier:
                    problems.append(f"{wheel.name} needs {req}, carried {name} {wheels[name].version}")
            elif name not in image and name not in NOT_IMPORTED:
                problems.append(f"{wheel.name} needs {req}: neither in the image nor carried")
    return problems


def install_here(versions: dict[str, str], target: Path) -> None:
    """The carried distributions this interpreter lacks, for this interpreter, into ``target``, with the
    requirements of theirs it lacks too (the image has pandas, this venv does not): a dry run on a CPU then
    imports what the lent machine will (torchtitan's stack, which the project does not install)."""
    from importlib.metadata import distributions

    def present(name: str) -> bool:
        return any(True for _ in distributions(name=name, path=[*sys.path, str(target)]))

    here = dict(default_environment(), extra="")
    want = {name: f"{name}=={v}" for name, v in {**versions, **DRY_RUN_ONLY}.items() if not present(name)}
    asked: set[str] = set()
    while want:  # pip --no-deps, one round per layer of requirements: nothing this venv has is replaced
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
        subprocess.run([*cmd, "--target", str(target), *want.values()], check=True)
        asked |= set(want)
        want = {}
        for dist in distributions(path=[str(target)]):
            for req in map(Requirement, dist.requires or []):
                name = canonicalize_name(req.name)
                if (req.marker is None or req.marker.evaluate(here)) and name not in asked and not present(name):
                    want[name] = f"{req.name}{req.specifier}"


def tree_bytes(repo: Path) -> int:
    """What the device tool sends of the checkout: tracked and untracked-but-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    return sum((repo / p).stat().st_size for p in listed.decode().split("\0") if p and (repo / p).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m tools.gpu_carry")
    parser.add_argument("--out", type=Path, default=REPO / ".whl", help="the wheel folder (default: .whl)")
    parser.add_argument("--offline", action="store_true", help="check the wheels already in --out")
    parser.add_argument("--install-here", type=Path, metavar="DIR", help=install_here.__doc__.split(":")[0])
    parser.add_argument("--corpus", type=Path, default=REPO / SPEECH_CORPUS, help="the speech corpus carried")
    parser.add_argument("--lock", type=Path, default=REPO / "constraints.txt")
    parser.add_argument("--limit-mib", type=float, default=LIMIT_BYTES / 2**20)
    args = parser.parse_args(argv)

    versions = pins(args.lock)
    if not args.offline:
        download(versions, args.out)
    if args.install_here:
        install_here(versions, args.install_here)
    wheels = {n: w for n, w in wheels_in(args.out).items() if n in {canonicalize_name(c) for c in CARRIED}}
    missing = [f"{n}=={v}" for n, v in versions.items() if canonicalize_name(n) not in wheels]
    lines = IMAGE_PACKAGES.read_text().splitlines()
    image = {canonicalize_name(line.strip()) for line in lines if line.strip() and not line.startswith("#")}
    problems = [f"not in {args.out}: {m}" for m in missing] + open_requirements(wheels, image)

    corpus = args.corpus
    rows = [(f"{w.name} {w.version}", w.path.stat().st_size) for w in wheels.values()]
    rows.append(("the checkout (tracked + untracked, not ignored)", tree_bytes(REPO)))
    if corpus.is_dir():
        rows.append((str(corpus), folder_bytes(corpus)))
    else:
        problems.append(f"{corpus} is absent: build it (tools/gpu_check.sh --dry-run's speech_corpus part)")
    total = sum(size for _, size in rows)
    for what, size in sorted(rows, key=lambda r: -r[1]):
        print(f"{size / 2**20:8.2f} MiB  {what}")
    limit = args.limit_mib * 2**20
    print(f"{total / 2**20:8.2f} MiB  in all, of {limit / 2**20:.0f} MiB a device call carries")
    if total > limit:
        problems.append(f"the carry is {total / 2**20:.1f} MiB, over the {limit / 2**20:.0f} MiB one call carries")
    for line in problems:
        print(f"gpu_carry: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
