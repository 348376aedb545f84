"""The ``dataio`` command: one entry point, one subcommand per tool module.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs, so ``dataio --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from headrace.dataio.usererror import (
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    CommandError,
    debug_requested,
    is_user_error,
    one_line,
)

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "shard": ("headrace.dataio.commands.shard", "turn corpora into indexed WebDataset shards"),
    "index": ("headrace.dataio.commands.index", "write .nv-meta index/metadata for tar shards written elsewhere"),
    "inspect": ("headrace.dataio.commands.inspect", "summarise a shard directory"),
    "get": ("headrace.dataio.commands.get", "read one sample by key (O(log n) from the mapped index)"),
    "verify": ("headrace.dataio.commands.verify", "re-read every shard and check index, counts and members"),
    "bench": ("headrace.dataio.commands.bench", "loader throughput benchmark against peer loaders"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` only where it says something: not for unset (None/False) defaults,
    and not where the help text already describes its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dataio", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of input errors too (also: HEADRACE_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        p.set_defaults(_module=module)
        # Argument definitions are cheap to import; the heavy work is imported inside run().
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(importlib.import_module(args._module).run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at interpreter exit
        return code
    except BrokenPipeError:  # `dataio inspect DIR --json | head`: the reader left; that is not an error
        _silence_stdout()
        return 0
    except KeyboardInterrupt:  # Ctrl-C: what was written is resumed or redone by the next run
        print(f"dataio {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # input errors: one line (headrace.dataio.usererror); bugs: the traceback
        if not is_user_error(e) or debug_requested(args.debug):
            raise
        print(f"dataio {args.command}: error: {one_line(e)}", file=sys.stderr)
        return e.exit_code if isinstance(e, CommandError) else EXIT_USER_ERROR


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of what the closed pipe refused
    raises nothing more (the recipe of Python's signal documentation, "Note on SIGPIPE")."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
