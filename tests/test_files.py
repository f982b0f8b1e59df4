"""relaygr.files.write_atomic: the target is replaced whole, durably, or left as it was."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from relaygr import files
from relaygr.files import write_atomic


def test_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    target = tmp_path / "run" / "config.json"          # the directory is made on the way
    write_atomic(target, lambda tmp: tmp.write_text("old"))
    write_atomic(target, lambda tmp: tmp.write_text("new"))
    assert target.read_text() == "new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["config.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_partial_copy(tmp_path: Path) -> None:
    target = tmp_path / "state.safetensors"
    target.write_text("whole")

    def half(tmp: Path) -> None:
        tmp.write_text("ha")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, half)
    assert target.read_text() == "whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.safetensors"]


def test_the_data_is_synced_before_the_rename_and_the_directory_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync " + ("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
        real_fsync(fd)

    def replace(src: Path, dst: Path) -> None:
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr(files.os, "replace", replace)
    write_atomic(tmp_path / "progress.json", lambda tmp: tmp.write_text("{}"))
    expected = ["fsync file", "rename"] + (["fsync dir"] if os.name == "posix" else [])
    assert events == expected


def test_a_failed_rename_removes_the_copy_too(tmp_path: Path) -> None:
    target = tmp_path / "run.json"
    target.mkdir()                                      # a directory: the rename over it fails
    with pytest.raises(OSError):
        write_atomic(target, lambda tmp: tmp.write_text("{}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_two_writers_of_one_path_never_share_a_temporary_file(tmp_path: Path) -> None:
    """Each call writes its own temporary file: a second writer starting while the first is
    mid-write (two processes saving one record) cannot truncate or interleave with it."""
    target = tmp_path / "record.json"
    seen: list[Path] = []

    def outer(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_text("first, part")
        write_atomic(target, inner)               # another writer, meanwhile
        with tmp.open("a") as f:
            f.write(" two")

    def inner(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_text("second")

    write_atomic(target, outer)
    assert seen[0] != seen[1]
    assert target.read_text() == "first, part two"     # the last rename, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
