"""The speech recipe's inputs, checked before any stage runs (``tools/speech_recipe.py``'s ``main`` calls
``check_inputs`` first): every refusal is one line, exit 2, and nothing is written before it.

- ``--manifest`` (and ``--text``): a regular file (relative paths are the user's: the wrapper runs in their folder);
  every non-blank line a JSON object; a manifest line has a string ``audio_filepath`` and a string ``text``, a
  text line a string ``text``; the line number is named. The key-hash split must leave both a train and a val
  utterance.
- ``--out``: a folder, or a path to make one at, that is not an input; ``shards/`` in it, left by an earlier run
  (which the recipe reuses), must hold complete datasets of the sizes these inputs give, else it is named.
- ``--minutes``: a finite number > 0; ``--max-steps`` / ``--eval-every`` >= 1 when given.

Cost: one read of the manifest and the text file (the recipe reads them again to write its splits).
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class RecipeInputError(Exception):
    """An input the recipe refuses: printed as one ``error:`` line, exit status 2."""


def json_lines(path: Path, what: str, fields: tuple[str, ...]) -> list[dict]:
    """The JSON objects of ``path``'s non-blank lines, each holding a string at every one of ``fields``."""
    if not path.exists():
        raise RecipeInputError(f"{what} {path}: does not exist")
    if not path.is_file():
        raise RecipeInputError(f"{what} {path}: not a file (a {'folder' if path.is_dir() else 'special file'})")
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeInputError(f"{what} {path}: cannot be read as UTF-8 text ({e})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise RecipeInputError(f"{what} {path}: line {number} is not JSON ({' '.join(str(e).split())[:120]})")
        if not isinstance(row, dict):
            raise RecipeInputError(f"{what} {path}: line {number} is a JSON {type(row).__name__}, not an object")
        for field in fields:
            if not isinstance(row.get(field), str):
                raise RecipeInputError(f"{what} {path}: line {number} has no string {field!r}")
        rows.append(row)
    if not rows:
        raise RecipeInputError(f"{what} {path}: holds no lines")
    return rows


def check_out(out: Path, inputs: list[Path], counts: dict[str, int]) -> None:
    """``--out`` is a folder (or absent), not an input, and its ``shards/`` (an earlier run's) holds the datasets
    ``counts`` says these inputs give (``{split: samples}``)."""
    from headrace.dataio.outpath import refuse_input
    from headrace.dataio.shards.index import load_index
    from headrace.dataio.usererror import CommandError

    try:
        refuse_input(out, inputs, "--out")
    except CommandError as e:
        raise RecipeInputError(str(e)) from None
    if out.exists() and not out.is_dir():
        raise RecipeInputError(f"--out {out}: not a folder")
    shards = out / "shards"
    if not shards.exists():
        return
    for name, expected in counts.items():
        folder = shards / name
        if not folder.exists():
            continue  # made by this run
        try:
            found = len(load_index(folder))
        except (OSError, ValueError) as e:
            raise RecipeInputError(
                f"--out {out}: {folder} is not a complete dataset ({str(e).splitlines()[0][:160]}); "
                "remove it (a run cut short?) and start again"
            ) from None
        if found != expected:
            raise RecipeInputError(
                f"--out {out}: {folder} holds {found} samples, these inputs give {expected}: made from other "
                "inputs; use another --out or remove its shards/"
            )


def check_inputs(args, is_val, val_percent: int) -> None:
    """``RecipeInputError`` for the first input the recipe cannot use (module docstring). ``is_val``: the recipe's
    held-out rule on an ``audio_filepath``."""
    if not (math.isfinite(args.minutes) and args.minutes > 0):
        raise RecipeInputError(f"--minutes {args.minutes}: must be a finite number of minutes > 0")
    for flag, value in (("--max-steps", args.max_steps), ("--eval-every", args.eval_every)):
        if value is not None and value < 1:
            raise RecipeInputError(f"{flag} {value}: must be >= 1")
    manifest = json_lines(args.manifest, "--manifest", ("audio_filepath", "text"))
    docs = json_lines(args.text, "--text", ("text",)) if args.text is not None else []
    val = sum(is_val(row["audio_filepath"]) for row in manifest)
    if val == 0 or val == len(manifest):
        raise RecipeInputError(
            f"--manifest {args.manifest}: {len(manifest) - val} train / {val} val utterances by the key-hash "
            f"split ({val_percent}% val): the recipe needs both"
        )
    counts = {"train": len(manifest) - val, "val": val, "text": len(manifest) - val + len(docs)}
    check_out(args.out, [p for p in (args.manifest, args.text) if p is not None], counts)


__all__ = ["RecipeInputError", "check_inputs", "check_out", "json_lines"]
