"""The docs site (mkdocs.yml, docs/): ``mkdocs build --strict`` passes, and fails on what it must refuse.

The refusals are proven on a copy of the site in a temp folder with one fault planted each: a link to a
page that does not exist, a page left out of the nav, a link to a BENCHMARKS.md section that does not
exist (mkdocs' defaults only log some of these at "info"; mkdocs.yml's ``validation`` makes them
warnings, and ``--strict`` fails on warnings). And every file of the checkout the pages name in code spans
(``tests/test_x.py``, ``tools/bench_*.py``, ``configs/x.yaml``) exists, so a renamed file cannot leave a page
pointing at nothing. Cost: ~1 s a build."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

SITE_FILES = ("mkdocs.yml", "BENCHMARKS.md", "docs", "tools/mkdocs_hooks.py")
# a checkout path in a code span: a top folder, then path characters (globs allowed; `{a,b}` and `<x>` forms end it)
NAMED_PATH = re.compile(r"`((?:dataio|training|kernels|configtree|tools|tests|configs|docs)/[\w./*-]+)")


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's banner about its successor
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(site)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def copy_site(dest: Path) -> Path:
    for name in SITE_FILES:
        src, dst = REPO / name, dest / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return dest


def test_site_builds_strict(tmp_path):
    proc = build(REPO, tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "BENCHMARKS" / "index.html").is_file()  # the hook's copy of the figures


@pytest.mark.parametrize(
    "fault, message",
    [
        (
            lambda root: _append(root / "docs" / "security.md", "\nSee [the missing page](no-such-page.md).\n"),
            "no-such-page.md",
        ),
        (lambda root: (root / "docs" / "orphan.md").write_text("# Not in the nav\n"), "orphan.md"),
        (
            lambda root: _append(root / "docs" / "gpu.md", "\n[Gone](../BENCHMARKS.md#no-such-section)\n"),
            "no-such-section",
        ),
    ],
    ids=["broken-link", "page-missing-from-nav", "broken-benchmarks-anchor"],
)
def test_strict_build_fails_on_a_planted_fault(tmp_path, fault, message):
    root = copy_site(tmp_path / "copy")
    fault(root)
    proc = build(root, tmp_path / "site")
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-3000:]


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def named_paths(text: str) -> set[str]:
    return {m.rstrip(".") for m in NAMED_PATH.findall(text)}


def test_named_paths_finds_files_and_globs():
    assert named_paths("see `tests/test_x.py::test_y`, `tools/bench_*.py` and `configs/debug_{a,b}.yaml`.") == {
        "tests/test_x.py",
        "tools/bench_*.py",
        "configs/debug_",
    }


def test_every_file_the_pages_name_exists():
    missing = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for path in named_paths(page.read_text()):
            if path.endswith("_"):  # cut at a `{a,b}` or `<x>` form: a pattern, not a file
                continue
            if not (list(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
                missing.append(f"{page.relative_to(REPO)}: {path}")
    assert not missing, missing
