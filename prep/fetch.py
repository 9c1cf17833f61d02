"""img2dataset wrapper: images.parquet -> webdataset shards, fetching only what is new.

Safety (`prep.urlguard`): every row's URL is checked before img2dataset or any engine sees
it - the scheme must be allowed (`file` only for the synthetic source) and, unless
`allow_private_addresses`, every address its host resolves to must be public - and refusals are
counted by reason. Inside img2dataset's workers (`prep.img2dataset_guard`) the same policy is
urllib's opener (checked again at connect time; redirects may not change the scheme or reach such
an address; bodies are bounded) and images over `max_image_area` / `max_aspect_ratio` are refused
from their header, before they are decoded.

Incremental (`prep.store`): the output (a local folder or any fsspec URL) is a store of
parts, one per run that had something to fetch, under a fingerprint of the settings that decide a
sample's bytes (`content_settings`). A run reads which images the store already holds - by the
stable key dedupe computed from each image's identity - and hands img2dataset only the rest, as a
new part; an image no longer in images.parquet stays in the store and is left out of the catalog
(`prep.catalog`), which tells the shard stage where each of today's images is. Other
settings start another store beside the first (nothing is deleted: `prune` does that, when a user
asks). Resume: a part img2dataset did not finish is rerun first with exactly its rows, and
img2dataset skips every shard that has its `NNNNN_stats.json`, on any distributor. For a URL, the
project keeps the catalog and a pointer instead of the tars (`prep.remote`).
"""

# tested by: tests/prep/test_captions.py

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Collection
from contextlib import ExitStack
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from clipms.utils.redact import redact_text, redact_url
from prep import catalog, deferred_imports, remote
from prep.engines import EngineSettings, engine_session
from prep.store import (
    MARKER,
    Part,
    Store,
    StoreError,
    other_stores,
    prepare_root,
    store_id,
)
from prep.urlguard import FetchPolicy, precheck, refusal_counts

# img2dataset's unused imports, deferred here: img2dataset's multiprocessing workers and logger
# process re-import the stage's module (this one) before img2dataset, so they skip them too.
deferred_imports.defer()

# Columns img2dataset copies into each sample's json. It reserves `key` for its own shard-local key,
# so our stable key travels as `image_key`.
EXTRA_COLUMNS = ["captions", "split", "image_key", "labels"]
# Failure reasons are servers' texts (an HTTP reason phrase, an error message) and land in a
# git-tracked metrics file and the stage's summary line: each is cut to MAX_REASON_CHARS, and
# past the MAX_REASONS most frequent, the rest are counted under OTHER_REASONS (300 unique 60 KB
# reason phrases made an 18 MB metrics file).
MAX_REASON_CHARS = 200
MAX_REASONS = 20
OTHER_REASONS = "other"
# The settings that decide a downloaded sample's bytes, or whether an image is accepted at all:
# a store holds images made with one combination (`content_settings`). Timeouts, retries and the
# engine decide only whether a fetch succeeds, so they are not among them.
CONTENT_FIELDS = ("image_size", "resize_mode", "encode_quality", "max_image_area",
                  "max_aspect_ratio")
# The packages that decode, resize and encode the images: another version may give other bytes.
CODEC_PACKAGES = {"img2dataset": ("img2dataset",),
                  "opencv": ("opencv-python-headless", "opencv-python", "opencv-contrib-python")}


def read_parquet(path: Path | str) -> pd.DataFrame:
    """Read a parquet file into pandas by path.

    Not `pd.read_parquet`: with pandas 2.2.3 + pyarrow 18.1 it reads through a Python file handle on
    Arrow's thread pool, and the interpreter then often aborts at exit ("terminate called without an
    active exception", exit code 134) after the stage's work is done. A path string does not.
    """
    return pq.read_table(str(path)).to_pandas()


@dataclass(frozen=True)
class DownloadSettings:
    """What img2dataset is asked for (the engine settings are apart: `EngineSettings`)."""

    image_size: int = 256
    resize_mode: str = "center_crop"
    encode_quality: int = 95
    timeout: int = 10
    retries: int = 1
    samples_per_shard: int = 1000
    max_image_area: int = 25_000_000
    max_aspect_ratio: float = 10.0
    retry_failed: bool = True  # refetch images whose latest attempt (in an earlier run) failed


class DownloadError(RuntimeError):
    """img2dataset did not finish every shard, or too few images arrived."""


def filter_urls(images: pd.DataFrame, policy: FetchPolicy) -> tuple[pd.DataFrame, dict[str, int]]:
    """The rows the policy allows (`urlguard.precheck`), and the refusals by reason."""
    allowed, refused = screen_urls(images, policy)
    return allowed, refusal_counts(refused["reason"])


def screen_urls(images: pd.DataFrame, policy: FetchPolicy) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the rows the policy allows, the refused rows with a `reason` column)."""
    urls = images["url"].astype(object).where(images["url"].notna(), "").astype(str).tolist()
    reasons = pd.Series(precheck(urls, policy), index=images.index, dtype=object)
    keep = reasons.isna()
    return (images[keep].reset_index(drop=True),
            images[~keep].assign(reason=reasons[~keep]).reset_index(drop=True))


def content_settings(settings: DownloadSettings, policy: FetchPolicy) -> dict[str, Any]:
    """What the store's fingerprint covers: CONTENT_FIELDS, the body limit and the codecs."""
    content: dict[str, Any] = {name: getattr(settings, name) for name in CONTENT_FIELDS}
    content["max_image_bytes"] = policy.max_bytes
    for name, distributions in CODEC_PACKAGES.items():
        content[name] = next((v for d in distributions if (v := _version(d))), None)
    return content


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def run_img2dataset(rows: pd.DataFrame, output: str, settings: DownloadSettings,
                    engine: EngineSettings, policy: FetchPolicy) -> None:
    """Hand `rows` (already checked; img2dataset's columns) to img2dataset on the engine, with the
    policy and the size limits inside its workers; call inside `engine_session(engine)`, under
    `if __name__ == "__main__"`."""
    from img2dataset import download  # heavy (cv2, fsspec, ...): only where used

    from prep.img2dataset_guard import ImageLimits, guarded

    limits = ImageLimits(settings.max_image_area, settings.max_aspect_ratio)
    with tempfile.TemporaryDirectory(prefix="clipms-download-") as tmp, guarded(policy, limits):
        url_list = Path(tmp) / "images.parquet"
        rows.to_parquet(url_list, index=False)
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
            incremental_mode="incremental",  # skips shards with stats: how a part resumes
            distributor=engine.distributor,
            subjob_size=engine.subjob_size,
            enable_wandb=False,
            extract_exif=False,  # nothing downstream reads EXIF; parsing it costs CPU per image
        )


def img2dataset_rows(images: pd.DataFrame) -> pd.DataFrame:
    """images.parquet rows as img2dataset's input (our key as `image_key`)."""
    return images.rename(columns={"key": "image_key"})[["url", "caption", *EXTRA_COLUMNS]]


def latest_outcomes(outcomes: pd.DataFrame) -> pd.DataFrame:
    """One outcome per image key: its first success (lowest part), else its latest failure."""
    if outcomes.empty:
        return outcomes.set_index("image_key")
    ranked = outcomes.assign(failed=outcomes["status"] != "success",
                             order=outcomes["part"].where(outcomes["status"] == "success",
                                                          -outcomes["part"]))
    ranked = ranked.sort_values(["failed", "order"], kind="stable")
    return ranked.drop_duplicates("image_key").drop(columns=["failed", "order"]).set_index(
        "image_key")


@dataclass
class Fetch:
    """What one run asked img2dataset for: the parts it ran and the rows of the new one."""

    parts: list[Part]
    new: int = 0       # rows never attempted before
    retried: int = 0   # rows whose latest earlier attempt failed


def to_fetch(allowed: pd.DataFrame, known: pd.DataFrame, retry_failed: bool,
             resumed: Collection[int] = ()) -> tuple[pd.DataFrame, int, int]:
    """The allowed rows whose image the store does not hold (and, unless `retry_failed`, did not
    fail to fetch before); with how many are new and how many retried. A failure in a `resumed`
    part is not retried: the resume finishes the interrupted run, whose failures the next run
    retries, as if it had not been interrupted."""
    if not len(known):
        return allowed.reset_index(drop=True), len(allowed), 0
    status = allowed["key"].map(known["status"])
    in_resumed = allowed["key"].map(known["part"]).isin(resumed)
    never = status.isna()
    retried = status.notna() & (status != "success") & retry_failed & ~in_resumed
    return allowed[never | retried].reset_index(drop=True), int(never.sum()), int(retried.sum())


def for_part(engine: EngineSettings, part: Part) -> EngineSettings:
    """No more multiprocessing workers than the part has img2dataset shards: a worker without a
    shard would only cost its start-up (a night's part is often one shard)."""
    if engine.distributor != "multiprocessing":
        return engine
    return replace(engine, processes=max(1, min(engine.processes, part.shards_expected)))


def part_shard_size(rows: int, settings: DownloadSettings, engine: EngineSettings) -> int:
    """img2dataset's shard size for a new part: `samples_per_shard`, or less when the part is
    small, so that every multiprocessing worker gets a shard (a night's few new images would
    otherwise be one shard, on one worker)."""
    if engine.distributor != "multiprocessing":
        return settings.samples_per_shard
    return max(1, min(settings.samples_per_shard, -(-rows // engine.processes)))


def fetch_missing(store: Store, allowed: pd.DataFrame, settings: DownloadSettings,
                  engine: EngineSettings, policy: FetchPolicy,
                  print_fn: Callable[[str], None]) -> Fetch:
    """Finish any part an interrupted run left, then fetch what the store still lacks as a new
    part."""
    fetch = Fetch(parts=[])
    with ExitStack() as session:
        def run(part: Part) -> None:
            # One engine session for every part, opened only when there is one: img2dataset
            # imports ray when it is installed, and Ray reads the authentication a local Ray
            # gets (prep.engines) once, on that import.
            if not fetch.parts:
                session.enter_context(engine_session(engine))
            run_part(store, part, settings, engine, policy)
            fetch.parts.append(part)

        for part in store.parts():
            if not store.is_complete(part):
                print_fn(f"download: resuming part {part.name} "
                         f"({len(store.finished_shards(part))} of {part.shards_expected} "
                         "img2dataset shard(s) finished are kept)")
                run(part)
        known = latest_outcomes(store.outcomes())
        rows, fetch.new, fetch.retried = to_fetch(allowed, known, settings.retry_failed,
                                                  {p.number for p in fetch.parts})
        if len(rows):
            part = store.new_part(img2dataset_rows(rows),
                                  part_shard_size(len(rows), settings, engine))
            print_fn(f"download: fetching {len(rows):,} image(s) into part {part.name} "
                     f"({fetch.new:,} new, {fetch.retried:,} failed before)")
            run(part)
    return fetch


def run_part(store: Store, part: Part, settings: DownloadSettings, engine: EngineSettings,
             policy: FetchPolicy) -> None:
    """img2dataset on the part's recorded rows, cut into its recorded shard size (what decides
    which img2dataset shards a resume skips), on at most as many workers as it has shards."""
    run_img2dataset(store.rows(part), store.part_url(part),
                    replace(settings, samples_per_shard=part.samples_per_shard),
                    for_part(engine, part), policy)


def build_catalog(images: pd.DataFrame, refused: pd.DataFrame, known: pd.DataFrame,
                  fetched_parts: set[int]) -> pd.DataFrame:
    """catalog.COLUMNS for every row of `images` (see prep.catalog)."""
    # the URL tells which image a row is: its user-info, query and fragment may be secrets
    frame = pd.DataFrame({"key": images["key"], "url": images["url"].map(redact_url)})
    outcome = known.reindex(frame["key"])
    success = (outcome["status"] == "success").to_numpy()
    tonight = outcome["part"].isin(fetched_parts).to_numpy()
    frame["status"] = "failed"
    frame.loc[success & tonight, "status"] = "fetched"
    frame.loc[success & ~tonight, "status"] = "reused"
    # img2dataset's error texts may quote a URL with its user-info: the catalog keeps none
    frame["reason"] = outcome["error_message"].where(~success, None).map(
        shown_reason, na_action="ignore").to_numpy()
    frame["part"] = outcome["part"].astype("Int64").to_numpy()
    frame["tar"] = outcome["tar"].where(success, None).to_numpy()
    for side in ("original_width", "original_height"):
        frame[side] = pd.to_numeric(outcome[side], errors="coerce").astype("Int64").to_numpy()
    never = outcome["status"].isna().to_numpy()
    frame.loc[never, "reason"] = "not attempted"
    refusals = dict(zip(refused["key"], refused["reason"], strict=True))
    is_refused = frame["key"].isin(refusals).to_numpy()
    frame.loc[is_refused, "status"] = "refused"  # today's policy decides, whatever was held
    frame.loc[is_refused, "reason"] = frame.loc[is_refused, "key"].map(refusals)
    frame.loc[is_refused, "tar"] = None
    return frame


def shown_reason(reason: str) -> str:
    """A failure reason as the metrics and the catalog keep it: redacted, at most
    MAX_REASON_CHARS long (cut before redacting could leave half a secret: redact first)."""
    shown = " ".join(redact_text(str(reason)).split())  # one line
    if len(shown) <= MAX_REASON_CHARS:
        return shown
    return f"{shown[:MAX_REASON_CHARS - 1]}\u2026"


def bounded_reasons(reasons: Counter[str]) -> dict[str, int]:
    """The MAX_REASONS most frequent reasons (ties by text), the rest summed as OTHER_REASONS;
    sorted by text, as before."""
    ranked = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))
    kept = dict(ranked[:MAX_REASONS])
    rest = sum(count for _, count in ranked[MAX_REASONS:])
    if rest:
        kept[OTHER_REASONS] = kept.get(OTHER_REASONS, 0) + rest
    return dict(sorted(kept.items()))


def summarise(frame: pd.DataFrame, refused: dict[str, int], fetch: Fetch, stats: list[dict],
              held_keys: set[str]) -> dict[str, Any]:
    """The metrics dict from the catalog, img2dataset's stats of this run's parts, and the keys
    the store holds (successes)."""
    totals: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for shard in stats:
        for name in ("count", "successes", "failed_to_download", "failed_to_resize"):
            totals[name] += int(shard.get(name, 0))
        for reason, count in shard.get("status_dict", {}).items():
            if reason != "success":  # img2dataset's error texts: no URL secret into the metrics
                reasons[shown_reason(reason)] += int(count)
    counts = frame["status"].value_counts()
    successes = int(counts.get("fetched", 0) + counts.get("reused", 0))
    rows = len(frame)
    return {
        "rows_in": rows,
        "refused": refused,
        "disallowed_scheme": refused.get("disallowed_scheme", 0),
        "new_images": fetch.new,
        "retried_images": fetch.retried,
        "reused_images": int(counts.get("reused", 0)),
        "dropped_images": len(held_keys - set(frame["key"])),
        "attempted": totals["count"],
        "fetched": totals["successes"],
        "failed_to_download": totals["failed_to_download"],
        "failed_to_resize": totals["failed_to_resize"],
        "failure_reasons": bounded_reasons(reasons),
        "failed_earlier": int(((frame["status"] == "failed")
                               & ~frame["part"].isin([p.number for p in fetch.parts])).sum()),
        "successes": successes,
        "shards_expected": sum(p.shards_expected for p in fetch.parts),
        "shards_done": len(stats),
        # Of every row the stage was given: refused rows count as failures too.
        "success_rate": round(successes / rows, 4) if rows else 0.0,
    }


def download_images(
    images_file: Path | str,
    output: Path | str,
    settings: DownloadSettings,
    engine: EngineSettings,
    policy: FetchPolicy,
    print_fn: Callable[[str], None] = print,
    pointer_folder: Path | None = None,
) -> dict[str, Any]:
    """images.parquet -> the images the store at `output` (a path or an fsspec URL) lacks, then
    the catalog; returns the metrics dict. The catalog goes into `pointer_folder` when given
    (`output` is then a URL: not the project's own folder; the folder is emptied first and, once
    every shard is done, also holds the pointer to the tars), else into `output`. A folder at a
    URL this stage did not write is refused."""
    images_file = Path(images_file)
    # Absolute for a local folder: img2dataset 1.47 means to do it (make_path_absolute) but compares
    # fsspec's protocol with "file", which is now a tuple, so a Ray worker whose working directory
    # differs from ours looked for its shards elsewhere.
    output = str(output) if remote.is_url(output) else str(Path(output).resolve())
    started = time.perf_counter()
    images = _read_images(images_file)
    allowed, refused = screen_urls(images, policy)
    if len(refused):
        counts = refused["reason"].value_counts()
        print_fn(f"download: refusing {len(refused):,} row(s) before any download ("
                 + ", ".join(f"{k} {v:,}" for k, v in counts.items()) + ")")
    content = content_settings(settings, policy)
    if pointer_folder is not None:
        keep_local_store(pointer_folder, output)
    try:
        prepare_root(output, owned=pointer_folder is None, print_fn=print_fn)
    except StoreError as err:
        raise DownloadError(str(err)) from None
    store = Store(output, store_id(content))
    store.write_settings(content)
    _say_other_stores(output, store.id, print_fn)
    if pointer_folder is not None:  # until every shard is done, no pointer says they are
        shutil.rmtree(pointer_folder, ignore_errors=True)
        pointer_folder.mkdir(parents=True)
    fetch = fetch_missing(store, allowed, settings, engine, policy, print_fn)
    outcomes = store.outcomes()
    known = latest_outcomes(outcomes)
    frame = build_catalog(images, refused, known, {p.number for p in fetch.parts})
    held = set(outcomes.loc[outcomes["status"] == "success", "image_key"])
    stats = [s for part in fetch.parts for s in store.stats(part)]
    metrics = summarise(frame, refusal_counts(refused["reason"]), fetch, stats, held)
    metrics.update(store=store.id, parts=len(store.parts()),
                   seconds=round(time.perf_counter() - started, 2))
    unfinished = [p.name for p in fetch.parts if not store.is_complete(p)]
    if unfinished:
        raise DownloadError(
            f"img2dataset finished {metrics['shards_done']} of {metrics['shards_expected']} shards "
            f"(part(s) {', '.join(unfinished)} of {redact_url(output)}); rerun the stage to "
            "resume the unfinished ones")
    catalog.write_catalog(pointer_folder or output, frame, catalog.file_sha256(images_file),
                          store.id)
    if pointer_folder is not None:
        tars = sorted(set(frame["tar"].dropna()))
        pointer = remote.write_pointer(pointer_folder, output, store.id, tars,
                                       metrics["successes"])
        print_fn(f"download: {len(pointer['shards'])} tar(s) in {redact_url(output)}, recorded "
                 f"in {pointer_folder / remote.POINTER_FILE}")
    print_fn(summary(metrics))
    return metrics


def keep_local_store(folder: Path, output: str) -> None:
    """DownloadError when `folder` (which is about to hold only the catalog and the pointer to
    `output`) holds the store of runs without `download.output`: it is not removed unasked."""
    if (folder / MARKER).is_file():
        raise DownloadError(
            f"{folder} holds the download store of earlier runs without download.output. Copy "
            f"its contents to {redact_url(output)} (they are a store there too: nothing is "
            f"fetched again), or remove it, then rerun")


def _say_other_stores(output: str, current: str, print_fn: Callable[[str], None]) -> None:
    others = other_stores(output, current)
    if others:
        print_fn(f"download: {len(others)} store(s) of other download settings kept beside "
                 f"{current} ({', '.join(others)}); `python -m stages.download prune` lists "
                 "what it would remove")


def check_success_rate(metrics: dict[str, Any], min_success_rate: float) -> None:
    """DownloadError naming the top failure reasons when too few of the URLs arrived."""
    rows, rate = metrics["rows_in"], metrics["success_rate"]
    if rows and rate >= min_success_rate:
        return
    causes = Counter({**metrics["failure_reasons"],
                      **{f"refused: {k}": v for k, v in metrics["refused"].items() if v}})
    if metrics.get("failed_earlier"):
        causes["failed in an earlier run (download.retry_failed is false)"] = \
            metrics["failed_earlier"]
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
    return (
        f"download: {metrics['successes']:,} of {metrics['rows_in']:,} images held "
        f"({metrics['reused_images']:,} reused from earlier runs, {metrics['fetched']:,} fetched "
        f"now of {metrics['attempted']:,} attempted: {metrics['new_images']:,} new, "
        f"{metrics['retried_images']:,} failed before); {metrics['failed_to_download']:,} failed "
        f"to download, {metrics['failed_to_resize']:,} failed to decode/resize, "
        f"{sum(metrics['refused'].values()):,} refused before download, "
        f"{metrics.get('failed_earlier', 0):,} failed in an earlier run; "
        f"{metrics['dropped_images']:,} held image(s) no longer listed are left out. "
        f"{metrics.get('seconds', 0):.1f} s, {metrics['shards_done']} img2dataset shard(s) run, "
        f"store {metrics.get('store', '?')} with {metrics.get('parts', 0)} part(s). "
        f"Failure reasons: {reasons or 'none'}."
    )
