"""``relaygr config show COMMAND [ARGS ...]``: the configuration COMMAND would run with.

A command's configuration comes from the defaults of its config dataclasses, a preset where it
has one, and its flags. ``config show`` parses ARGS with COMMAND's own parser, builds that
configuration the way the command does, without running it (no model, data or network), and
prints it as JSON: ``{"command": ..., "config": {...}}``. A command whose configuration is its
flags alone (``eval``, ``profile``, ``demo``, ``eval-retrieval``) shows its parsed flags.

    relaygr config show train --preset paper --set max_epochs=50
    relaygr config show serve --checkpoint runs/ml1m --instances 2
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relaygr.errors import ConfigError


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (``--threads 0`` is refused, not ignored)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0 (a seed; numpy refuses negative ones far later)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (``--slo-ms 0`` or ``inf`` is refused, not
    replaced by a default or accepted as a bound nothing exceeds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value}")
    return value


def device_name(text: str) -> str:
    """An argparse type: a torch device this machine has (``cpu``, ``cuda``, ``cuda:1``, ...),
    refused at parse time rather than when the first tensor moves."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} ({exc})") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text}: this machine has no CUDA device")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA "
                                             f"device(s)")
    elif device.type not in ("cpu", "mps", "xpu"):
        raise argparse.ArgumentTypeError(f"{text}: relaygr runs on cpu or cuda")
    return text


def check_output_file(path: Path | None, flag: str = "--json") -> None:
    """``ConfigError`` now, before any work, where ``path`` could not be written at the end
    (a directory, or a parent that is not a writable directory); the parent is made."""
    if path is None:
        return
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; name a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot make its directory ({exc})") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path} is not writable")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="show the configuration a command would run with",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    show = verbs.add_parser("show", help="print COMMAND's effective configuration as JSON")
    show.add_argument("target", metavar="COMMAND", help="the command, e.g. train or serve")
    show.add_argument("target_args", nargs=argparse.REMAINDER, metavar="ARGS",
                      help="COMMAND's arguments, as you would pass them")
    # the other commands' parsers, read when the command runs (all are registered by then)
    show.set_defaults(func=lambda args: run(args, sub.choices))


def run(args: argparse.Namespace, parsers: Mapping[str, argparse.ArgumentParser]) -> int:
    target = args.target
    if target not in parsers or target == "config":
        raise ConfigError(f"unknown command {target!r}; choose one of "
                          f"{sorted(n for n in parsers if n != 'config')}")
    parsed = parsers[target].parse_args(args.target_args)
    effective = getattr(parsed, "effective_config", None)
    if effective is not None:
        config = effective(parsed)
    else:
        config = as_plain({k: v for k, v in vars(parsed).items() if not callable(v)})
    print(json.dumps({"command": target, "config": config}, indent=2, default=_plain))
    return 0


def as_plain(value: Any) -> Any:
    """A config dataclass (nested ones too) as JSON-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): as_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)                      # "inf" (no limit): JSON has no infinity
    return _plain(value) if isinstance(value, (Path, enum.Enum)) else value


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else str(value)
