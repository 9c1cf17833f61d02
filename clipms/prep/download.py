"""img2dataset wrapper: images.parquet -> webdataset shards, with the URL policy and a summary.

Safety (`clipms.prep.urlguard`): every row's URL is checked before img2dataset or any engine sees
it - the scheme must be allowed (`file` only for the synthetic source) and, unless
`allow_private_addresses`, every address its host resolves to must be public - and refusals are
counted by reason. Inside img2dataset's workers (`clipms.prep.img2dataset_guard`) the same policy is
urllib's opener (checked again at connect time; redirects may not change the scheme or reach such
an address; bodies are bounded) and images over `max_image_area` / `max_aspect_ratio` are refused
from their header, before they are decoded.

Resume: img2dataset's default incremental mode skips every shard that already has a
`NNNNN_stats.json`. The output folder (a local path or any fsspec URL) carries a fingerprint of the
input, the download settings and the policy; a rerun with the same fingerprint resumes, on any
distributor, any other fingerprint clears the folder first. A folder without a fingerprint is
cleared only when it is the project's own; at a URL the user named it must be empty (it is not
ours to delete). For a URL, the project keeps a pointer instead of the tars (`clipms.prep.remote`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd
import pyarrow.parquet as pq

from clipms.prep import remote
from clipms.prep.engines import EngineSettings, engine_session
from clipms.prep.urlguard import FetchPolicy, precheck, refusal_counts
from clipms.utils.redact import redact_text, redact_url

# Not *.json: img2dataset counts every *.json in the folder as a finished shard.
FINGERPRINT_FILE = "clipms_input.sha256"
# Columns img2dataset copies into each sample's json. It reserves `key` for its own shard-local key,
# so our stable key travels as `image_key`.
EXTRA_COLUMNS = ["captions", "split", "image_key", "labels"]


def read_parquet(path: Path | str) -> pd.DataFrame:
    """Read a parquet file into pandas by path.

    Not `pd.read_parquet`: with pandas 2.2.3 + pyarrow 18.1 it reads through a Python file handle on
    Arrow's thread pool, and the interpreter then often aborts at exit ("terminate called without an
    active exception", exit code 134) after the stage's work is done. A path string does not.
    """
    return pq.read_table(str(path)).to_pandas()


@dataclass(frozen=True)
class DownloadSettings:
    """What decides the downloaded samples (fingerprinted; the engine settings are not)."""

    image_size: int = 256
    resize_mode: str = "center_crop"
    encode_quality: int = 95
    timeout: int = 10
    retries: int = 1
    samples_per_shard: int = 1000
    max_image_area: int = 25_000_000
    max_aspect_ratio: float = 10.0


class DownloadError(RuntimeError):
    """img2dataset did not finish every shard, or too few images arrived."""


def filter_urls(images: pd.DataFrame, policy: FetchPolicy) -> tuple[pd.DataFrame, dict[str, int]]:
    """The rows the policy allows (`urlguard.precheck`), and the refusals by reason."""
    urls = images["url"].astype(object).where(images["url"].notna(), "").astype(str).tolist()
    reasons = precheck(urls, policy)
    keep = [reason is None for reason in reasons]
    return images[keep].reset_index(drop=True), refusal_counts(reasons)


def fingerprint(images_file: Path, settings: DownloadSettings, policy: FetchPolicy) -> str:
    """sha256 of the input bytes + settings + policy: whether existing shards are reusable."""
    digest = hashlib.sha256()
    with open(images_file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    config = {"settings": asdict(settings), "schemes": sorted(policy.allowed_schemes),
              "allow_private_addresses": policy.allow_private_addresses,
              "allowed_networks": sorted(policy.allowed_networks), "max_bytes": policy.max_bytes}
    digest.update(json.dumps(config, sort_keys=True).encode())
    return digest.hexdigest()


def prepare_output(output: str, print_fn=print, *, expected: str, owned: bool = True) -> None:
    """Keep a folder whose fingerprint matches (resume); otherwise start from an empty folder.
    `output` is a local path or any fsspec URL. A folder this stage did not make (no fingerprint)
    is cleared only when it is `owned` (the project's DVC out); otherwise it must be empty."""
    fs, root = fsspec.core.url_to_fs(output, use_listings_cache=False)
    marker = f"{root}/{FINGERPRINT_FILE}"
    shown = redact_url(output)
    ours = fs.isfile(marker)
    if ours and fs.cat_file(marker).decode().strip() == expected:
        done = len(fs.glob(f"{root}/*_stats.json"))
        print_fn(f"download: resuming in {shown} ({done} finished shard(s) are kept)")
        return
    contents = fs.ls(root, detail=False) if fs.isdir(root) else []
    if contents and not (ours or owned):
        raise DownloadError(f"{shown} holds files this stage did not write (no {FINGERPRINT_FILE})"
                            "; choose an empty folder for download.output or empty this one")
    if contents:
        print_fn(f"download: {shown} holds another input or settings; clearing it")
        for path in contents:  # the folder's contents, not the folder: it may be a bucket
            fs.rm(path, recursive=True)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(marker, (expected + "\n").encode())


def run_img2dataset(images: pd.DataFrame, output: str, settings: DownloadSettings,
                    engine: EngineSettings, policy: FetchPolicy) -> None:
    """Hand the (already checked) rows to img2dataset on the engine, with the policy and the size
    limits inside its workers; call under `if __name__ == "__main__"`."""
    # The engine's session first: img2dataset imports ray when it is installed, and Ray reads the
    # authentication settings a local Ray gets (clipms.prep.engines) once, when it is imported.
    with engine_session(engine):
        _img2dataset(images, output, settings, engine, policy)


def _img2dataset(images: pd.DataFrame, output: str, settings: DownloadSettings,
                 engine: EngineSettings, policy: FetchPolicy) -> None:
    from img2dataset import download  # heavy (cv2, fsspec, ...): only where used

    from clipms.prep.img2dataset_guard import ImageLimits, guarded

    frame = images.rename(columns={"key": "image_key"})[["url", "caption", *EXTRA_COLUMNS]]
    limits = ImageLimits(settings.max_image_area, settings.max_aspect_ratio)
    with tempfile.TemporaryDirectory(prefix="clipms-download-") as tmp, guarded(policy, limits):
        url_list = Path(tmp) / "images.parquet"
        frame.to_parquet(url_list, index=False)
        download(
            url_list=str(url_list),
            input_format="parquet",
            url_col="url",
            caption_col="caption",
            save_additional_columns=list(EXTRA_COLUMNS),
            output_format="webdataset",
            output_folder=output,
            image_size=settings.image_size,
            resize_mode=settings.resize_mode,
            encode_quality=settings.encode_quality,
            processes_count=engine.processes,
            thread_count=engine.threads,
            timeout=settings.timeout,
            retries=settings.retries,
            number_sample_per_shard=settings.samples_per_shard,
            max_image_area=settings.max_image_area,
            max_aspect_ratio=settings.max_aspect_ratio,
            incremental_mode="incremental",  # "overwrite" is broken in 1.47; prepare_output clears
            distributor=engine.distributor,
            subjob_size=engine.subjob_size,
            enable_wandb=False,
            extract_exif=False,  # nothing downstream reads EXIF; parsing it costs CPU per image
        )


def expected_shards(rows: int, samples_per_shard: int) -> int:
    return -(-rows // samples_per_shard)


def summarise(output: str, rows: int, refused: dict[str, int],
              samples_per_shard: int) -> dict[str, Any]:
    """Aggregate img2dataset's NNNNN_stats.json files into one metrics dict."""
    fs, root = fsspec.core.url_to_fs(output, use_listings_cache=False)
    totals = Counter()
    reasons: Counter[str] = Counter()
    stats_files = sorted(fs.glob(f"{root}/*_stats.json"))
    for stats_file in stats_files:
        stats = json.loads(fs.cat_file(stats_file))
        for name in ("count", "successes", "failed_to_download", "failed_to_resize"):
            totals[name] += int(stats.get(name, 0))
        for reason, count in stats.get("status_dict", {}).items():
            if reason != "success":  # img2dataset's error texts: no URL secret into the metrics
                reasons[redact_text(reason)] += int(count)
    return {
        "rows_in": rows + sum(refused.values()),
        "refused": refused,
        "disallowed_scheme": refused.get("disallowed_scheme", 0),
        "attempted": totals["count"],
        "successes": totals["successes"],
        "failed_to_download": totals["failed_to_download"],
        "failed_to_resize": totals["failed_to_resize"],
        "failure_reasons": dict(sorted(reasons.items())),
        "shards_expected": expected_shards(rows, samples_per_shard),
        "shards_done": len(stats_files),
        # Of every row the stage was given: refused rows count as failures too.
        "success_rate": round(totals["successes"] / total, 4) if (total := rows + sum(
            refused.values())) else 0.0,
    }


def download_images(
    images_file: Path | str,
    output: Path | str,
    settings: DownloadSettings,
    engine: EngineSettings,
    policy: FetchPolicy,
    print_fn=print,
    pointer_folder: Path | None = None,
) -> dict[str, Any]:
    """images.parquet -> img2dataset webdataset in `output` (a path or an fsspec URL); returns the
    metrics dict. With `pointer_folder` (`output` is then a URL: not the project's own folder),
    that folder is emptied first and, once every shard is done, holds only the pointer to
    `output` (`clipms.prep.remote`); a folder at `output` this stage did not write is refused."""
    images_file = Path(images_file)
    # Absolute for a local folder: img2dataset 1.47 means to do it (make_path_absolute) but compares
    # fsspec's protocol with "file", which is now a tuple, so a Ray worker whose working directory
    # differs from ours looked for its shards elsewhere.
    output = str(output) if remote.is_url(output) else str(Path(output).resolve())
    shown = redact_url(output)
    started = time.perf_counter()
    allowed, refused = filter_urls(_read_images(images_file), policy)
    if sum(refused.values()):
        reasons = ", ".join(f"{k} {v:,}" for k, v in refused.items() if v)
        print_fn(f"download: refusing {sum(refused.values()):,} row(s) before any download "
                 f"({reasons})")
    expected = fingerprint(images_file, settings, policy)
    prepare_output(output, print_fn, expected=expected, owned=pointer_folder is None)
    if pointer_folder is not None:  # until every shard is done, no pointer says they are
        shutil.rmtree(pointer_folder, ignore_errors=True)
        pointer_folder.mkdir(parents=True)
    if len(allowed):
        run_img2dataset(allowed, output, settings, engine, policy)
    metrics = summarise(output, len(allowed), refused, settings.samples_per_shard)
    metrics["seconds"] = round(time.perf_counter() - started, 2)
    if metrics["shards_done"] < metrics["shards_expected"]:
        raise DownloadError(
            f"img2dataset finished {metrics['shards_done']} of {metrics['shards_expected']} shards "
            f"in {shown}; rerun the stage to resume the unfinished ones"
        )
    if pointer_folder is not None:
        pointer = remote.write_pointer(pointer_folder, output, expected)
        print_fn(f"download: {len(pointer['shards'])} shard(s) in {shown}, recorded in "
                 f"{pointer_folder / remote.POINTER_FILE}")
    print_fn(summary(metrics))
    return metrics


def check_success_rate(metrics: dict[str, Any], min_success_rate: float) -> None:
    """DownloadError naming the top failure reasons when too few of the URLs arrived."""
    rows, rate = metrics["rows_in"], metrics["success_rate"]
    if rows and rate >= min_success_rate:
        return
    causes = Counter({**metrics["failure_reasons"],
                      **{f"refused: {k}": v for k, v in metrics["refused"].items() if v}})
    top = "; ".join(f"{n:,} x {reason}" for reason, n in causes.most_common(5)) or "none"
    raise DownloadError(
        f"only {metrics['successes']:,} of {rows:,} images arrived (success rate {rate:.3f} < "
        f"download.min_success_rate {min_success_rate:g}). Top failure reasons: {top}")


def _read_images(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: images file not found (run the dedupe stage first)")
    images = read_parquet(path)
    missing = [c for c in ("url", "key", "caption", "captions", "split", "labels")
               if c not in images.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; found {list(images.columns)}")
    return images


def summary(metrics: dict[str, Any]) -> str:
    """The one-paragraph end-of-stage summary."""
    reasons = "; ".join(f"{n:,} x {msg}" for msg, n in metrics["failure_reasons"].items())
    rate = metrics["attempted"] / metrics["seconds"] if metrics.get("seconds") else 0.0
    return (
        f"download: {metrics['successes']:,} of {metrics['attempted']:,} images fetched "
        f"({metrics['failed_to_download']:,} failed to download, {metrics['failed_to_resize']:,} "
        f"failed to decode/resize, {sum(metrics['refused'].values()):,} refused before download) "
        f"in {metrics.get('seconds', 0):.1f} s (~{rate:.0f} URLs/s, including "
        f"start-up), {metrics['shards_done']} shard(s). Failure reasons: {reasons or 'none'}."
    )
