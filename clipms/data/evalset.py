"""Frozen evaluation sets: one split of a shard folder, copied once and never changed.

A nightly run on a growing source evaluates on a val split that grows with it, so two nights are
scored on different samples (the gate re-scores the champion to compare them). A team that wants
one yardstick for months freezes today's split into a folder of its own (`freeze`): the shards as
they are, and a manifest in the shard stage's format holding that split alone, so the evaluation
code reads it like any shard folder. `verify` checks every shard against the sha256 the manifest
recorded: a frozen set that changed is an error, never a silently different yardstick.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from clipms.data.webds import (
    MANIFEST,
    DataError,
    size_and_sha256,
    read_manifest,
    split_entry,
    write_manifest,
)

FROZEN_SPLIT = "val"  # the split name a frozen set holds, whatever it was frozen from


def freeze(source: Path | str, split: str, target: Path | str) -> dict[str, Any]:
    """Copy `split` of the shard folder `source` (checked against its manifest first) into the
    new folder `target` as its `val` split; returns the new manifest. An existing `target` is
    refused: a frozen set is never overwritten."""
    source, target = Path(source), Path(target)
    if target.exists():
        raise DataError(f"{target}: already exists; a frozen evaluation set is never changed "
                        "(freeze into a new name)")
    manifest = read_manifest(source)
    entry = split_entry(manifest, split, str(source / MANIFEST))
    if not entry["shards"]:
        raise DataError(f"{source}: split {split!r} has no shards to freeze")
    verify_entry(source, entry, f"{source} split {split!r}")
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    shards = []
    for shard in entry["shards"]:
        name = f"{FROZEN_SPLIT}/{Path(shard['name']).name}"
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / shard["name"], staging / name)
        shards.append({**shard, "name": name})
    frozen = {**entry, "shards": shards}
    write_manifest(staging, int(manifest.get("samples_per_shard") or 0),
                   {FROZEN_SPLIT: frozen})
    verify_entry(staging, frozen, str(staging))
    staging.rename(target)  # all or nothing: a half-copied set never has the final name
    return read_manifest(target)


def verify(root: Path | str) -> dict[str, Any]:
    """The frozen set's manifest, once every shard matches its recorded size and sha256."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no frozen evaluation set there (freeze one first)")
    manifest = read_manifest(root)
    verify_entry(root, split_entry(manifest, FROZEN_SPLIT, str(root / MANIFEST)), str(root))
    return manifest


def verify_entry(root: Path, entry: dict[str, Any], where: str) -> None:
    """Every shard of a manifest entry exists with the size and sha256 recorded for it."""
    for shard in entry["shards"]:
        path = root / shard["name"]
        if not path.is_file():
            raise DataError(f"{where}: shard {shard['name']} is missing")
        size, digest = size_and_sha256(path)
        if (size, digest) != (shard.get("bytes"), shard.get("sha256")):
            raise DataError(f"{where}: shard {shard['name']} is not the one recorded "
                            f"(sha256 {digest[:16]}..., recorded {str(shard.get('sha256'))[:16]}"
                            "...): the set was changed")
