"""Packaging: pyproject contract, cheap imports, the `dataio` CLI entry.

Coexistence with Hugging Face ``kernels`` and the ``headrace.*`` names: tests/test_namespace.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from tests.helpers import child_env

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _python(code: str, extra_path: list[Path] = (), timeout: float = 120) -> dict:
    """Run ``code`` in a fresh interpreter with the repo on sys.path; return the JSON it prints last."""
    path = [*map(str, extra_path), str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in path if p))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_imports_are_cheap():
    """`import headrace.kernels` / `import headrace.dataio` and building the CLI parser must not pull torch in."""
    result = _python("""
        import json, sys
        import headrace.kernels, headrace.dataio, headrace.dataio.cli
        after_import = sorted(m for m in ("torch", "transformers", "headrace.training") if m in sys.modules)
        headrace.dataio.cli.build_parser()
        after_parser = sorted(m for m in ("torch", "transformers", "headrace.training") if m in sys.modules)
        print(json.dumps({"import": after_import, "parser": after_parser,
                          "kernels_has_version": hasattr(headrace.kernels, "__version__")}))
    """)
    assert result == {"import": [], "parser": [], "kernels_has_version": False}


def test_dataio_help_lists_every_subcommand():
    from headrace.dataio.cli import COMMANDS

    proc = subprocess.run(
        [sys.executable, "-m", "headrace.dataio", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert set(COMMANDS) == {"shard", "index", "inspect", "get", "verify", "bench"}
    for name in COMMANDS:
        assert name in proc.stdout


@pytest.mark.parametrize("command", ["shard", "index", "inspect", "get", "verify", "bench"])
def test_each_subcommand_has_help(command, capsys):
    from headrace.dataio.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: dataio {command}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["shard", "index", "inspect", "get", "verify", "bench"])
def test_help_shows_each_default_once_and_never_none(command, capsys):
    from headrace.dataio.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert "(default: None)" not in text and "(default: False)" not in text
    for option in text.split(" --")[1:]:
        assert option.count("default") <= 1, option
    if command == "shard":  # a real default is still shown, 0 included
        assert "fail beyond N (default: 0)" in text and "(default: auto)" in text


def test_pyproject_declares_ranges_entry_points_and_extras():
    project = PYPROJECT["project"]
    assert project["name"] == "headrace"
    assert project["requires-python"] == ">=3.11"
    assert "torch>=2.11,<2.14" in project["dependencies"]  # a range: installable beside the GPU images' torch
    assert not any("==" in r for r in project["dependencies"]), "exact versions belong in constraints.txt"
    assert project["scripts"] == {"dataio": "headrace.dataio.cli:main"}
    extras = project["optional-dependencies"]
    assert any(r.startswith("nvidia-dali-cuda130") for r in extras["dali"])
    assert any(r.startswith("s3fs") for r in extras["s3"])
    assert {r.split(">")[0].split("=")[0] for r in extras["dev"]} >= {"pytest", "hypothesis", "pytest-timeout"}
    from headrace.dataio.cli import main

    assert callable(main)


def test_readme_commands_match_the_scripts_and_ci():
    readme = (REPO / "README.md").read_text()
    setup = readme[readme.index("## Set-up") :]
    block = setup[setup.index("```bash") : setup.index("```", setup.index("```bash") + 3)]
    commands = [line.split("#")[0].strip() for line in block.splitlines()[1:] if line.strip()]
    assert commands == ["bash tools/demo.sh", "bash tools/test.sh"]
    ci = [
        line.strip()
        for line in (REPO / ".ci/run").read_text().splitlines()
        if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))
    ]
    assert ci == ["bash tools/test.sh"]
    for script in (
        "tools/demo.sh",
        "tools/test.sh",
        "tools/setup.sh",
        ".ci/run",
        "tools/update_lock.sh",
        "tools/gpu_check.sh",
        "tools/torch_floor.sh",
        "tools/transformers_floor.sh",
    ):
        assert subprocess.run(["bash", "-n", str(REPO / script)]).returncode == 0, script
        assert os.access(REPO / script, os.X_OK), f"{script} is not executable"
