"""Writing a file so that a crash leaves either the old version or the new one, whole.

A run directory is read back by ``--resume``, ``eval`` and ``serve``; a checkpoint half written
when the machine lost power, or renamed into place before its bytes reached the disk (a rename
can be made durable before the data it names), would be read as a corrupt run. So a file is
written beside its target, flushed to the disk, renamed over it, and the rename itself flushed
by syncing the directory.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Replace ``path`` by what ``write(tmp)`` writes to a temporary file beside it, durably:
    a reader sees the old file or the new one, never a part of either. The temporary file's
    name is this call's own, so two writers of one path (two processes saving the same
    record) never write into each other's: the last rename wins, whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)     # the old file stays as it was, and nothing beside it
        raise
    if os.name == "posix":              # a directory can be opened and synced on POSIX only
        _fsync(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
