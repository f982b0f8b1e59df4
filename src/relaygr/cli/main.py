"""Entry point of the ``relaygr`` console script.

Each sub-command lives in its own module exposing ``register(subparsers)``, which adds a parser
whose ``func`` default runs the command and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from relaygr import __version__
from relaygr.errors import RelayGRError

# Sub-command modules, in the order `relaygr --help` lists them.
COMMANDS = ["train", "eval", "retrieval", "bench", "serve", "profile", "demo", "config"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relaygr",
        description="Relay-race inference for long-sequence generative recommendation ranking.")
    parser.add_argument("--version", action="version", version=f"relaygr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"relaygr.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except RelayGRError as exc:
        print(f"relaygr {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl-C: the command's clean-up (finally blocks) has run
        print(f"relaygr {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
