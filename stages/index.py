"""Stage `index`: embed the shards' images with the exported bundle and write the search index.

`python -m stages.index`; reads the `index` and `runtime` sections. Writes models/index/
(clipms.deploy.searchindex: unit-length embeddings, keys, captions, thumbnails, the bundle's
digest; a FAISS index when `index.search` is hnsw or ivf) and metrics/index.json. Images the
bundle's decoder refuses are skipped and counted.
"""

# tested by: tests/clipms/deploy/test_searchindex.py

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from clipms.runtime import RuntimeConfig, configure
from clipms.schema import Section
from pipeline import paths
from pipeline.params import ParamsError, load_section

READS = (paths.BUNDLE, paths.SHARDS_TRAIN, paths.SHARDS_VAL, paths.MANIFEST)
WRITES = (paths.INDEX, paths.INDEX_METRICS)


class IndexParams(Section):
    splits: list[str] = Field(default_factory=lambda: ["train", "val"], min_length=1)
    search: Literal["auto", "exact", "hnsw", "ivf"] = "auto"
    thumbnail_size: int = Field(128, ge=16, le=512)
    batch_size: int = Field(64, ge=1)
    hnsw_m: int = Field(32, ge=4)
    hnsw_ef_search: int = Field(128, ge=1)
    ivf_nlist: int = Field(0, ge=0)  # 0: 4 sqrt(rows)
    ivf_nprobe: int = Field(16, ge=1)


def items(splits: list[str]) -> Iterator:
    """Every sample of the splits, in manifest order, as clipms.deploy.searchindex.Item."""
    from clipms.data.webds import read_manifest, read_tar, split_entry
    from clipms.deploy.searchindex import Item

    manifest = read_manifest(paths.SHARDS)
    for split in splits:
        for shard in split_entry(manifest, split, str(paths.SHARDS))["shards"]:
            for sample in read_tar(paths.SHARDS / shard["name"]):
                captions = sample.meta.get("captions") or [sample.caption]
                yield Item(sample.key, sample.image or b"", str(captions[0]), split)


def main() -> int:
    started = time.perf_counter()
    try:
        params = load_section("index", IndexParams)
        runtime = load_section("runtime", RuntimeConfig)
    except ParamsError as err:
        print(f"index: error: {err}", file=sys.stderr)
        return 1
    configure(runtime)  # the device and mode of the `runtime` section, before any graph compiles
    from clipms.data.webds import DataError
    from clipms.deploy.infer import BundleError, Encoder
    from clipms.deploy.search import SearchOptions
    from clipms.deploy.searchindex import ImageIndexError, build_index, bundle_digest
    from clipms.utils.jsonio import write_json

    options = SearchOptions(kind=params.search, hnsw_m=params.hnsw_m,
                            hnsw_ef_search=params.hnsw_ef_search, ivf_nlist=params.ivf_nlist,
                            ivf_nprobe=params.ivf_nprobe)
    try:
        encoder = Encoder(paths.BUNDLE, batch_size=params.batch_size, device=runtime)
        report = build_index(encoder, items(params.splits), paths.INDEX,
                             bundle_digest(paths.BUNDLE), options, params.thumbnail_size,
                             params.batch_size)
    except (BundleError, DataError, ImageIndexError, ImportError) as err:
        print(f"index: error: {err}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    report.update(seconds=round(seconds, 2), splits=params.splits)
    write_json(paths.INDEX_METRICS, report)
    chosen = report["search"] + (" (auto)" if params.search == "auto" else "")
    print(f"index: {report['rows']} images of {params.splits} in {paths.INDEX} "
          f"({chosen} search, {sum(report['skipped'].values())} skipped) in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
