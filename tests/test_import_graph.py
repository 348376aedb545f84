"""The import graph under the installed names (``headrace.*``): no circle, no import from a lower layer to a higher
one, the layers stated once (``tools/import_layers.py``). Both rules are proven able to fail by planting a circle
and an upward import in a copy of the tree. Pure ``ast`` parsing: no module is imported, no subprocess."""

from __future__ import annotations

import shutil

from tests.helpers import REPO
from tools.import_layers import LAYERS, circles, import_graph, modules, upward_imports
from tools.package_dirs import PACKAGE_DIRS


def test_no_circle_and_no_import_from_a_lower_layer_to_a_higher_one():
    graph = import_graph()
    assert circles(graph) == []
    assert upward_imports(graph) == []


def test_every_layer_names_modules_that_exist():
    known = modules()
    stale = [p for _, prefixes in LAYERS for p in prefixes if not any(m == p or m.startswith(p + ".") for m in known)]
    assert stale == []


def copy_of_the_tree(tmp_path):
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def append(path, text):
    path.write_text(path.read_text() + "\n" + text + "\n")


def test_a_planted_circle_and_a_planted_upward_import_fail_the_check(tmp_path):
    repo = copy_of_the_tree(tmp_path)
    ordering = repo / "dataio/stream/ordering"
    # a circle inside one layer (no arrow up): split <-> blend
    append(ordering / "split.py", "from headrace.dataio.stream.ordering import blend  # noqa")
    append(ordering / "blend.py", "import headrace.dataio.stream.ordering.split  # noqa")
    # an arrow up, deferred into a function (still a dependency): the shard format importing the loader
    append(repo / "dataio/shards/formats.py", "def planted():\n    from headrace.dataio.loader import build_loader")
    # annotations only: not an import at run time, so neither rule counts it
    append(
        repo / "dataio/sizes.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import headrace.training.train",
    )
    graph = import_graph(repo)
    found = circles(graph)
    assert ["headrace.dataio.stream.ordering.blend", "headrace.dataio.stream.ordering.split"] in found
    upward = upward_imports(graph)
    assert "headrace.dataio.shards.formats (shard format) -> headrace.dataio.loader (loader and feed)" in upward
    assert not any(line.startswith("headrace.dataio.sizes ") for line in upward)
    # the formats -> loader arrow also closes a circle through the loader's imports of the shard format
    assert any("headrace.dataio.shards.formats" in c and "headrace.dataio.loader" in c for c in found)
