"""img2dataset wrapper: images.parquet -> webdataset shards, a URL-scheme allow-list, a summary.

Safety: only rows whose URL scheme is on the allow-list ever reach img2dataset (whose urllib fetcher
would happily read `file://` paths). Rows are filtered here, before img2dataset sees the file, and
counted as `disallowed_scheme`; `dedupe` applies the same policy, this is the second line of defence
for an images.parquet that did not come from our own dedupe stage.

Resume: img2dataset's default incremental mode skips every shard that already has a
`NNNNN_stats.json`. The output folder carries a fingerprint of the input and the download settings;
a rerun with the same fingerprint resumes, any other fingerprint clears the folder first.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

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


def scheme_array(urls: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Lower-cased URL scheme of each URL ('' when there is none, e.g. ' file://' or '/etc/x').

    Nothing is stripped first: urllib would strip leading spaces, but a URL that does not start
    with its scheme has no scheme here, so it can never pass the allow-list.
    """
    found = pc.extract_regex(urls, r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*):")
    return pc.fill_null(pc.utf8_lower(pc.struct_field(found, [0])), "")


def url_schemes(urls: pd.Series) -> pd.Series:
    """`scheme_array` for a pandas column."""
    schemes = scheme_array(pa.array(urls.astype(object), type=pa.string(), from_pandas=True))
    return pd.Series(schemes.to_numpy(zero_copy_only=False), index=urls.index, dtype=object)


def allowed_schemes(configured: Iterable[str], source: str) -> frozenset[str]:
    """The schemes that may be fetched: the configured list, plus `file` only for synthetic data.

    The synthetic generator serves its images as file:// URLs; any other source is untrusted input
    and a file:// row in it must never make us read local files.
    """
    schemes = {s.lower() for s in configured}
    if source == "synthetic":
        schemes.add("file")
    else:
        schemes.discard("file")
    return frozenset(schemes)


@dataclass(frozen=True)
class DownloadSettings:
    image_size: int = 256
    resize_mode: str = "center_crop"
    encode_quality: int = 95
    processes: int = 2
    threads: int = 16
    timeout: int = 10
    retries: int = 1
    samples_per_shard: int = 1000


class DownloadError(RuntimeError):
    """img2dataset did not finish every shard (a rerun resumes the unfinished ones)."""


def filter_schemes(images: pd.DataFrame, schemes: frozenset[str]) -> tuple[pd.DataFrame, int]:
    """Rows whose URL scheme is allowed, and how many were removed."""
    ok = url_schemes(images["url"].astype(str)).isin(schemes) & images["url"].notna()
    return images[ok].reset_index(drop=True), int((~ok).sum())


def fingerprint(images_file: Path, settings: DownloadSettings, schemes: frozenset[str]) -> str:
    """sha256 of the input bytes + settings: what decides whether existing shards are reusable."""
    digest = hashlib.sha256()
    with open(images_file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    config = {"settings": asdict(settings), "schemes": sorted(schemes)}
    digest.update(json.dumps(config, sort_keys=True).encode())
    return digest.hexdigest()


def prepare_output(output: Path, print_fn=print, *, expected: str) -> None:
    """Keep a folder whose fingerprint matches (resume); otherwise start from an empty folder."""
    marker = output / FINGERPRINT_FILE
    if output.exists() and marker.is_file() and marker.read_text().strip() == expected:
        done = len(list(output.glob("*_stats.json")))
        print_fn(f"download: resuming in {output} ({done} finished shard(s) are kept)")
        return
    if output.exists():
        print_fn(f"download: {output} holds another input or settings; clearing it")
        shutil.rmtree(output)
    output.mkdir(parents=True)
    marker.write_text(expected + "\n")


def run_img2dataset(images: pd.DataFrame, output: Path, settings: DownloadSettings) -> None:
    """Hand the (already filtered) rows to img2dataset; call under `if __name__ == "__main__"`."""
    from img2dataset import download  # heavy (cv2, fsspec, ...): only where used

    frame = images.rename(columns={"key": "image_key"})[["url", "caption", *EXTRA_COLUMNS]]
    with tempfile.TemporaryDirectory(prefix="clipms-download-") as tmp:
        url_list = Path(tmp) / "images.parquet"
        frame.to_parquet(url_list, index=False)
        download(
            url_list=str(url_list),
            input_format="parquet",
            url_col="url",
            caption_col="caption",
            save_additional_columns=list(EXTRA_COLUMNS),
            output_format="webdataset",
            output_folder=str(output),
            image_size=settings.image_size,
            resize_mode=settings.resize_mode,
            encode_quality=settings.encode_quality,
            processes_count=settings.processes,
            thread_count=settings.threads,
            timeout=settings.timeout,
            retries=settings.retries,
            number_sample_per_shard=settings.samples_per_shard,
            incremental_mode="incremental",  # "overwrite" is broken in 1.47; prepare_output clears
            distributor="multiprocessing",
            enable_wandb=False,
            extract_exif=False,  # nothing downstream reads EXIF; parsing it costs CPU per image
        )


def expected_shards(rows: int, samples_per_shard: int) -> int:
    return -(-rows // samples_per_shard)


def summarise(output: Path, rows: int, disallowed: int, samples_per_shard: int) -> dict[str, Any]:
    """Aggregate img2dataset's NNNNN_stats.json files into one metrics dict."""
    totals = Counter()
    reasons: Counter[str] = Counter()
    stats_files = sorted(output.glob("*_stats.json"))
    for stats_file in stats_files:
        stats = json.loads(stats_file.read_text())
        for name in ("count", "successes", "failed_to_download", "failed_to_resize"):
            totals[name] += int(stats.get(name, 0))
        status = stats.get("status_dict", {})
        reasons.update({k: int(v) for k, v in status.items() if k != "success"})
    shards = expected_shards(rows, samples_per_shard)
    return {
        "rows_in": rows + disallowed,
        "disallowed_scheme": disallowed,
        "attempted": totals["count"],
        "successes": totals["successes"],
        "failed_to_download": totals["failed_to_download"],
        "failed_to_resize": totals["failed_to_resize"],
        "failure_reasons": dict(sorted(reasons.items())),
        "shards_expected": shards,
        "shards_done": len(stats_files),
        "success_rate": round(totals["successes"] / totals["count"], 4) if totals["count"] else 0.0,
    }


def download_images(
    images_file: Path | str,
    output: Path | str,
    settings: DownloadSettings,
    schemes: frozenset[str],
    print_fn=print,
) -> dict[str, Any]:
    """images.parquet -> img2dataset webdataset in `output`; returns the metrics dict."""
    images_file, output = Path(images_file), Path(output)
    started = time.perf_counter()
    images = _read_images(images_file)
    allowed, disallowed = filter_schemes(images, schemes)
    if disallowed:
        print_fn(f"download: refusing {disallowed:,} row(s) whose URL scheme is not in "
                 f"{sorted(schemes)}")
    prepare_output(output, print_fn, expected=fingerprint(images_file, settings, schemes))
    if len(allowed):
        run_img2dataset(allowed, output, settings)
    metrics = summarise(output, len(allowed), disallowed, settings.samples_per_shard)
    metrics["seconds"] = round(time.perf_counter() - started, 2)
    if metrics["shards_done"] < metrics["shards_expected"]:
        raise DownloadError(
            f"img2dataset finished {metrics['shards_done']} of {metrics['shards_expected']} shards "
            f"in {output}; rerun the stage to resume the unfinished ones"
        )
    print_fn(summary(metrics))
    return metrics


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
        f"failed to decode/resize, {metrics['disallowed_scheme']:,} refused by the scheme "
        f"allow-list) in {metrics.get('seconds', 0):.1f} s (~{rate:.0f} URLs/s, including "
        f"start-up), {metrics['shards_done']} shard(s). Failure reasons: {reasons or 'none'}."
    )
