"""Stage `shard`: data/download/*.tar -> validated data/shards/{train,val}/*.tar + manifest.json.

`python -m stages.shard`; reads the `shard` section.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import Field

from clipms.jsonio import write_json
from clipms.prep.shards import ShardError, ShardSettings, build_shards
from stages.params import ParamsError, Section, load_section

IN_DIR = Path("data/download")
OUT_DIR = Path("data/shards")
METRICS_PATH = Path("metrics/shard.json")


class ShardParams(Section):
    samples_per_shard: int = Field(512, ge=1, le=1_000_000)
    min_image_size: int = Field(32, ge=1, le=65536)
    seed: int = 0
    workers: int = Field(2, ge=1, le=256)


def main() -> int:
    try:
        params = load_section("shard", ShardParams)
        metrics = build_shards(IN_DIR, OUT_DIR, ShardSettings(**params.model_dump()))
    except (ParamsError, ShardError) as err:
        print(f"shard: error: {err}", file=sys.stderr)
        return 1
    write_json(METRICS_PATH, metrics)
    return 0


if __name__ == "__main__":  # shard validation spawns worker processes that re-import this module
    sys.exit(main())
