"""MkDocs hook: the site's copy of BENCHMARKS.md, the one file of figures, which lives at the repository root.

Pages in docs/ link to it as ``../BENCHMARKS.md#section`` (a link that works on GitHub); the site has no file
outside docs/, so this hook adds BENCHMARKS.md to the site as a generated page and points those links at it.
Its own links (``docs/x.png``) are rewritten to be relative to docs/. Anchors are checked by the strict build
(mkdocs.yml ``validation``), so a link to a section that was renamed fails the docs test. Cost: one file read.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
NAME = "BENCHMARKS.md"


def on_files(files, config):
    text = (ROOT / NAME).read_text(encoding="utf-8")
    files.append(File.generated(config, NAME, content=re.sub(r"\]\(docs/", "](", text)))
    return files


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(f"](../{NAME}", f"]({NAME}")
