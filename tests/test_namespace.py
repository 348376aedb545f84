"""One import namespace: the top folders installed as headrace.*, beside Hugging Face ``kernels``.

``dataio/``, ``training/``, ``kernels/`` and ``configtree/`` stay at the top of the checkout and are
installed as ``headrace.dataio``, ``headrace.training``, ``headrace.kernels`` and ``headrace.config``
(``package-dir`` in pyproject.toml). Checked here: the mapping lists every package folder; the
installed names work from any directory (imports, ``python -m headrace.training``, the ``dataio``
command); and Hugging Face's ``kernels`` (PyPI), which transformers probes by its import name, installs
beside headrace in one venv: both import, and transformers' probe finds Hugging Face's package with its
own version, whatever ours is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env
from tools.package_dirs import PACKAGE_DIRS

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
FOLDERS = PACKAGE_DIRS  # import name -> folder, as pyproject.toml writes it (the one place)
HF_KERNELS = "kernels==0.17.2"  # Hugging Face's package, a pure-Python wheel plus one abi3 extension


def test_every_package_folder_is_installed_under_headrace():
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert all((REPO / folder).is_dir() for folder in FOLDERS.values())
    folders = set()
    for name, folder in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            folders.add(".".join([name, *rel.parts]))
    assert set(setuptools["packages"]) == folders
    assert PYPROJECT["project"]["scripts"] == {"dataio": "headrace.dataio.cli:main"}


def _run(argv: list, cwd: Path) -> subprocess.CompletedProcess:
    env = child_env(PYTHONPATH=None)  # the install alone, not the checkout, must provide the names
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_installed_names_work_from_any_directory(tmp_path):
    code = (
        "import json, sys, headrace.dataio, headrace.training, headrace.kernels, headrace.config; "
        "print(json.dumps({m: sys.modules[m].__file__ for m in ('headrace.dataio', 'headrace.training', "
        "'headrace.kernels', 'headrace.config')}))"
    )
    proc = _run([sys.executable, "-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = json.loads(proc.stdout)
    assert {m: Path(f) for m, f in files.items()} == {m: REPO / folder / "__init__.py" for m, folder in FOLDERS.items()}
    proc = _run([sys.executable, "-m", "headrace.training", "--help"], tmp_path)
    assert proc.returncode == 0 and "--config" in proc.stdout, proc.stderr[-3000:]
    proc = _run([Path(sys.executable).parent / "dataio", "--help"], tmp_path)
    assert proc.returncode == 0 and "shard" in proc.stdout, proc.stderr[-3000:]


@pytest.fixture(scope="session")
def hf_kernels_venv(request) -> Path:
    """A venv (kept in pytest's cache, made once) that sees this interpreter's packages through a .pth
    line and holds Hugging Face ``kernels`` and an editable headrace of this checkout, both --no-deps."""
    venv = Path(request.config.cache.mkdir("hf-kernels-venv")) / HF_KERNELS.replace("==", "-")
    python = venv / "bin" / "python"
    marker = venv / ".ready"
    if marker.is_file() and marker.read_text() == str(REPO):
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True, timeout=120)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "outer.pth").write_text("".join(p + "\n" for p in ours))
    # --ignore-installed: never touch the outer environment's own headrace (seen through the .pth line)
    pip = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--quiet",
        "--no-deps",
        "--ignore-installed",
    ]
    subprocess.run([*pip, HF_KERNELS], check=True, timeout=300)
    subprocess.run([*pip, "--no-build-isolation", "-e", str(REPO)], check=True, timeout=300, cwd=venv)
    marker.write_text(str(REPO))
    return python


PROBE = """
    import importlib.metadata, importlib.util, json
    import kernels
    import headrace.kernels
    from headrace.kernels.loss import IGNORE_INDEX
    from transformers.utils import import_utils

    print(json.dumps({
        "hf_origin": importlib.util.find_spec("kernels").origin,
        "hf_has_get_kernel": callable(getattr(kernels, "get_kernel", None)),
        "ours_origin": headrace.kernels.__file__,
        "ignore_index": IGNORE_INDEX,
        "hf_version": importlib.metadata.version("kernels"),
        "probe": list(import_utils._is_package_available("kernels", return_version=True)),
        "available": import_utils.is_kernels_available(),
        "min": import_utils.KERNELS_MIN_VERSION, "max": import_utils.KERNELS_MAX_VERSION,
        "distributions": importlib.metadata.packages_distributions().get("kernels", []),
        "headrace_top": importlib.metadata.packages_distributions().get("headrace", []),
    }))
"""


@pytest.mark.slow
def test_hf_kernels_and_headrace_in_one_venv(hf_kernels_venv, tmp_path):
    from packaging.version import Version

    proc = _run([hf_kernels_venv, "-c", textwrap.dedent(PROBE)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    # two packages, each under its own name
    assert Path(r["hf_origin"]).parent.parent.name == "site-packages" and r["hf_has_get_kernel"]
    assert Path(r["ours_origin"]) == REPO / "kernels" / "__init__.py" and r["ignore_index"] == -100
    # transformers' probe sees Hugging Face's distribution and version, never ours
    assert r["distributions"] == ["kernels"] and "headrace" in r["headrace_top"]
    assert r["probe"] == [True, r["hf_version"]] == [True, HF_KERNELS.split("==")[1]]
    assert r["available"] == (Version(r["min"]) <= Version(r["hf_version"]) < Version(r["max"]))
