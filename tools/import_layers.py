"""The layers of headrace's import graph, stated once, and the check that the code keeps them.

``LAYERS`` lists the layers bottom up; a module belongs to the layer of its longest listed prefix (a package
name covers everything under it that no longer prefix claims). The rules, checked by ``tests/test_import_graph.py``
under the installed names (``headrace.*``, folders from ``tools.package_dirs``):

- no circle: no module reaches itself through imports;
- no arrow up: a module imports only modules of its own layer or of the layers below it.

Imports are read from the source with ``ast`` (no module is imported): every ``import`` / ``from ... import`` at
module level or inside a function counts (a deferred import is still a dependency), those under
``if TYPE_CHECKING:`` do not (annotations only). ``from pkg import name`` is an edge to ``pkg.name`` when that is
a module, else to ``pkg``; a parent package's ``__init__`` is not counted for importing its submodule.
Cost: one parse per file (~300 files, well under a second).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tools.package_dirs import PACKAGE_DIRS, REPO

H, D, T = "headrace", "headrace.dataio", "headrace.training"
# bottom up: (name, module prefixes)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("config trees", (f"{H}.config",)),
    ("kernels", (f"{H}.kernels",)),
    (
        "data errors and units",
        (f"{D}.usererror", f"{D}.interrupts", f"{D}.sizes", f"{D}.libsndfile", f"{D}.stagetimes"),
    ),
    ("data config", (f"{D}.config", f"{D}.loader_state")),
    ("shard format", (f"{D}.shards",)),
    ("corpus preparation", (f"{D}.prepare",)),
    ("stream: sources", (f"{D}.stream.sources",)),
    ("stream: ordering", (f"{D}.stream.ordering",)),
    ("stream: reading", (f"{D}.stream.reading",)),
    ("stream: a rank's stream", (f"{D}.stream",)),
    ("batching", (f"{D}.batching",)),
    ("loader and feed", (f"{D}.loader", f"{D}.feed", f"{D}.worker_count", f"{D}.verify")),
    ("dataio tools", (D,)),  # bench, commands, cli: everything else of dataio
    ("trainer base", (f"{T}.errors", f"{T}.dir_files", f"{T}.dcp_logging", f"{T}.protocols")),
    ("job config", (f"{T}.config",)),
    ("models", (f"{T}.models",)),
    ("parallelisms", (f"{T}.distributed",)),
    ("components", (f"{T}.components", f"{T}.checkpoint")),
    ("step", (f"{T}.step", f"{T}.step_inputs")),
    ("model kinds", (f"{T}.causal_lm", f"{T}.speech")),
    ("trainer", (T,)),  # model_kinds, validation, train, eval, launch, estimate_batch: everything else
]


def layer_of(module: str, layers=LAYERS) -> int:
    """The index in ``layers`` of ``module``'s longest matching prefix (ValueError when none matches)."""
    best = max(
        (
            (len(p), i)
            for i, (_, prefixes) in enumerate(layers)
            for p in prefixes
            if module == p or module.startswith(p + ".")
        ),
        default=None,
    )
    if best is None:
        raise ValueError(f"{module}: in no layer of tools/import_layers.py LAYERS")
    return best[1]


def modules(repo: Path = REPO, package_dirs: dict[str, str] = PACKAGE_DIRS) -> dict[str, Path]:
    """Every module of the runtime under its installed name -> its file."""
    found = {}
    for name, folder in package_dirs.items():
        for file in sorted((repo / folder).rglob("*.py")):
            parts = file.relative_to(repo / folder).with_suffix("").parts
            found[".".join([name, *(parts[:-1] if parts[-1] == "__init__" else parts)])] = file
    return found


def imports_of(module: str, file: Path, known: dict[str, Path]) -> set[str]:
    """The runtime modules ``module`` (in ``file``) imports (see the module docstring for what counts)."""
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(ast.Module(body=child.orelse, type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([child.module] if child.module else [])])
                subs = [f"{base}.{alias.name}" for alias in child.names if f"{base}.{alias.name}" in known]
                found.update(subs)
                if len(subs) < len(child.names):
                    found.add(base)
            visit(child)

    visit(ast.parse(file.read_text(), str(file)))
    return {m for m in found if m in known and m != module}


def import_graph(repo: Path = REPO, package_dirs: dict[str, str] = PACKAGE_DIRS) -> dict[str, set[str]]:
    known = modules(repo, package_dirs)
    return {module: imports_of(module, file, known) for module, file in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        found.append(sorted(component))
    return found


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """``importer -> imported`` for every import of a module from a layer above the importer's."""
    return [
        f"{module} ({layers[layer_of(module, layers)][0]}) -> {target} ({layers[layer_of(target, layers)][0]})"
        for module in sorted(graph)
        for target in sorted(graph[module])
        if layer_of(target, layers) > layer_of(module, layers)
    ]


__all__ = ["LAYERS", "circles", "import_graph", "imports_of", "layer_of", "modules", "upward_imports"]
