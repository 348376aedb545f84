"""Every ``torch.*`` attribute path headrace's code uses, checked against the floor torch (2.11, what the GPU
images carry; pyproject.toml's lower bound).

``uses()`` walks the syntax trees of the project's code (no import) and resolves import aliases:
``import torch.distributed as dist`` makes ``dist.all_gather_into_tensor`` the path
``torch.distributed.all_gather_into_tensor``; ``from torch.nn import functional as F`` makes ``F.pad``
``torch.nn.functional.pad``; ``from torch.x import y`` uses ``torch.x.y``. Each attribute chain is taken up
to its first call or subscript (``torch.cuda.get_device_properties(0).total_memory`` uses
``torch.cuda.get_device_properties``). Not seen: names reached through ``getattr`` with a string, and
attributes of objects that torch returns (a tensor's methods as ``x.foo()``).

``record`` resolves each path in the torch this interpreter imports -- attribute by attribute, importing a
submodule where no attribute has the name -- and writes ``tools/torch_floor_api.txt``: the torch version,
then one line per path, ``!`` before the ones that torch lacks. ``bash tools/torch_floor.sh`` runs it under
torch 2.11 in a cached venv (a 531 MB wheel plus its 2.1 GB of CUDA libraries: see BENCHMARKS.md, so this
is a command, not a CI leg). ``tests/test_dependencies.py`` (CI, about a second) fails on a path that the
record marks missing, and on a path the code uses that the record lacks (new code: re-record).
Cost of ``uses()``: one parse of ~300 files, ~1 s.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path

from tools.package_dirs import RUNTIME_FOLDERS

REPO = Path(__file__).resolve().parent.parent
ROOTS = (*RUNTIME_FOLDERS, "tools", "tests")
# runs only under the torch of the CPU machine doing `gpu_check.sh --dry-run` (it stands in for a GPU there), never
# under the GPU image's floor torch
NOT_ON_THE_FLOOR = ("tools/gpu_dry_run",)
RECORD = REPO / "tools" / "torch_floor_api.txt"
FLOOR = "2.11"


def _chain(node: ast.AST) -> tuple[str, list[str]] | None:
    """``a.b.c`` -> ("a", ["b", "c"]); None when the chain starts at anything but a name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def file_uses(tree: ast.AST) -> set[str]:
    """The torch paths one module uses (aliases are module-wide: a local name shadowing one is rare here)."""
    aliases: dict[str, str] = {}
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    used.add(a.name)
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases["torch"] = "torch"
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == "torch"
        ):
            for a in node.names:
                if a.name != "*":
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    used.add(f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in aliases:
                used.add(".".join([aliases[chain[0]], *chain[1]]))
    return used


def uses(repo: Path = REPO) -> dict[str, list[str]]:
    """torch path -> the files (relative to ``repo``) that use it."""
    found: dict[str, list[str]] = {}
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            if str(path.relative_to(repo)).startswith(NOT_ON_THE_FLOOR):
                continue
            for name in file_uses(ast.parse(path.read_text(), str(path))):
                found.setdefault(name, []).append(str(path.relative_to(repo)))
    return found


def resolves(path: str) -> bool:
    """Whether the imported torch has ``path`` (an attribute, or a submodule that imports)."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[: i + 1]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("torch"):
                raise  # torch has the module; a package it imports is missing here: install it, do not guess
            return False
    return True


def read_record(text: str) -> tuple[str, set[str], set[str]]:
    """(torch version, present paths, missing paths) of a record file."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    version = lines[0].removeprefix("torch ")
    missing = {ln[1:] for ln in lines[1:] if ln.startswith("!")}
    return version, {ln for ln in lines[1:] if not ln.startswith("!")}, missing


def record(out: Path) -> list[str]:
    """Resolve every used path in this interpreter's torch; write the record; return the missing paths."""
    import torch

    used = uses()
    missing = sorted(p for p in used if not resolves(p))
    lines = [f"torch {torch.__version__.split('+')[0]}"] + [("!" if p in missing else "") + p for p in sorted(used)]
    out.write_text(
        "# Written by `bash tools/torch_floor.sh` (python -m tools.torch_api record under the floor torch);\n"
        "# '!': the path does not exist in that torch. Checked by tests/test_torch_api.py.\n" + "\n".join(lines) + "\n"
    )
    return [f"{p} ({', '.join(used[p][:3])})" for p in missing]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.torch_api", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["list", "record"])
    ap.add_argument("--out", type=Path, default=RECORD)
    args = ap.parse_args(argv)
    if args.action == "list":
        for name, files in sorted(uses().items()):
            print(name, " ".join(files[:3]))
        return 0
    missing = record(args.out)
    for m in missing:
        print(f"missing in this torch: {m}", file=sys.stderr)
    return 2 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
