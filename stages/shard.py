"""Stage `shard`: data/download/*.tar -> validated data/shards/{train,val}/*.tar + manifest.json.

`python -m stages.shard`; reads the `shard` section.
"""

from __future__ import annotations

import sys

from pydantic import Field

from clipms.jsonio import write_json
from clipms.prep.shards import ShardError, ShardSettings, build_shards
from stages import paths
from stages.params import ParamsError, Section, load_section

READS = (paths.DOWNLOAD,)
WRITES = (paths.SHARDS_TRAIN, paths.SHARDS_VAL, paths.MANIFEST, paths.SHARD_METRICS)


class ShardParams(Section):
    samples_per_shard: int = Field(512, ge=1, le=1_000_000)
    min_image_size: int = Field(32, ge=1, le=65536)
    seed: int = 0
    workers: int = Field(2, ge=1, le=256)


def main() -> int:
    try:
        params = load_section("shard", ShardParams)
        metrics = build_shards(paths.DOWNLOAD, paths.SHARDS, ShardSettings(**params.model_dump()))
    except (ParamsError, ShardError) as err:
        print(f"shard: error: {err}", file=sys.stderr)
        return 1
    write_json(paths.SHARD_METRICS, metrics)
    return 0


if __name__ == "__main__":  # shard validation spawns worker processes that re-import this module
    sys.exit(main())
