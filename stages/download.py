"""Stage `download`: data/images.parquet -> img2dataset webdataset shards in data/download/.

`python -m stages.download`; reads the `download` section and `metadata.source` (which decides
whether `file://` URLs may be fetched). `data/download` is a `persist: true` out in dvc.yaml, so a
rerun after an interruption resumes: shards img2dataset finished are kept, the rest are fetched.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from clipms.jsonio import write_json
from clipms.prep.download import DownloadError, DownloadSettings, allowed_schemes, download_images
from stages import paths
from stages.params import PARAMS_FILE, ParamsError, Section, read_params, validate_section

READS = (paths.IMAGES, paths.SYNTHETIC)  # file: URLs of the synthetic source point there
WRITES = (paths.DOWNLOAD, paths.DOWNLOAD_METRICS)


class DownloadParams(Section):
    image_size: int = Field(256, ge=16, le=4096)
    resize_mode: Literal["no", "keep_ratio", "center_crop", "border"] = "center_crop"
    encode_quality: int = Field(95, ge=1, le=100)
    processes: int = Field(2, ge=1, le=256)
    threads: int = Field(16, ge=1, le=1024)
    timeout: int = Field(10, ge=1, le=600)
    retries: int = Field(1, ge=0, le=10)
    samples_per_shard: int = Field(1000, ge=1, le=1_000_000)
    allowed_schemes: list[str] = Field(default_factory=lambda: ["http", "https"], min_length=1)

    @field_validator("allowed_schemes")
    @classmethod
    def _schemes(cls, value: list[str]) -> list[str]:
        for scheme in value:
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", scheme):
                raise ValueError(f"{scheme!r} is not a URL scheme (e.g. http, https)")
            if scheme.lower() == "file":
                raise ValueError("'file' is not allowed here: it is added automatically for "
                                 "metadata.source synthetic and refused for any other source")
        return [s.lower() for s in value]


class SourceParams(Section):
    """The one key of the `metadata` section that the download policy depends on."""

    source: Literal["synthetic", "mscoco", "local"] = "synthetic"


def fetch_schemes(path: Path | str = PARAMS_FILE) -> tuple[DownloadParams, frozenset[str]]:
    """The download params and the URL schemes that may be fetched (dedupe applies the same)."""
    params = read_params(path)
    download = validate_section("download", DownloadParams, params.get("download") or {},
                                source=str(path))
    metadata = params.get("metadata") or {}
    source = validate_section("metadata", SourceParams, {"source": metadata.get("source",
                                                                              "synthetic")},
                              source=str(path)).source
    return download, allowed_schemes(download.allowed_schemes, source)


def main() -> int:
    try:
        params, schemes = fetch_schemes()
        settings = DownloadSettings(**params.model_dump(exclude={"allowed_schemes"}))
        metrics = download_images(paths.IMAGES, paths.DOWNLOAD, settings, schemes)
    except (ParamsError, DownloadError, FileNotFoundError, ValueError) as err:
        print(f"download: error: {err}", file=sys.stderr)
        return 1
    write_json(paths.DOWNLOAD_METRICS, metrics)
    return 0


if __name__ == "__main__":  # img2dataset spawns workers that re-import this module
    sys.exit(main())
