"""Stage `metadata`: caption metadata -> data/metadata.parquet (and data/synthetic/ images).

`python -m stages.metadata`; the `metadata` section of params.yaml chooses the source; an http(s)
`url`/`path` is fetched under the download stage's URL policy (`download.allowed_schemes`,
`download.allow_private_addresses`).
"""

# tested by: tests/benchmarks/test_rehearsal.py

from __future__ import annotations

import re
import sys
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from clipms.schema import Section
from pipeline import paths
from pipeline.params import ParamsError, load_section
from prep.sources import MSCOCO_URL, MetadataError, MetadataSpec, build_metadata
from stages.urlpolicy import fetch_policy

READS: tuple = ()
WRITES = (paths.METADATA, paths.SYNTHETIC)


class MetadataParams(Section):
    source: Literal["synthetic", "mscoco", "local"] = "synthetic"
    # synthetic
    num_images: int = Field(2000, ge=1, le=1_000_000)
    synthetic_image_size: int = Field(128, ge=16, le=1024)
    seed: int = 0
    synthetic_captions: Literal["templates", "mscoco"] = "templates"
    synthetic_val_images: int | None = Field(None, ge=1)  # the last N images are the val split
    synthetic_url: str | None = None  # base URL of a server of data/synthetic; null: file: URLs
    # mscoco (and http(s) paths of local)
    url: str = MSCOCO_URL
    sha256: str | None = None
    retries: int = Field(3, ge=0, le=20)
    timeout: float = Field(60.0, gt=0)
    # local
    path: str | None = Field(None, validate_default=True)
    url_col: str = Field("URL", min_length=1)
    caption_col: str = Field("TEXT", min_length=1)
    id_col: str | None = Field(None, min_length=1)  # an image id column (dedupe.identity: id)
    # mscoco/local: Karpathy's dataset_coco.json (a path or an http(s) URL); its 5k test images
    # become the val split (prep/karpathy.py)
    karpathy_split: str | None = Field(None, min_length=1)
    # mscoco/local: a parquet of more rows is refused before it is read (~1 GB per million rows)
    max_rows: int = Field(5_000_000, ge=1)
    # mscoco/local: bytes of text in one value, and in the file's URL/caption/id columns
    max_text_bytes: int = Field(65_536, ge=256)
    max_total_text_bytes: int = Field(1 << 30, ge=1 << 20)

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", value):
            raise ValueError("must be null or a sha256 hex digest (64 hex characters)")
        return value

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must be an http(s) URL")
        return value

    @field_validator("synthetic_val_images")
    @classmethod
    def _fewer_than_the_images(cls, value: int | None, info: ValidationInfo) -> int | None:
        images = info.data.get("num_images")
        if value is not None and images is not None and value >= images:
            raise ValueError(f"must be below metadata.num_images ({images}): the train split "
                             "needs images too")
        return value

    @field_validator("synthetic_url")
    @classmethod
    def _http_base_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be null (file: URLs) or an http(s) URL serving data/synthetic")
        return value

    @field_validator("karpathy_split")
    @classmethod
    def _coco_sources(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("source") == "synthetic":
            raise ValueError("applies to COCO image URLs: set source to mscoco or local")
        return value

    @field_validator("path")
    @classmethod
    def _path_for_local(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("source") == "local" and not value:
            raise ValueError("required when source is 'local' (a parquet path or http(s) URL)")
        return value


def main() -> int:
    try:
        params = load_section("metadata", MetadataParams)
        policy = fetch_policy()  # an http(s) url/path follows the download stage's URL rule
        summary = build_metadata(MetadataSpec(**params.model_dump()), paths.METADATA,
                                 paths.SYNTHETIC, policy)
    except (ParamsError, MetadataError) as err:
        print(f"metadata: error: {err}", file=sys.stderr)
        return 1
    print(summary.paragraph())
    return 0


if __name__ == "__main__":
    sys.exit(main())
