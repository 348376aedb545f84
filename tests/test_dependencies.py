"""The dependency policy: pyproject's ranges, the lock (constraints.txt), runtime vs. ``bench`` imports, and
the torch paths the code uses against the floor torch's record (tools/torch_api.py)."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from tools import lockfile, torch_api
from tools.package_dirs import RUNTIME_FOLDERS

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
RUNTIME_ROOTS = RUNTIME_FOLDERS
# Runtime dependencies the code reaches through another package rather than by importing them.
USED_THROUGH = {"tensorboard": "torch.utils.tensorboard"}


def _requirements(*groups: str) -> list[Requirement]:
    extras = PROJECT["optional-dependencies"]
    return [Requirement(r) for g in groups for r in (PROJECT["dependencies"] if g == "runtime" else extras[g])]


def test_every_declared_dependency_is_locked_inside_its_range():
    lock = lockfile.parse((REPO / "constraints.txt").read_text())
    for req in _requirements("runtime", *PROJECT["optional-dependencies"]):
        name = lockfile.canonical(req.name)
        assert name in lock, f"{req} is declared but constraints.txt pins no {name}: run bash tools/update_lock.sh"
        assert req.specifier.contains(Version(lock[name]), prereleases=True), (
            f"constraints.txt pins {name}=={lock[name]}, outside the declared {req}: run bash tools/update_lock.sh"
        )


def test_torch_and_transformers_are_ranges_from_the_floor_to_the_tested_top():
    lock = lockfile.parse((REPO / "constraints.txt").read_text())
    runtime = {lockfile.canonical(r.name): r for r in _requirements("runtime")}
    torch = runtime["torch"].specifier
    assert torch.contains("2.11.0") and not torch.contains("2.10.0") and torch.contains(lock["torch"])
    assert not torch.contains("2.14.0"), "a torch range above the tested top pulls an untested (CUDA) build"
    tf = runtime["transformers"].specifier
    assert tf.contains("5.17.0") and tf.contains(lock["transformers"])
    top = Version(lock["transformers"])
    assert not tf.contains(f"{top.major}.{top.minor + 1}.0"), "transformers' top must be the tested one"


def test_lockfile_check_accepts_the_environment_and_names_a_wrong_version(tmp_path, capsys):
    """Through the CLI that tools/setup.sh runs: a lock written from this environment passes; one pin changed
    fails (exit 2) naming the package; a pin of something absent is only a note."""
    lock = tmp_path / "constraints.txt"
    assert lockfile.main(["write", str(lock)]) == 0
    pins = lockfile.parse(lock.read_text())
    assert "headrace" not in pins and "pip" not in pins and all("+" not in v for v in pins.values())
    assert pins["torch"] == __import__("torch").__version__.split("+")[0]
    assert lockfile.main(["check", str(lock)]) == 0
    lock.write_text(lockfile.render({**pins, "numpy": "0.0.1", "not-a-real-dist": "1.0"}))
    assert lockfile.main(["check", str(lock)]) == 2
    err = capsys.readouterr().err
    assert "the lock pins 0.0.1" in err and "numpy is" in err and "not-a-real-dist==1.0 locked, not installed" in err


def test_lockfile_parse_refuses_a_line_that_is_not_a_pin():
    assert lockfile.parse("# c\nFoo_Bar.baz==1.2  # x\n\n") == {"foo-bar-baz": "1.2"}
    try:
        lockfile.parse("numpy>=1\n")
    except ValueError as e:
        assert "line 1" in str(e) and "numpy>=1" in str(e)
    else:
        raise AssertionError("a range in the lock was accepted")


def _third_party_imports(roots: tuple[str, ...], skip: str = "dataio/bench") -> dict[str, dict[str, bool]]:
    """top-level import name -> {file: imported at module level (not inside a function)}."""
    std = set(sys.stdlib_module_names) | {"__future__", "headrace"}  # our own: the folders, installed as headrace.*
    found: dict[str, dict[str, bool]] = {}
    for root in roots:
        for path in (REPO / root).rglob("*.py"):
            rel = str(path.relative_to(REPO))
            if rel.startswith(skip):
                continue
            tree = ast.parse(path.read_text())
            lazy = {
                id(n)
                for f in ast.walk(tree)
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                for n in ast.walk(f)
            }
            for node in ast.walk(tree):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module]
                    if isinstance(node, ast.ImportFrom) and node.level == 0
                    else []
                )
                for name in names:
                    top = name.split(".")[0]
                    if top not in std:
                        found.setdefault(top, {})
                        found[top][rel] = found[top].get(rel, False) or id(node) not in lazy
    return found


def test_runtime_dependencies_are_what_the_runtime_imports():
    """Runtime code (outside dataio/bench) imports at module level only runtime dependencies; every runtime
    dependency is imported by it (accelerate, never imported, left); everything else it imports lazily."""
    runtime = {lockfile.canonical(r.name) for r in _requirements("runtime")}
    dists = {mod: {lockfile.canonical(d) for d in ds} for mod, ds in packages_distributions().items()}
    imports = _third_party_imports(RUNTIME_ROOTS)
    eager = {mod: [f for f, top in files.items() if top] for mod, files in imports.items()}
    eager = {mod: files for mod, files in eager.items() if files and not dists.get(mod, set()) & runtime}
    assert not eager, f"imported at module level but not a runtime dependency (import it lazily): {eager}"
    imported = set().union(*(dists.get(mod, set()) for mod in imports))
    sources = "".join(p.read_text() for root in RUNTIME_ROOTS for p in (REPO / root).rglob("*.py"))
    unused = {d for d in runtime - imported if USED_THROUGH.get(d) is None or USED_THROUGH[d] not in sources}
    assert not unused, f"declared runtime dependencies that the runtime never imports: {sorted(unused)}"


def test_bench_extra_packages_are_imported_lazily():
    """dataio/bench's peers, plots and sampler: absent without the bench extra, so never at module level."""
    bench = {lockfile.canonical(r.name) for r in _requirements("bench")}
    dists = packages_distributions()
    imports = _third_party_imports(("dataio/bench",), skip="-")
    eager = {
        mod: files
        for mod, files in imports.items()
        if {lockfile.canonical(d) for d in dists.get(mod, [])} & bench and any(files.values())
    }
    assert not eager, f"bench-extra packages imported at module level: {eager}"


def test_bench_import_names_the_extra():
    from headrace.dataio.bench.extra import bench_import

    assert bench_import("json", "x").dumps(1) == "1"
    try:
        bench_import("no_such_package_here", "the plot")
    except ImportError as e:
        assert str(e) == "the plot needs no_such_package_here: pip install 'headrace[bench]'"
    else:
        raise AssertionError("a missing package imported")


def test_uses_resolves_import_aliases():
    tree = ast.parse(
        "import torch\nimport torch.distributed as dist\nfrom torch.nn import functional as F\n"
        "from torch.distributed.tensor import Replicate\nimport numpy as np\n"
        "dist.all_gather_single(a, b)\nF.pad(x).sum\ntorch.cuda.get_device_properties(0).total_memory\n"
        "np.zeros(1)\n"
    )
    assert torch_api.file_uses(tree) == {
        "torch",
        "torch.distributed",
        "torch.distributed.all_gather_single",
        "torch.nn.functional",
        "torch.nn.functional.pad",
        "torch.distributed.tensor.Replicate",
        "torch.cuda",
        "torch.cuda.get_device_properties",
    }
    assert torch_api.resolves("torch.distributed.all_gather_into_tensor")
    assert torch_api.resolves("torch.distributed.tensor.parallel.ColwiseParallel")  # a submodule, imported
    assert not torch_api.resolves("torch.distributed.no_such_collective")


def test_every_torch_path_the_code_uses_exists_in_the_floor_torch():
    """tools/torch_floor_api.txt was recorded under torch 2.11 (pyproject's floor) by tools/torch_floor.sh."""
    version, present, missing = torch_api.read_record(torch_api.RECORD.read_text())
    floor = next(
        s.version for r in _requirements("runtime") if r.name == "torch" for s in r.specifier if s.operator == ">="
    )
    assert Version(version).release[:2] == Version(floor).release[:2] == (2, 11)
    used = torch_api.uses()
    lacking = {p: files[:3] for p, files in used.items() if p in missing}
    assert not lacking, f"torch {version} (the floor) lacks: {lacking}"
    unrecorded = {p: files[:3] for p, files in used.items() if p not in present | missing}
    assert not unrecorded, (
        f"torch paths not in {torch_api.RECORD.name} (re-record: bash tools/torch_floor.sh): {unrecorded}"
    )
