"""The docs site (mkdocs.yml, docs/): ``mkdocs build --strict`` passes, and fails on what it must refuse.

The refusals are proven on a copy of the site in a temp folder with one fault planted each: a link to a
page that does not exist, a page left out of the nav, a link to a BENCHMARKS.md section that does not
exist (mkdocs' defaults only log some of these at "info"; mkdocs.yml's ``validation`` makes them
warnings, and ``--strict`` fails on warnings). And every file of the checkout the pages name in code spans
(``tests/test_x.py``, ``tools/bench_*.py``, ``configs/x.yaml``) exists, so a renamed file cannot leave a page
pointing at nothing; and every config key they name (`data.seq_len` in a code span, `distributed.cp_size=2` in a
command) is a key of the job config (or one its loader translates), so a renamed key cannot either. Both checks
are proven on a page with a planted stale path and key. Cost: ~1 s a build; the path and key checks: text only."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import dataclasses
import typing
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


def missing_paths(pages: list[Path]) -> list[str]:
    """``page: path`` for every checkout path the pages name that does not exist."""
    missing = []
    for page in pages:
        for path in sorted(named_paths(page.read_text())):
            if path.endswith("_"):  # cut at a `{a,b}` or `<x>` form: a pattern, not a file
                continue
            if not (list(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
                missing.append(f"{page.name}: {path}")
    return missing


def test_every_file_the_pages_name_exists():
    assert missing_paths([REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]) == []


# a config key the pages name: in a code span (`data.seq_len`, `quantize.linear.float8: {...}`) or as a dotted
# override anywhere (`distributed.cp_size=2` in a command); its first part is a section of the job config
FILE_SUFFIXES = {"py", "json", "jsonl", "yaml", "yml", "md", "txt", "safetensors", "npy", "tar", "sh", "log", "index"}


def config_sections() -> list[str]:
    from headrace.training.config.job_config import JobConfig

    return [f.name for f in dataclasses.fields(JobConfig)]


def named_keys(text: str, sections: list[str]) -> set[str]:
    head = "|".join(map(re.escape, sections))
    in_span = re.findall(rf"`((?:{head})(?:\.\w+|\[\])+)(?=[`=:\s\[])", text)
    overrides = re.findall(rf"(?<![\w./-])((?:{head})(?:\.\w+)+)=", text)
    keys = set()
    for key in (*in_span, *overrides):
        parts = key.replace("[]", "").split(".")
        if any(p[0].isdigit() for p in parts) or parts[-1] in FILE_SUFFIXES:  # a module's name or a file's
            continue
        keys.add(".".join(parts))
    return keys


def accepted_aliases() -> set[str]:
    """Keys the loader accepts and translates (Automodel's, peft's) without a field of their own."""
    from headrace.training.config import automodel_compat, peft

    distributed = [
        *automodel_compat.ACCEPTED_AT_DEFAULT,
        *automodel_compat.MEGATRON_FSDP_KEYS,
        *automodel_compat.SIZE_KEYS,
    ]
    return {f"distributed.{k}" for k in distributed} | {
        f"peft.{k}" for k in (*peft.ACCEPTED_AT_DEFAULT, *peft.HF_NAMES)
    }


def missing_key(key: str) -> str | None:
    """Why ``key`` names no key of the job config (None: it does)."""
    from headrace.training.config.job_config import JobConfig

    node = JobConfig
    for n, part in enumerate(key.split(".")):
        if dataclass_in(node) is None and dict in (
            node,
            typing.get_origin(node),
            *map(typing.get_origin, typing.get_args(node)),
        ):
            return None  # a free-form mapping (model.config: a transformers config): any key
        node = dataclass_in(node)
        if node is None:
            return f"{'.'.join(key.split('.')[:n])} has no keys"
        hints = typing.get_type_hints(node)
        if part not in hints:
            return f"no key {part!r}"
        node = hints[part]
    return None


def dataclass_in(tp):
    """The dataclass a field's type holds (``X | None``, ``list[X]``, ``dict[str, X]``), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if (found := dataclass_in(arg)) is not None:
            return found
    return None


def stale_keys(pages: list[Path]) -> list[str]:
    sections, aliases = config_sections(), accepted_aliases()
    return [
        f"{page.name}: {key} ({why})"
        for page in pages
        for key in sorted(named_keys(page.read_text(), sections))
        if key not in aliases and (why := missing_key(key))
    ]


def test_named_keys_finds_spans_and_overrides():
    text = "`data.seq_len`, `quantize.linear.float8: {}`, run it with distributed.cp_size=2; `model.layers.0.q_proj`, `optim.py`"
    assert named_keys(text, config_sections()) == {"data.seq_len", "quantize.linear.float8", "distributed.cp_size"}


def test_every_config_key_the_pages_name_exists():
    assert stale_keys([REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]) == []


def test_a_planted_stale_path_and_key_fail_the_checks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Train with `data.seq_len` and `trainer.no_such_key`, or data.datasets.nope=1.\n")
    assert stale_keys([page]) == [
        "page.md: data.datasets.nope (no key 'nope')",
        "page.md: trainer.no_such_key (no key 'no_such_key')",
    ]
    page.write_text("The stream: `dataio/stream/rank.py` and `dataio/stream/split.py` (moved to ordering/).\n")
    assert missing_paths([page]) == ["page.md: dataio/stream/split.py"]
