"""`hetrain` command line. Each area owns its subcommands in its own `cli` module
(a `register(subparsers)` function), so this file only lists them."""
from __future__ import annotations

import argparse
import importlib
import signal
import sys

from hetrain.errors import UserError

# module path -> owns these subcommands
_AREAS = (
    "hetrain.runtime.cli",   # launch, demo, netns
    "hetrain.plan.cli",      # plan
    "hetrain.sched.cli",     # schedule
    "hetrain.pipeline.cli",  # train --plan
    "hetrain.train.cli",     # report
)


class _Parser(argparse.ArgumentParser):
    """Flag mistakes in one line (argparse's default prints the whole usage first);
    sub-command parsers inherit this class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def one_line(err: BaseException) -> str:
    """A message on one line: a file with several bad fields lists them joined by '; '."""
    parts = [line.strip().removeprefix("- ").strip() for line in str(err).splitlines()]
    text = ""
    for p in filter(None, parts):
        text += p if not text else (" " if text.endswith(":") else "; ") + p
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hetrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for path in _AREAS:
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as err:
            if err.name and path.startswith(err.name):  # area not built yet in this checkout
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from hetrain.runtime import catch_stop_requests

    catch_stop_requests()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("hetrain: interrupted", file=sys.stderr)
        return 130
    except UserError as err:  # user mistakes: a message, no traceback
        print(f"hetrain: error: {one_line(err)}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.filename is None:  # not about a path the user gave
            raise
        # a path from the command line that cannot be read or written (no such folder, no permission)
        print(f"hetrain: error: cannot use {err.filename}: {err.strerror or err}", file=sys.stderr)
        return 2
    finally:
        # the work is over: a stop request now has nothing to stop, and Python's shutdown
        # would restore SIGUSR1's default action (terminate) while atexit hooks still run
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
