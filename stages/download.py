"""Stage `download`: data/images.parquet -> the images no earlier run fetched, into the download
store in data/download/, and the catalog of where each of today's images is.

`python -m stages.download`; reads the `download` section and `metadata.source` (which decides
whether `file://` URLs may be fetched). `data/download` is a `persist: true` out in dvc.yaml, so
what earlier runs fetched is still there: a run fetches only the images the store does not hold
(by the key dedupe computes from each image's identity) as a new part, and an interrupted run
resumes its part (`prep.fetch`, `prep.store`). With `download.output` (any fsspec
URL: `s3://bucket/prefix`, `file:///mnt/shared/...`) the store is there instead and
`data/download` holds only the catalog and the pointer to the tars (`prep.remote`).
Exits 1 when img2dataset did not finish, or when fewer than `min_success_rate` of the rows arrived
(metrics/download.json is written first, so the reasons are on record).

`python -m stages.download prune [--apply]` lists (and with --apply removes) what holds none of
today's images: the stores of other download settings, and parts none of whose images is in
data/images.parquet. Nothing else ever removes a downloaded image.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from clipms.schema import Section
from clipms.utils.jsonio import write_json
from clipms.utils.redact import redact_text, redact_url
from pipeline import paths
from pipeline.params import PARAMS_FILE, ParamsError, read_params, validate_section
from prep.catalog import CatalogError, read_images
from prep.engines import DISTRIBUTORS, EngineError, EngineSettings
from prep.fetch import (
    DownloadError,
    DownloadSettings,
    check_success_rate,
    content_settings,
    download_images,
)
from prep.remote import RemoteError, check_output_url
from prep.store import StoreError, prune, prune_plan, store_id
from prep.urlguard import FetchPolicy
from stages.urlpolicy import FetchParams, read_source

READS = (paths.IMAGES, paths.SYNTHETIC)  # file: URLs of the synthetic source point there
WRITES = (paths.DOWNLOAD, paths.DOWNLOAD_METRICS)


class DownloadParams(FetchParams):
    """The `download` section: the URL policy keys (FetchParams), the settings, the engine."""

    image_size: int = Field(256, ge=16, le=4096)
    resize_mode: Literal["no", "keep_ratio", "center_crop", "border"] = "center_crop"
    encode_quality: int = Field(95, ge=1, le=100)
    timeout: int = Field(10, ge=1, le=600)
    retries: int = Field(1, ge=0, le=10)
    samples_per_shard: int = Field(1000, ge=1, le=1_000_000)
    max_image_area: int = Field(25_000_000, ge=1)
    max_aspect_ratio: float = Field(10.0, ge=1.0)
    min_success_rate: float = Field(0.5, ge=0.0, le=1.0)
    retry_failed: bool = True  # refetch images whose latest attempt, in an earlier run, failed
    distributor: Literal[DISTRIBUTORS] = "multiprocessing"  # type: ignore[valid-type]
    processes: int = Field(2, ge=1, le=256)
    threads: int = Field(16, ge=1, le=1024)
    subjob_size: int = Field(1000, ge=1)
    spark_master: str | None = Field(None, min_length=1)
    executors: int | None = Field(None, ge=1)
    ray_address: str | None = Field(None, min_length=1)
    output: str | None = Field(None, min_length=1)  # null: data/download; else an fsspec URL

    @field_validator("resize_mode", mode="before")
    @classmethod
    def _unquoted_no(cls, value: object) -> object:
        return "no" if value is False else value  # YAML 1.1 reads an unquoted `no` as false

    @field_validator("output")
    @classmethod
    def _output(cls, value: str | None) -> str | None:
        return None if value is None else check_output_url(value, [Path.cwd()])

    def settings(self) -> DownloadSettings:
        return DownloadSettings(**_fields_of(self, DownloadSettings))

    def engine(self) -> EngineSettings:
        return EngineSettings(**_fields_of(self, EngineSettings))


def _fields_of(params: Section, cls: type) -> dict:
    return params.model_dump(include={f.name for f in dataclasses.fields(cls)})


def load_download(path: Path | str = PARAMS_FILE) -> tuple[DownloadParams, FetchPolicy]:
    """The download params and the URL policy (with `metadata.source`, which allows `file`)."""
    params = read_params(path)
    download = validate_section("download", DownloadParams, params.get("download") or {},
                                source=str(path))
    return download, download.policy(read_source(params, path))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["prune"]:
        return prune_command(args[1:])
    try:
        params, policy = load_download()
        pointer = paths.DOWNLOAD if params.output else None
        metrics = download_images(paths.IMAGES, params.output or paths.DOWNLOAD,
                                  params.settings(), params.engine(), policy,
                                  pointer_folder=pointer)
    except (ParamsError, DownloadError, EngineError, RemoteError, StoreError, FileNotFoundError,
            OSError, ValueError) as err:  # OSError: the store at download.output (network, ...)
        print(f"download: error: {redact_text(str(err))}", file=sys.stderr)
        return 1
    write_json(paths.DOWNLOAD_METRICS, metrics)
    try:
        check_success_rate(metrics, params.min_success_rate)
    except DownloadError as err:
        print(f"download: error: {err}", file=sys.stderr)
        return 1
    return 0


def prune_command(args: list[str]) -> int:
    """`prune [--apply]`: what holds none of today's images, removed only with --apply."""
    if args not in ([], ["--apply"]):
        print("usage: python -m stages.download prune [--apply]", file=sys.stderr)
        return 2
    try:
        params, policy = load_download()
        root = params.output or str(paths.DOWNLOAD.resolve())
        current = store_id(content_settings(params.settings(), policy))
        plan = prune_plan(root, current, set(read_images(paths.IMAGES).column("key").to_pylist()))
        if args:
            prune(root, plan)
    except (ParamsError, CatalogError, StoreError, OSError) as err:
        print(f"download prune: error: {redact_text(str(err))}", file=sys.stderr)
        return 1
    verb = "removed" if args else "would remove"
    for item in plan:
        print(f"download prune: {verb} {item.path} ({item.reason})")
    print(f"download prune: {len(plan)} item(s) {verb} in {redact_url(root)}"
          + ("" if args else "; rerun with --apply to remove them")
          + ("; `dvc gc` frees DVC's cached copies" if args and not params.output else ""))
    return 0


if __name__ == "__main__":  # img2dataset spawns workers that re-import this module
    sys.exit(main())
