"""The COCO Karpathy split (`dataset_coco.json`, Karpathy & Fei-Fei 2015) as the train/val split.

The file lists COCO 2014 images once each: `{"images": [{"cocoid": 391895, "split": "test" | "val"
| "train" | "restval", "filename": "COCO_val2014_000000391895.jpg", ...}, ...]}`. Its 5,000 `test`
images are the retrieval test set papers report (CLIP_benchmark's and open_clip's "COCO 5k"). With
a split file, they become this pipeline's `val` split, the one `evaluate` scores, and every other
image `train` (Karpathy's val and restval images are only held out from its test set too).

Images are matched by COCO image id, read from the file name in the URL
(`.../train2017/000000391895.jpg` and `COCO_val2014_000000391895.jpg` are both 391895): MSCOCO 2017
is a re-split of the same images under the same ids.
"""

# not unit-tested: reached through prep.sources; tests/prep/test_sources.py fetches a split
# file from a loopback server.

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

TEST = "test"
# The digits that end a URL's file name, before the extension (and any query or fragment).
_COCO_ID = r"(?:^|[/_])0*(?P<id>\d+)\.[A-Za-z]+(?:[?#].*)?$"


def test_ids(path: Path | str) -> set[int]:
    """The cocoids of the `test` images of a dataset_coco.json; ValueError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON split file ({err})") from err
    images = data.get("images") if isinstance(data, dict) else None
    if not isinstance(images, list):
        raise ValueError(f"{path}: expected Karpathy's dataset_coco.json, an object with an "
                         "'images' list")
    ids = set()
    for n, image in enumerate(images):
        if not (isinstance(image, dict) and isinstance(image.get("cocoid"), int)
                and isinstance(image.get("split"), str)):
            raise ValueError(f"{path}: images[{n}] lacks an integer 'cocoid' or a 'split'")
        if image["split"] == TEST:
            ids.add(image["cocoid"])
    if not ids:
        raise ValueError(f"{path}: no image has split 'test'")
    return ids


def coco_ids(urls: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The COCO image id in each URL's file name (null where there is none)."""
    found = pc.struct_field(pc.extract_regex(urls, _COCO_ID), [0])
    return pc.cast(found, pa.int64())


def splits(urls: pa.Array | pa.ChunkedArray, test: set[int]) -> tuple[pa.Array, int]:
    """`val` for the URLs of the test images, `train` for the rest; and how many of the test
    images the URLs hold."""
    ids = coco_ids(urls)
    is_test = pc.fill_null(pc.is_in(ids, value_set=pa.array(sorted(test), type=pa.int64())),
                           False)
    found = pc.count_distinct(pc.filter(ids, is_test)).as_py()
    return pc.if_else(is_test, "val", "train"), found
