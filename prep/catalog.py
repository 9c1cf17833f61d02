"""The download catalog: for every image of images.parquet, whether the download holds it and where.

The download stage writes `catalog.parquet` into its DVC out (beside the store, or beside the
pointer when the store is at a URL): one row per image of the images.parquet it ran on,

    key, url, status, reason, part, tar, original_width, original_height

`url` is redacted (no user-info, query or fragment: `clipms.utils.redact`). `status` is
`fetched` (arrived in this run's part), `reused` (held from an earlier run's part), `failed` (its
latest attempt failed: `reason` is img2dataset's error) or `refused` (by the URL policy, before
any fetch: `reason` is the refusal). `tar` is the img2dataset tar that holds the
image, relative to the store root. The file's metadata names the sha256 of that images.parquet,
so the shard stage refuses a catalog made for other images (a stale download). The shard stage
reads the image bytes from the catalog's tars and everything else - captions, split, labels,
URL - from today's images.parquet, so a caption list that changed for an image fetched months ago
is the new one.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from clipms.utils.atomic import atomic_write

if TYPE_CHECKING:  # pandas only where a frame is asked for: the shard stage never imports it
    import pandas as pd

CATALOG_FILE = "catalog.parquet"
STATUSES = ("fetched", "reused", "failed", "refused")
HELD = ("fetched", "reused")
COLUMNS = ["key", "url", "status", "reason", "part", "tar", "original_width", "original_height"]
SCHEMA = pa.schema([("key", pa.string()), ("url", pa.string()), ("status", pa.string()),
                    ("reason", pa.string()), ("part", pa.int64()), ("tar", pa.string()),
                    ("original_width", pa.int64()), ("original_height", pa.int64())])
_IMAGES_DIGEST = b"clipms.images_sha256"
_STORE = b"clipms.store"
IMAGE_COLUMNS = ("url", "key", "captions", "split", "labels")


class CatalogError(ValueError):
    """No catalog, an unreadable one, or one made for another images.parquet."""


def file_sha256(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_catalog(folder: Path | str, frame: pd.DataFrame, images_sha256: str,
                  store: str) -> Path:
    """`folder/catalog.parquet`, atomically, rows in key order (the same night, the same bytes)."""
    table = pa.Table.from_pandas(frame[COLUMNS].sort_values("key"), schema=SCHEMA,
                                 preserve_index=False)
    table = table.replace_schema_metadata({_IMAGES_DIGEST: images_sha256.encode(),
                                           _STORE: store.encode()})
    target = Path(folder) / CATALOG_FILE
    with atomic_write(target) as tmp:
        pq.write_table(table, str(tmp))
    return target


@dataclass(frozen=True)
class Catalog:
    table: pa.Table  # COLUMNS
    images_sha256: str
    store: str

    @property
    def frame(self) -> pd.DataFrame:
        return self.table.to_pandas()


def read_catalog(folder: Path | str) -> Catalog:
    path = Path(folder) / CATALOG_FILE
    if not path.is_file():
        raise CatalogError(f"{path}: no download catalog (run the download stage first)")
    try:
        table = pq.read_table(str(path))  # a path, not a file object (download.read_parquet)
    except (pa.ArrowException, OSError) as err:
        raise CatalogError(f"{path}: not a readable catalog ({err})") from None
    meta = table.schema.metadata or {}
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing or _IMAGES_DIGEST not in meta:
        raise CatalogError(f"{path}: not a catalog the download stage wrote (missing "
                           f"{missing or 'its images digest'})")
    return Catalog(table, meta[_IMAGES_DIGEST].decode(), meta.get(_STORE, b"").decode())


def read_images(path: Path | str) -> pa.Table:
    """The columns of images.parquet that the catalog's readers need, checked."""
    path = Path(path)
    if not path.is_file():
        raise CatalogError(f"{path}: images file not found (run the dedupe stage first)")
    table = pq.read_table(str(path))
    missing = [c for c in IMAGE_COLUMNS if c not in table.column_names]
    if missing:
        raise CatalogError(f"{path}: missing column(s) {missing}; found {table.column_names}")
    return table.select(list(IMAGE_COLUMNS))


# ---------------------------------------------------------------- what the shard stage reads


@dataclass
class TarInput:
    """One tar to read: the images it holds for today, with today's metadata."""

    tar: str  # relative to the store root
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # image key -> metadata


def check_current(catalog: Catalog, images_file: Path | str) -> None:
    """CatalogError when the catalog was made for another images.parquet."""
    if catalog.images_sha256 != file_sha256(images_file):
        raise CatalogError(f"the download catalog was made for another {Path(images_file).name} "
                           "(the images changed since the download stage ran): rerun the "
                           "download stage")


def shard_inputs(images_file: Path | str, catalog: Catalog) -> list[TarInput]:
    """Today's held images grouped by the tar that holds them (tars in name order), each with
    its captions, split, labels and URL from `images_file`."""
    check_current(catalog, images_file)
    images = read_images(images_file)
    held = catalog.table.filter(pc.is_in(catalog.table["status"], pa.array(HELD)))
    where = dict(zip(held["key"].to_pylist(), held["tar"].to_pylist(), strict=True))
    by_tar: dict[str, TarInput] = defaultdict(lambda: TarInput(""))
    columns = {name: images.column(name).to_pylist() for name in IMAGE_COLUMNS}
    for row in range(images.num_rows):
        key = columns["key"][row]
        tar = where.get(key)
        if tar is None:
            continue
        entry = by_tar[tar]
        entry.tar = tar
        entry.records[key] = {"captions": list(columns["captions"][row] or []),
                              "url": columns["url"][row], "split": columns["split"][row],
                              "labels": columns["labels"][row]}
    return [by_tar[tar] for tar in sorted(by_tar)]
