"""Stage `dedupe`: data/metadata.parquet (a row per caption) -> data/images.parquet (per image).

`python -m stages.dedupe`; reads the `dedupe` section, plus `download.allowed_schemes` and
`metadata.source` so that rows the download stage would refuse are dropped (and counted) here.
"""

# tested by: tests/prep/test_captions.py

from __future__ import annotations

import sys
import time
from typing import Literal

from pydantic import Field

from clipms.schema import Section
from clipms.utils.jsonio import write_json
from pipeline import paths
from pipeline.params import ParamsError, load_section
from prep import captions
from stages.urlpolicy import fetch_policy

READS = (paths.METADATA,)
WRITES = (paths.IMAGES, paths.DEDUPE_METRICS)


class DedupeParams(Section):
    keep: Literal["all", "first"] = "all"
    min_caption_chars: int = Field(5, ge=1, le=1000)
    # Strictly between 0 and 1: an empty train or val split would only fail stages later.
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    split_salt: str = "clipms"
    identity: Literal["path", "url", "id"] = "path"  # what keys and splits hash (captions.py)


def main() -> int:
    started = time.perf_counter()
    try:
        params = load_section("dedupe", DedupeParams)
        policy = fetch_policy()
        result = captions.dedupe(captions.read_metadata(paths.METADATA), policy.allowed_schemes,
                                 **params.model_dump())
        print(captions.summary(result.stats, time.perf_counter() - started))
        captions.check_usable(result.stats)
    except (ParamsError, captions.MetadataError) as err:
        print(f"dedupe: error: {err}", file=sys.stderr)
        return 1
    captions.write_images(result.images, paths.IMAGES)
    write_json(paths.DEDUPE_METRICS, result.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
