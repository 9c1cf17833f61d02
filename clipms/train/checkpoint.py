"""Training checkpoints: atomic writes off the training thread, keep-the-last-K rotation, reading
the newest good one, and setting aside (never deleting) the checkpoints of another configuration.

A checkpoint is one MindSpore `.ckpt` file holding named tensors (model weights under their names
relative to the CLIP Cell, optimizer moments as `adam_m.<name>` / `adam_v.<name>`, loss-scale
state) plus one JSON string `clipms_meta` (step, epoch, AdamW step, the resolved config, its
fingerprint and the metric history). Files are `step-00000120.ckpt`; a write goes to a hidden temp
file in the same folder (`clipms.utils.atomic`), is fsync'ed and renamed, so a kill at any moment
leaves either the old set of checkpoints or the old set plus one complete new file, never a
truncated one.

`CheckpointWriter` does that write on a background thread: the training loop pays only for copying
the state to host memory, then goes on with the next steps while the file is written. MindSpore's
own `save_checkpoint(async_save=True)` is not used: it deletes an existing file of the same name
before writing, does not fsync, and an error in its thread never reaches the caller.

Checkpoints whose fingerprint does not match the run about to start are moved, not deleted, into
`<folder>/stale-<their fingerprint>/` (`set_aside`); the newest `KEEP_STALE_SETS` such folders are
kept. To resume one of them, move its files back into `<folder>`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clipms.utils.atomic import atomic_write, dead_writers_temps, fsync

log = logging.getLogger(__name__)

META_KEY = "clipms_meta"
STALE_PREFIX = "stale-"
KEEP_STALE_SETS = 3  # folders of set-aside checkpoints kept; older ones are removed
_NAME = re.compile(r"^step-(\d{8})\.ckpt$")
_SAFE_LABEL = re.compile(r"^[0-9A-Za-z_]{1,64}$")  # what a fingerprint looks like


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed; the previous checkpoints are untouched."""


@dataclass
class Checkpoint:
    path: Path
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any]


def checkpoint_path(folder: Path, step: int) -> Path:
    return Path(folder) / f"step-{step:08d}.ckpt"


def list_checkpoints(folder: Path | str) -> list[Path]:
    """Complete checkpoints in `folder`, oldest step first (temp files are ignored)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def save(folder: Path | str, step: int, tensors: Mapping[str, Any], meta: dict[str, Any],
         keep: int | None = None) -> Path:
    """Write `tensors` (name -> MindSpore Tensor/Parameter or array) and `meta` atomically as the
    checkpoint of `step`, then delete all but the newest `keep` checkpoints."""
    import mindspore as ms

    final = checkpoint_path(Path(folder), step)
    items = [{"name": name, "data": _as_tensor(value)} for name, value in tensors.items()]
    with atomic_write(final, durable=True) as tmp:
        ms.save_checkpoint(items, str(tmp), append_dict={META_KEY: json.dumps(meta)})
    if keep is not None:
        prune(folder, keep)
    return final


class CheckpointWriter:
    """Saves checkpoints on a background thread, one at a time, with `save`'s guarantees.

    `submit` copies the tensors to host memory before it returns (the caller may change them
    right after) and waits for the previous write first, so at most one extra copy of the state
    is in memory. A failed write is raised, as `CheckpointWriteError`, by the next `submit` or by
    `close`, never lost. Use as a context manager, or call `close()` when training ends.
    """

    def __init__(self, folder: Path | str, keep: int | None = None) -> None:
        self.folder, self.keep = Path(folder), keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: Path | None = None

    def submit(self, step: int, tensors: Mapping[str, Any], meta: dict[str, Any]) -> Path:
        """Start writing the checkpoint of `step`; returns its final path (written later)."""
        self.wait()
        arrays = {name: _host_copy(value) for name, value in tensors.items()}
        meta = json.loads(json.dumps(meta))  # a snapshot: the caller keeps appending history
        self._pending = checkpoint_path(self.folder, step)
        self._thread = threading.Thread(target=self._write, args=(step, arrays, meta),
                                        name=f"clipms-checkpoint-{step}", daemon=False)
        self._thread.start()
        return self._pending

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; raise if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointWriteError(f"writing {self._pending} failed: {error}") from error

    close = wait

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.wait()
            return
        try:  # the loop already failed: finish the write, but report the loop's error
            self.wait()
        except CheckpointWriteError as err:
            log.error("%s", err)

    def _write(self, step: int, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        try:
            save(self.folder, step, arrays, meta, keep=self.keep)
            log.info("saved %s", self._pending)
        except BaseException as err:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = err


def prune(folder: Path | str, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (and stale temp files of dead writers)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    for tmp in dead_writers_temps(folder):
        tmp.unlink(missing_ok=True)


def load(path: Path | str) -> Checkpoint:
    """Read one checkpoint: its tensors as numpy arrays and its meta dict."""
    import mindspore as ms

    raw = ms.load_checkpoint(str(path))
    meta_text = raw.pop(META_KEY, None)
    if not isinstance(meta_text, str):
        raise ValueError(f"{path}: not a clipms training checkpoint (no '{META_KEY}' entry)")
    tensors = {name: value.asnumpy() for name, value in raw.items()}
    return Checkpoint(Path(path), tensors, json.loads(meta_text))


def load_latest(folder: Path | str) -> Checkpoint | None:
    """The newest checkpoint in `folder` that reads back, or None when there is none."""
    for path in reversed(list_checkpoints(folder)):
        try:
            return load(path)
        except Exception as err:  # noqa: BLE001 - an unreadable file must not stop a resume
            log.warning("skipping unreadable checkpoint %s: %s", path, err)
    return None


def set_aside(folder: Path | str, fingerprint: str | None,
              keep_sets: int = KEEP_STALE_SETS) -> Path | None:
    """Move every checkpoint in `folder` into `folder/stale-<fingerprint>/` (renames, nothing is
    copied or deleted); then remove all but the newest `keep_sets` stale folders.

    `fingerprint` is the one the checkpoints were written with (None or a malformed one, e.g. when
    none reads back: `unknown`). A folder of that name that already exists gets a `-2`, `-3`...
    sibling instead, so no file is ever overwritten. Returns the new folder, or None when there
    was nothing to move.
    """
    folder = Path(folder)
    paths = list_checkpoints(folder)
    if not paths:
        return None
    label = fingerprint if fingerprint and _SAFE_LABEL.match(fingerprint) else "unknown"
    target, n = folder / f"{STALE_PREFIX}{label}", 1
    while target.exists():
        n += 1
        target = folder / f"{STALE_PREFIX}{label}-{n}"
    target.mkdir()
    for path in paths:
        os.replace(path, target / path.name)
    fsync(target)
    fsync(folder)
    for old in stale_sets(folder)[keep_sets:]:
        shutil.rmtree(old)
        log.info("removed %s (only the newest %d stale checkpoint sets are kept)", old, keep_sets)
    return target


def stale_sets(folder: Path | str) -> list[Path]:
    """Folders of set-aside checkpoints, newest first (by when they were set aside)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(STALE_PREFIX)]
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)


def _host_copy(value: Any) -> np.ndarray:
    """This instant's values in host memory (a device tensor is copied out; arrays are copied)."""
    import mindspore as ms

    if isinstance(value, ms.Tensor):  # Parameters are Tensors
        return value.asnumpy().copy()
    return np.array(value, copy=True)


def _as_tensor(value: Any) -> Any:
    import mindspore as ms

    if isinstance(value, ms.Tensor):  # Parameters are Tensors
        return ms.Tensor(value.asnumpy())  # a copy, so the file holds this instant's values
    return ms.Tensor(np.asarray(value))
