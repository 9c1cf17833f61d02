"""Training checkpoints: atomic writes, keep-the-last-K rotation, and reading the newest good one.

A checkpoint is one MindSpore `.ckpt` file holding named tensors (model weights under their names
relative to the CLIP Cell, optimizer moments as `adam_m.<name>` / `adam_v.<name>`, loss-scale
state) plus one JSON string `clipms_meta` (step, epoch, AdamW step, the resolved config, its
fingerprint and the metric history). Files are `step-00000120.ckpt`; a write goes to a hidden temp
file in the same folder, is fsync'ed and renamed, so a kill at any moment leaves either the old set
of checkpoints or the old set plus one complete new file, never a truncated one.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clipms.atomic import atomic_write, dead_writers_temps

log = logging.getLogger(__name__)

META_KEY = "clipms_meta"
_NAME = re.compile(r"^step-(\d{8})\.ckpt$")


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


def clear(folder: Path | str) -> int:
    """Delete every checkpoint in `folder` (used when they belong to another configuration)."""
    paths = list_checkpoints(folder)
    for path in paths:
        path.unlink()
    return len(paths)


def _as_tensor(value: Any) -> Any:
    import mindspore as ms

    if isinstance(value, ms.Tensor):  # Parameters are Tensors
        return ms.Tensor(value.asnumpy())  # a copy, so the file holds this instant's values
    return ms.Tensor(np.asarray(value))
