"""The download store: every image img2dataset fetched, kept across runs in parts, so that a run
fetches only the images no earlier run holds.

Layout under the root (a local folder or any fsspec URL):

    clipms-store                  marker: this stage wrote the folder (and the layout's version)
    s-<12 hex>/                   one store per content fingerprint (the settings that decide a
      settings.json               sample's bytes, written out in settings.json for a reader)
      parts/00000.json            a part's record: rows, samples per img2dataset shard, digest
      parts/00000.rows.parquet    the rows it handed to img2dataset: a resume reruns exactly these
      parts/00000/                img2dataset's output: NNNNN.tar, NNNNN.parquet, NNNNN_stats.json

A part is written once and never changed after it is complete; img2dataset resumes an incomplete
one (it skips every shard with a `_stats.json`). Nothing here deletes a part except `prune`, which
a user runs (`python -m stages.download prune`).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from clipms.utils.redact import redact_url

MARKER = "clipms-store"
LAYOUT = "clipms download store, layout 1"
SETTINGS_FILE = "settings.json"
# What the store reads of img2dataset's per-shard parquet (one row per URL it was given).
OUTCOME_COLUMNS = ["image_key", "status", "error_message", "original_width", "original_height"]
# Files of the layout before the store (one img2dataset folder per input fingerprint).
OLD_LAYOUT_MARKS = ("clipms_input.sha256",)


class StoreError(RuntimeError):
    """The root holds files this stage did not write, or a part's record is unreadable."""


@dataclass(frozen=True)
class Part:
    """One img2dataset run's rows and output."""

    number: int
    rows: int
    samples_per_shard: int
    digest: str  # sha256 of the rows file: what the part was asked to fetch

    @property
    def name(self) -> str:
        return f"{self.number:05d}"

    @property
    def shards_expected(self) -> int:
        return -(-self.rows // self.samples_per_shard)


def store_id(content: dict[str, Any]) -> str:
    """`s-` + 12 hex of the sha256 of the content settings (sorted JSON)."""
    blob = json.dumps(content, sort_keys=True).encode()
    return "s-" + hashlib.sha256(blob).hexdigest()[:12]


def prepare_root(root: str, owned: bool, print_fn: Callable[[str], None] = print) -> None:
    """Make `root` a store root. A root this stage marked is kept as it is. Files of the earlier
    layout are removed, saying so (they are also in DVC's cache when the root is the project's).
    Anything else in a root without the marker: cleared when `owned` (the project's DVC out),
    otherwise refused - a folder the user named is not ours to empty."""
    fs, path = fsspec.core.url_to_fs(root, use_listings_cache=False)
    marker = f"{path}/{MARKER}"
    if fs.isfile(marker):
        return
    contents = fs.ls(path, detail=False) if fs.isdir(path) else []
    names = {entry.rstrip("/").rsplit("/", 1)[-1] for entry in contents}
    old = bool(names & set(OLD_LAYOUT_MARKS))
    if contents and not (old or owned):
        raise StoreError(f"{redact_url(root)} holds files this stage did not write (no {MARKER})"
                         "; choose an empty folder for download.output or empty this one")
    if contents:
        why = ("images of the earlier one-folder layout, which cannot say which download settings "
               "made them" if old else "files this stage did not write")
        print_fn(f"download: {redact_url(root)} holds {why}; removing {len(contents)} entr"
                 f"{'y' if len(contents) == 1 else 'ies'} before the first store is made")
        for entry in contents:  # the folder's contents, not the folder: it may be a bucket
            fs.rm(entry, recursive=True)
    fs.makedirs(path, exist_ok=True)
    fs.pipe_file(marker, (LAYOUT + "\n").encode())


class Store:
    """The parts of one store (one content fingerprint) under a root."""

    def __init__(self, root: str, identity: str) -> None:
        self.root = root.rstrip("/")
        self.id = identity
        self.fs, base = fsspec.core.url_to_fs(self.root, use_listings_cache=False)
        self.base = base.rstrip("/")
        self.path = f"{self.base}/{identity}"

    # -- layout ------------------------------------------------------------------------------

    def part_url(self, part: Part) -> str:
        """The part's img2dataset output folder, as a path or URL img2dataset writes to."""
        return f"{self.root}/{self.id}/parts/{part.name}"

    def relative(self, part_name: str, shard: str) -> str:
        """A shard tar's path relative to the root (what the catalog and the pointer record)."""
        return f"{self.id}/parts/{part_name}/{shard}.tar"

    def write_settings(self, content: dict[str, Any]) -> None:
        target = f"{self.path}/{SETTINGS_FILE}"
        if not self.fs.isfile(target):
            self.fs.makedirs(self.path, exist_ok=True)
            self.fs.pipe_file(target, (json.dumps(content, indent=2, sort_keys=True) + "\n")
                              .encode())

    # -- parts ---------------------------------------------------------------------------------

    def parts(self) -> list[Part]:
        """Every part of the store, by number."""
        found = []
        for record in sorted(self.fs.glob(f"{self.path}/parts/*.json")):
            try:
                data = json.loads(self.fs.cat_file(record))
                found.append(Part(int(data["number"]), int(data["rows"]),
                                  int(data["samples_per_shard"]), str(data["digest"])))
            except (ValueError, KeyError, TypeError) as err:
                raise StoreError(f"{redact_url(self.root)}: unreadable part record "
                                 f"{record.rsplit('/', 1)[-1]} ({err})") from None
        return sorted(found, key=lambda p: p.number)

    def new_part(self, rows: pd.DataFrame, samples_per_shard: int) -> Part:
        """Record a part for `rows` (the rows file first, so a record always has its rows)."""
        numbers = [p.number for p in self.parts()]
        data = _parquet_bytes(rows)
        part = Part(max(numbers, default=-1) + 1, len(rows), samples_per_shard,
                    hashlib.sha256(data).hexdigest())
        self.fs.makedirs(f"{self.path}/parts", exist_ok=True)
        self.fs.pipe_file(f"{self.path}/parts/{part.name}.rows.parquet", data)
        self.fs.pipe_file(f"{self.path}/parts/{part.name}.json",
                          (json.dumps(asdict(part), sort_keys=True) + "\n").encode())
        return part

    def rows(self, part: Part) -> pd.DataFrame:
        data = self.fs.cat_file(f"{self.path}/parts/{part.name}.rows.parquet")
        if hashlib.sha256(data).hexdigest() != part.digest:
            raise StoreError(f"{redact_url(self.root)}: the rows of part {part.name} are not the "
                             "ones its record names (changed by hand?)")
        return pq.read_table(pa.BufferReader(data)).to_pandas()

    def finished_shards(self, part: Part) -> list[str]:
        """The part's img2dataset shards that have their `_stats.json` (finished), by name."""
        stats = self.fs.glob(f"{self.path}/parts/{part.name}/*_stats.json")
        return sorted(p.rsplit("/", 1)[-1].removesuffix("_stats.json") for p in stats)

    def is_complete(self, part: Part) -> bool:
        return len(self.finished_shards(part)) >= part.shards_expected

    def stats(self, part: Part) -> list[dict[str, Any]]:
        """img2dataset's `_stats.json` of every finished shard of the part."""
        return [json.loads(self.fs.cat_file(f"{self.path}/parts/{part.name}/{shard}_stats.json"))
                for shard in self.finished_shards(part)]

    def outcomes(self, parts: list[Part] | None = None) -> pd.DataFrame:
        """One row per URL that a finished shard attempted: OUTCOME_COLUMNS + part, tar (the
        shard's tar relative to the root)."""
        frames = []
        for part in self.parts() if parts is None else parts:
            for shard in self.finished_shards(part):
                data = self.fs.cat_file(f"{self.path}/parts/{part.name}/{shard}.parquet")
                frame = pq.read_table(pa.BufferReader(data)).to_pandas()
                frame = frame.reindex(columns=OUTCOME_COLUMNS)
                frames.append(frame.assign(part=part.number, tar=self.relative(part.name, shard)))
        if not frames:
            return pd.DataFrame({c: pd.Series(dtype=object) for c in [*OUTCOME_COLUMNS, "part",
                                                                        "tar"]})
        return pd.concat(frames, ignore_index=True)

    def tar_sizes(self) -> dict[str, int]:
        """{tar path relative to the root: bytes} of every tar of the store."""
        found = self.fs.glob(f"{self.path}/parts/*/*.tar", detail=True)
        return {path.removeprefix(f"{self.base}/"): int(info["size"])
                for path, info in found.items()}


def _parquet_bytes(frame: pd.DataFrame) -> bytes:
    sink = io.BytesIO()
    # No pandas metadata: deterministic bytes, and list columns read back as lists.
    table = pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(None)
    pq.write_table(table, sink)
    return sink.getvalue()


def other_stores(root: str, current: str) -> list[str]:
    """The ids of the stores under `root` other than `current` (made with other settings)."""
    fs, path = fsspec.core.url_to_fs(root, use_listings_cache=False)
    if not fs.isdir(path):
        return []
    names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)
             if fs.isdir(entry)]
    return sorted(n for n in names if n.startswith("s-") and n != current)


# ---------------------------------------------------------------- pruning (a user's command)


@dataclass(frozen=True)
class Prunable:
    """Something `prune` would remove: a path relative to the root, and why."""

    path: str
    reason: str
    entries: list[str]  # the files and folders it consists of, relative to the root


def prune_plan(root: str, current: str, wanted: set[str]) -> list[Prunable]:
    """What holds no image of `wanted` (today's keys): the stores of other download settings,
    and the complete parts of the current store none of whose images is wanted. An incomplete
    part is never listed (a rerun resumes it)."""
    plan = [Prunable(other, "made with other download settings", [other])
            for other in other_stores(root, current)]
    store = Store(root, current)
    if not store.fs.isdir(store.path):
        return plan
    outcomes = store.outcomes()
    useful = set(outcomes.loc[(outcomes["status"] == "success")
                              & outcomes["image_key"].isin(wanted), "part"].astype(int))
    for part in store.parts():
        if part.number in useful or not store.is_complete(part):
            continue
        prefix = f"{current}/parts/{part.name}"
        plan.append(Prunable(prefix, "none of its images is in images.parquet",
                             [prefix, f"{prefix}.rows.parquet", f"{prefix}.json"]))
    return plan


def prune(root: str, plan: list[Prunable]) -> None:
    """Remove what `prune_plan` listed (records last: a part without its record is ignored)."""
    fs, base = fsspec.core.url_to_fs(root, use_listings_cache=False)
    for item in plan:
        for entry in item.entries:
            target = f"{base.rstrip('/')}/{entry}"
            if fs.exists(target):
                fs.rm(target, recursive=True)
