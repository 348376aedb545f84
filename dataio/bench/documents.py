"""Real English text that ships inside every install of the stack, for the demo corpus and benchmarks.

The long descriptions (READMEs) in the ``METADATA`` of headrace's installed runtime dependency tree and
the docstrings of the Python standard library (read with ``ast``, never imported): together the natural
long-tailed length distribution of real corpora. ``select_documents(n)`` keeps every README and fills up
to ``n`` with docstrings ranked by the SHA-1 of their text, so the selection depends neither on file
order, hash seeds nor the number of CPUs. Cost: ~5 s on 2 cores, mostly parsing the standard library.
"""

from __future__ import annotations

import ast
import hashlib
import re
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# Standard-library folders that hold tests, GUIs or vendored copies rather than documentation.
STDLIB_SKIP = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "site-packages",
    "dist-packages",
    "__pycache__",
}


@dataclass(frozen=True)
class Document:
    source: str
    text: str

    @property
    def rank(self) -> str:
        return hashlib.sha1(self.text.encode()).hexdigest()


def package_readmes() -> list[Document]:
    """Long descriptions of headrace's runtime dependency tree, as installed in this interpreter.

    Only the dependency tree (not whatever else the environment holds), so that every install of the
    same versions builds the same corpus.
    """
    docs = []
    for dist in dependency_closure():
        body = dist.metadata.get_payload() or _unindent(dist.metadata.get("Description") or "")
        text = _clean(body)
        if len(text) >= 200:
            docs.append(Document(f"pypi:{dist.metadata['Name']}=={dist.version}", text))
    return docs


def dependency_closure() -> list[metadata.Distribution]:
    """The installed distributions headrace's runtime requirements pull in, recursively, by name."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo = list(metadata.requires("headrace") or [])  # extras carry an `extra == ...` marker: dropped below
    found: dict[str, metadata.Distribution] = {}
    while todo:
        req = Requirement(todo.pop())
        name = canonicalize_name(req.name)
        if name in found or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            found[name] = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # an optional platform dependency
            continue
        todo += found[name].requires or []
    return [found[name] for name in sorted(found)]


def stdlib_docstrings() -> list[Document]:
    """Docstrings of modules, classes and functions in the standard library, parsed with ``ast``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if STDLIB_SKIP & set(rel.parts[:-1]):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):  # a few files are templates or Python-2 leftovers
            continue
        for qualname, node in _documented_nodes(tree):
            text = _clean(ast.get_docstring(node) or "")
            if len(text) >= 20:
                docs.append(Document(f"python-stdlib:{rel.as_posix()}:{qualname}", text))
    return docs


def _documented_nodes(tree: ast.Module):
    yield "<module>", tree
    stack = [("", tree)]
    while stack:
        prefix, parent = stack.pop()
        for node in parent.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = prefix + node.name
                yield qualname, node
                stack.append((qualname + ".", node))


def _unindent(description: str) -> str:
    # Old-style METADATA folds the description into a header: continuation lines start with 8 spaces or "|".
    lines = description.splitlines()
    return "\n".join(lines[:1] + [re.sub(r"^( {8}|\|)", "", line) for line in lines[1:]])


def _clean(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return "\n".join(lines).strip()


def select_documents(n: int) -> list[Document]:
    """Every package README, then docstrings in hash order up to ``n``; sorted by source."""
    seen: set[str] = set()

    def unique(docs: list[Document]) -> list[Document]:
        kept = []
        for doc in sorted(docs, key=lambda d: (d.rank, d.source)):
            if doc.text not in seen:
                seen.add(doc.text)
                kept.append(doc)
        return kept

    readmes = unique(package_readmes())[:n]
    docstrings = unique(stdlib_docstrings())[: n - len(readmes)]
    return sorted(readmes + docstrings, key=lambda d: d.source)


__all__ = ["Document", "dependency_closure", "package_readmes", "select_documents", "stdlib_docstrings"]
