"""The one way the project writes a file: to a temp file beside it, then renamed over it.

A reader (or a `dvc repro` after a kill) therefore sees the old file or the new one, never half a
file. Every writer -- JSON, parquet, CSV, checkpoints -- goes through `atomic_write`, so there is
one temp-naming scheme: `.<name>.tmp-<pid>-<random><suffix>` in the target's folder. The pid lets
a later process tell a dead writer's leftovers (`dead_writers_temps`) from a live writer's file;
the suffix is the target's own, because some writers (MindSpore's `save_checkpoint`) insist on it.
A writer killed mid-write (SIGKILL runs no cleanup) leaves its temp file; the next write of the
same target removes it, so a rerun after a kill leaves nothing behind.
"""

from __future__ import annotations

import glob
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_TMP_MARK = ".tmp-"


@contextmanager
def atomic_write(path: Path | str, durable: bool = False) -> Iterator[Path]:
    """Yield a temp path to write in place of `path`; rename it onto `path` when the block ends.

    If the block raises, the temp file is removed and `path` is untouched. `durable` fsyncs the
    file before the rename and the folder after it, so the new file also survives a power cut
    (checkpoints); without it a crash of the machine may lose the write but never tears it.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{glob.escape(target.name)}{_TMP_MARK}*"):
        if _dead_writers(stale):  # this target's temp of a killed writer
            stale.unlink(missing_ok=True)
    tmp = target.with_name(
        f".{target.name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}{target.suffix}")
    try:
        yield tmp
        if durable:
            fsync(tmp)
        os.replace(tmp, target)
        if durable:
            fsync(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_create(path: Path | str) -> Iterator[tuple[Path, list[bool]]]:
    """Yield (temp path, [created]) to build a new file that may not exist yet: when the block
    ends, the temp file becomes `path` only if no other process made `path` meanwhile (a hard
    link, which fails when the name is taken; `os.replace` would overwrite what another process
    may already be using), and `created[0]` says whether it did. The temp file goes either way;
    a killed writer's is removed by the next attempt, as `atomic_write`'s."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{glob.escape(target.name)}{_TMP_MARK}*"):
        if _dead_writers(stale):
            stale.unlink(missing_ok=True)
    tmp = target.with_name(
        f".{target.name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}{target.suffix}")
    created = [False]
    try:
        yield tmp, created
        try:
            os.link(tmp, target)
            created[0] = True
        except FileExistsError:  # another process made it first: theirs stands
            pass
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path | str, text: str, durable: bool = False) -> None:
    with atomic_write(path, durable) as tmp:
        tmp.write_text(text)


def write_bytes(path: Path | str, data: bytes, durable: bool = False) -> None:
    with atomic_write(path, durable) as tmp:
        tmp.write_bytes(data)


def fsync(path: Path | str) -> None:
    """Flush a file's data, or a folder's entries (so a rename survives a crash), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dead_writers_temps(folder: Path | str) -> list[Path]:
    """Temp files in `folder` left by `atomic_write` in processes that no longer run."""
    return [tmp for tmp in Path(folder).glob(f".*{_TMP_MARK}*") if _dead_writers(tmp)]


def _dead_writers(tmp: Path) -> bool:
    """Whether temp file `tmp` was written by a process that no longer runs."""
    pid = tmp.name.rsplit(_TMP_MARK, 1)[1].split("-", 1)[0]
    return pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
