"""Stage `shard`: today's images (data/images.parquet) from the download store -> validated
data/shards/{train,val}/*.tar + manifest.json.

`python -m stages.shard`; reads the `shard` section, and `download.output`: when the download
stage wrote to that URL, data/download holds its catalog and pointer and the tars are read from
the URL (`prep.remote`), refused when they are not the ones the pointer records. Which tars
hold today's images is the download catalog's (`prep.catalog`); each sample's captions,
split, labels and URL are data/images.parquet's, so a caption list that changed for an image an
earlier run fetched is the new one. What decoding each input tar's images found is kept in
data/shard-checks (by the tar's sha256), so a night decodes only the images of the new parts.
"""

# tested by: tests/prep/test_shards.py

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import Field

from clipms.schema import Section
from clipms.utils.jsonio import write_json
from clipms.utils.redact import redact_url
from pipeline import paths
from pipeline.params import PARAMS_FILE, ParamsError, load_section, read_params
from prep.catalog import CatalogError, read_catalog, shard_inputs
from prep.remote import (
    POINTER_FILE,
    RemoteError,
    check_output_url,
    read_pointer,
)
from prep.shards import ShardError, ShardSettings, build_shards

READS = (paths.DOWNLOAD, paths.IMAGES)
WRITES = (paths.SHARDS_TRAIN, paths.SHARDS_VAL, paths.MANIFEST, paths.SHARD_CHECKS,
          paths.SHARD_METRICS)


class ShardParams(Section):
    samples_per_shard: int = Field(512, ge=1, le=1_000_000)
    min_image_size: int = Field(32, ge=1, le=65536)
    seed: int = 0
    workers: int = Field(2, ge=1, le=256)


def download_source() -> tuple[str, list[dict[str, Any]] | None]:
    """Where the download stage's tars are (data/download, or the URL of `download.output`) and,
    for a URL, the shards its pointer records; ParamsError/ShardError when the two disagree."""
    output = (read_params(PARAMS_FILE).get("download") or {}).get("output")
    if output is not None:
        try:
            check_output_url(str(output), [Path.cwd()])
        except ValueError as err:
            raise ParamsError(f"{PARAMS_FILE}: download.output: {err}") from None
    try:
        pointer = read_pointer(paths.DOWNLOAD)
    except RemoteError as err:
        raise ShardError(str(err)) from None
    pointer_file = paths.DOWNLOAD / POINTER_FILE
    if pointer is None and output is None:
        return str(paths.DOWNLOAD), None
    if pointer is None:
        raise ShardError(f"download.output is {redact_url(output)} but {paths.DOWNLOAD} holds no "
                         f"{POINTER_FILE}: run the download stage first")
    if output is None or redact_url(output) != pointer["url"]:
        shown = "null" if output is None else redact_url(output)
        raise ShardError(f"{pointer_file} points at {pointer['url']} but download.output is "
                         f"{shown}: rerun the download stage")
    return str(output), pointer["shards"]


def main() -> int:
    try:
        params = load_section("shard", ShardParams)
        source, recorded = download_source()
        inputs = shard_inputs(paths.IMAGES, read_catalog(paths.DOWNLOAD))
        metrics = build_shards(source, paths.SHARDS, ShardSettings(**params.model_dump()),
                               recorded=recorded, inputs=inputs, checks_dir=paths.SHARD_CHECKS)
    except (ParamsError, ShardError, CatalogError) as err:
        print(f"shard: error: {err}", file=sys.stderr)
        return 1
    write_json(paths.SHARD_METRICS, metrics)
    return 0


if __name__ == "__main__":  # shard validation spawns worker processes that re-import this module
    sys.exit(main())
