"""Packaging: pyproject contract, cheap imports, the `dataio` CLI entry, and coexistence with transformers.

Our top-level package ``kernels`` has the import name of a Hugging Face package that transformers
probes (``is_kernels_available``: ``find_spec("kernels")``, then the version from distribution
metadata, else it imports the module). These tests run that probe the way users hit it: from a
source checkout (repo on sys.path, no metadata) and installed (a ``headrace`` dist-info that maps the
top-level name ``kernels`` to our distribution).
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

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _python(code: str, extra_path: list[Path] = (), timeout: float = 120) -> dict:
    """Run ``code`` in a fresh interpreter with the repo on sys.path; return the JSON it prints last."""
    path = [*map(str, extra_path), str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in path if p))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fake_installed_metadata(root: Path) -> Path:
    """A dist-info as an install of this checkout leaves it, so packages_distributions() sees us."""
    version = PYPROJECT["project"]["version"]
    dist = root / f"headrace-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: headrace\nVersion: {version}\n")
    (dist / "top_level.txt").write_text("dataio\nkernels\ntraining\n")
    return root


TRANSFORMERS_PROBE = """
    import importlib.metadata, importlib.util, json
    spec = importlib.util.find_spec("kernels")
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import import_utils

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = [p.grad for p in model.parameters()]
    print(json.dumps({
        "kernels_origin": spec.origin,
        "kernels_available": import_utils.is_kernels_available(),
        "kernels_probe": list(import_utils._is_package_available("kernels", return_version=True)),
        "distributions": importlib.metadata.packages_distributions().get("kernels", []),
        "loss": out.loss.item(),
        "all_grads": all(g is not None and bool(torch.isfinite(g).all()) for g in grads),
        "logits_shape": list(out.logits.shape),
    }))
"""


@pytest.mark.parametrize("layout", ["source-checkout", "installed"])
def test_transformers_works_beside_our_kernels_package(layout, tmp_path):
    extra = [_fake_installed_metadata(tmp_path)] if layout == "installed" else []
    result = _python(TRANSFORMERS_PROBE, extra)
    # The name resolves to our package, and transformers does not mistake it for HF `kernels`.
    assert Path(result["kernels_origin"]) == REPO / "kernels" / "__init__.py"
    assert result["kernels_available"] is False
    if layout == "installed":
        assert set(result["distributions"]) == {"headrace"}
        assert result["kernels_probe"] == [True, PYPROJECT["project"]["version"]]
    # A transformers model still trains: forward, loss, finite gradients everywhere.
    assert result["logits_shape"] == [2, 16, 128]
    assert 3.0 < result["loss"] < 6.0  # ~ln(128) = 4.85 at init
    assert result["all_grads"] is True


def test_our_version_stays_below_the_hf_kernels_range():
    """Installed, transformers reads `kernels`' version from our distribution: keep it out of the
    range it accepts for Hugging Face `kernels`, or `import transformers` users get our package."""
    from packaging.version import Version
    from transformers.utils import import_utils

    assert Version(PYPROJECT["project"]["version"]) < Version(import_utils.KERNELS_MIN_VERSION)


def test_imports_are_cheap():
    """`import kernels` / `import dataio` and building the CLI parser must not pull torch in."""
    result = _python("""
        import json, sys
        import kernels, dataio, dataio.cli
        after_import = sorted(m for m in ("torch", "transformers", "training") if m in sys.modules)
        dataio.cli.build_parser()
        after_parser = sorted(m for m in ("torch", "transformers", "training") if m in sys.modules)
        print(json.dumps({"import": after_import, "parser": after_parser,
                          "kernels_has_version": hasattr(kernels, "__version__")}))
    """)
    assert result == {"import": [], "parser": [], "kernels_has_version": False}


def test_dataio_help_lists_every_subcommand():
    from dataio.cli import COMMANDS

    proc = subprocess.run([sys.executable, "-m", "dataio", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    assert set(COMMANDS) == {"shard", "index", "inspect", "verify", "bench"}
    for name in COMMANDS:
        assert name in proc.stdout


@pytest.mark.parametrize("command", ["shard", "index", "inspect", "verify", "bench"])
def test_each_subcommand_has_help(command, capsys):
    from dataio.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: dataio {command}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["shard", "index", "inspect", "verify", "bench"])
def test_help_shows_each_default_once_and_never_none(command, capsys):
    from dataio.cli import main

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
    assert project["scripts"] == {"dataio": "dataio.cli:main"}
    extras = project["optional-dependencies"]
    assert any(r.startswith("nvidia-dali-cuda130") for r in extras["dali"])
    assert any(r.startswith("s3fs") for r in extras["s3"])
    assert {r.split(">")[0].split("=")[0] for r in extras["dev"]} >= {"pytest", "hypothesis", "pytest-timeout"}
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]) >= {"dataio*", "training*",
                                                                                     "kernels*"}
    from dataio.cli import main

    assert callable(main)


def test_readme_commands_match_the_scripts_and_ci():
    readme = (REPO / "README.md").read_text()
    setup = readme[readme.index("## Set-up"):]
    block = setup[setup.index("```bash"):setup.index("```", setup.index("```bash") + 3)]
    commands = [line.split("#")[0].strip() for line in block.splitlines()[1:] if line.strip()]
    assert commands == ["bash tools/demo.sh", "bash tools/test.sh"]
    ci = [line.strip() for line in (REPO / ".ci/run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci == ["bash tools/test.sh"]
    for script in ("tools/demo.sh", "tools/test.sh", "tools/setup.sh", ".ci/run", "tools/update_lock.sh",
                   "tools/gpu_check.sh", "tools/torch_floor.sh", "tools/transformers_floor.sh"):
        assert subprocess.run(["bash", "-n", str(REPO / script)]).returncode == 0, script
        assert os.access(REPO / script, os.X_OK), f"{script} is not executable"
