"""What changed in the data since the last accepted run, and whether the new data looks broken.

The baseline is a snapshot of the last run whose report passed (`Snapshot`: the image keys with
a digest of each image's captions, the digests of the metadata rows, the schema), persisted by
the stage in its own folder, two generations deep: `current` (the last accepted run) and
`previous` (the one before it). A run on exactly the inputs of `current` (a forced rerun of the
same night) compares against `previous`, so it reports what that night brought, not "nothing".
A run whose checks fail leaves the snapshots as they were: the next night is compared with the
last accepted data again, and the rejected rows are still new then.

The report compares today's metadata rows (`data/metadata.parquet`: one per caption), images
(`data/images.parquet`) and the download catalog (`prep.catalog`) with the baseline:

- rows and images new and removed, kept images whose caption list changed;
- download failures among the new images (failed, or refused by the URL policy), by reason;
- caption lengths in words, the share of new caption rows that are empty, and the share of the
  new captions' words the tokenizer in use has no token for (`Tokenizer.unknown_words`);
- the original sizes of the new images against the kept ones;
- the schema: the source's columns and types (recorded by the metadata stage), which metadata
  columns hold values, and which label fields the images carry.

`Thresholds` decide which findings stop the run before training (`ChangesError`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from clipms.utils.jsonio import read_json, write_json
from prep.catalog import HELD, Catalog
from prep.sourceschema import source_columns

CURRENT, PREVIOUS, NEXT = "current", "previous", "next"
SNAPSHOT_INFO = "snapshot.json"
KEPT_CAPTION_SAMPLE = 20_000  # kept captions the unknown-word share is measured on (seeded sample)
TOP = 10  # reasons and unknown words listed in the report


class ChangesError(RuntimeError):
    """The new data looks broken: the message names every check that failed."""


@dataclass(frozen=True)
class Thresholds:
    """What stops the run before training (the `changes` params section documents each)."""

    max_new_failure_rate: float = 0.5
    max_empty_caption_share: float = 0.1
    on_schema_change: Literal["fail", "warn"] = "fail"
    max_unknown_word_share: float | None = None
    min_new: int = 20  # the share checks apply from this many new images (or caption rows)


# ---------------------------------------------------------------- today's data


@dataclass
class Today:
    """Today's inputs, read once."""

    metadata: pa.Table        # URL, TEXT, LABELS, ... (one row per caption)
    images: pd.DataFrame      # key, captions, labels
    catalog: pd.DataFrame     # prep.catalog.COLUMNS
    digest: str               # of the metadata and images files: which night this is

    @classmethod
    def read(cls, metadata_file: Path, images_file: Path, catalog: Catalog) -> Today:
        digest = hashlib.sha256()
        for path in (metadata_file, images_file):
            digest.update(hashlib.sha256(Path(path).read_bytes()).digest())
        images = pq.read_table(str(images_file), columns=["key", "captions", "labels"])
        return cls(pq.read_table(str(metadata_file)),
                   pd.DataFrame({"key": images.column("key").to_pylist(),
                                 "captions": images.column("captions").to_pylist(),
                                 "labels": images.column("labels").to_pylist()}),
                   catalog.frame, digest.hexdigest())


def row_digests(metadata: pa.Table) -> np.ndarray:
    """A 64-bit digest of each metadata row's (URL, TEXT)."""
    frame = pd.DataFrame({"url": metadata.column("URL").to_pylist(),
                          "text": metadata.column("TEXT").to_pylist()})
    return pd.util.hash_pandas_object(frame, index=False).to_numpy(dtype=np.uint64)


def caption_digests(captions: pd.Series) -> np.ndarray:
    """A 64-bit digest of each image's caption list (order kept)."""
    joined = captions.map(lambda c: "\x1f".join(c or []))
    return pd.util.hash_pandas_object(joined, index=False).to_numpy(dtype=np.uint64)


def schema_of(metadata: pa.Table, rows: np.ndarray | None, labels: pd.Series) -> dict[str, Any]:
    """The schema signature: the source's columns (the whole file), the metadata columns that
    hold a value in `rows` (a boolean mask; None: all rows) and the label fields of `labels`."""
    table = metadata if rows is None else metadata.filter(pa.array(rows))
    populated = [name for name in metadata.column_names
                 if table.num_rows and table.column(name).null_count < table.num_rows]
    return {"source_columns": source_columns(metadata.schema), "populated": populated,
            "label_fields": label_fields(labels)}


def label_fields(labels: pd.Series) -> list[str]:
    fields: set[str] = set()
    for value in labels.dropna().unique():
        try:
            parsed = json.loads(value)
        except (TypeError, ValueError):
            continue
        if isinstance(parsed, dict):
            fields.update(map(str, parsed))
    return sorted(fields)


# ---------------------------------------------------------------- the snapshot (baseline)


@dataclass
class Snapshot:
    """What a report needs of an accepted run."""

    digest: str
    keys: np.ndarray       # image keys (str)
    captions: np.ndarray   # caption-list digests, aligned with keys
    rows: np.ndarray       # distinct metadata row digests
    schema: dict[str, Any]

    @classmethod
    def of(cls, today: Today) -> Snapshot:
        return cls(today.digest, today.images["key"].to_numpy(dtype=object),
                   caption_digests(today.images["captions"]),
                   np.unique(row_digests(today.metadata)),
                   schema_of(today.metadata, None, today.images["labels"]))

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"key": pa.array(self.keys, pa.string()),
                                 "captions": pa.array(self.captions, pa.uint64())}),
                       str(folder / "images.parquet"))
        pq.write_table(pa.table({"row": pa.array(self.rows, pa.uint64())}),
                       str(folder / "rows.parquet"))
        write_json(folder / SNAPSHOT_INFO, {"digest": self.digest, "images": len(self.keys),
                                            "rows": len(self.rows), "schema": self.schema})

    @classmethod
    def load(cls, folder: Path) -> Snapshot | None:
        if not (folder / SNAPSHOT_INFO).is_file():
            return None
        info = read_json(folder / SNAPSHOT_INFO)
        images = pq.read_table(str(folder / "images.parquet"))
        rows = pq.read_table(str(folder / "rows.parquet"))
        return cls(info["digest"], np.array(images.column("key").to_pylist(), dtype=object),
                   images.column("captions").to_numpy(), rows.column("row").to_numpy(),
                   info["schema"])


def baseline_for(state: Path, today: Today) -> tuple[Snapshot | None, bool]:
    """(the snapshot to compare with, whether today is a new night). `current` is the last
    accepted run; on its own inputs (a rerun) the comparison is with `previous`. A `current`
    lost between two renames of `accept` leaves `previous` as the last accepted run."""
    current = Snapshot.load(state / CURRENT)
    if current is None:
        return Snapshot.load(state / PREVIOUS), True
    if current.digest == today.digest:
        return Snapshot.load(state / PREVIOUS), False
    return current, True


def accept(state: Path, today: Today) -> None:
    """Today becomes `current`, the old `current` becomes `previous`."""
    shutil.rmtree(state / NEXT, ignore_errors=True)
    Snapshot.of(today).save(state / NEXT)
    if (state / CURRENT).is_dir():
        shutil.rmtree(state / PREVIOUS, ignore_errors=True)
        (state / CURRENT).rename(state / PREVIOUS)
    (state / NEXT).rename(state / CURRENT)


# ---------------------------------------------------------------- the report


def report(today: Today, baseline: Snapshot | None, tokenizer: Any,
           thresholds: Thresholds) -> dict[str, Any]:
    """The data-change report of today against `baseline` (None: the first run; everything is
    new), with the checks of `thresholds` (`failures` lists what failed)."""
    rows = row_digests(today.metadata)
    new_rows = ~np.isin(rows, baseline.rows) if baseline else np.ones(len(rows), dtype=bool)
    keys = today.images["key"].to_numpy(dtype=object)
    new_images = ~np.isin(keys, baseline.keys) if baseline else np.ones(len(keys), dtype=bool)
    result: dict[str, Any] = {
        "baseline": _baseline_summary(baseline),
        "rows": _row_changes(today.metadata, rows, new_rows, baseline),
        "images": _image_changes(today, new_images, baseline),
        "download": _download_of_new(today.catalog, keys[new_images]),
        "captions": _caption_lengths(today.images["captions"], new_images),
        "tokens": _unknown_words(today.images["captions"], new_images, tokenizer),
        "image_size": _sizes(today.catalog, keys, new_images),
        "schema": _schema_changes(today, new_rows, new_images, baseline),
    }
    result["checks"] = checks(result, thresholds)
    result["failures"] = [c["message"] for c in result["checks"].values() if c["ok"] is False]
    result["ok"] = not result["failures"]
    return result


def _baseline_summary(baseline: Snapshot | None) -> dict[str, Any]:
    if baseline is None:
        return {"first_run": True, "images": 0, "rows": 0}
    return {"first_run": False, "images": len(baseline.keys), "rows": len(baseline.rows)}


def _row_changes(metadata: pa.Table, rows: np.ndarray, new: np.ndarray,
                 baseline: Snapshot | None) -> dict[str, Any]:
    text = metadata.column("TEXT")
    empty = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(text), ""), True).to_numpy(
        zero_copy_only=False)
    removed = int((~np.isin(baseline.rows, rows)).sum()) if baseline else 0
    new_count = int(new.sum())
    new_empty = int((empty & new).sum())
    return {"total": len(rows), "new": new_count, "removed": removed, "new_empty": new_empty,
            "new_empty_share": round(new_empty / new_count, 4) if new_count else 0.0}


def _image_changes(today: Today, new: np.ndarray, baseline: Snapshot | None) -> dict[str, Any]:
    keys = today.images["key"].to_numpy(dtype=object)
    if baseline is None:
        return {"total": len(keys), "new": len(keys), "removed": 0, "kept": 0,
                "captions_changed": 0}
    before = dict(zip(baseline.keys, baseline.captions, strict=True))
    digests = caption_digests(today.images["captions"])
    changed = sum(1 for key, digest in zip(keys[~new], digests[~new], strict=True)
                  if before[key] != digest)
    return {"total": len(keys), "new": int(new.sum()), "removed":
            int((~np.isin(baseline.keys, keys)).sum()), "kept": int((~new).sum()),
            "captions_changed": changed}


def _download_of_new(catalog: pd.DataFrame, new_keys: np.ndarray) -> dict[str, Any]:
    rows = catalog[catalog["key"].isin(new_keys)]
    failed = rows[~rows["status"].isin(HELD)]
    reasons = Counter(f"{status}: {reason}" for status, reason in
                      zip(failed["status"], failed["reason"].fillna("unknown"), strict=True))
    return {"new": len(rows), "new_held": len(rows) - len(failed),
            "new_failed": int((failed["status"] == "failed").sum()),
            "new_refused": int((failed["status"] == "refused").sum()),
            "new_failure_rate": round(len(failed) / len(rows), 4) if len(rows) else 0.0,
            "top_reasons": [[reason, n] for reason, n in reasons.most_common(TOP)]}


def _caption_lengths(captions: pd.Series, new: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, mask in (("new", new), ("kept", ~new)):
        words = [len(c.split()) for caps in captions[mask] for c in (caps or [])]
        out[f"{name}_captions"] = len(words)
        out |= _percentiles(f"{name}_words", words)
    return out


def _unknown_words(captions: pd.Series, new: np.ndarray, tokenizer: Any) -> dict[str, Any]:
    if tokenizer is None:
        return {"tokenizer": None}
    new_texts = [c for caps in captions[new] for c in (caps or [])]
    kept_texts = [c for caps in captions[~new] for c in (caps or [])]
    if len(kept_texts) > KEPT_CAPTION_SAMPLE:  # the reference share, on a seeded sample
        pick = np.random.default_rng(0).choice(len(kept_texts), KEPT_CAPTION_SAMPLE, replace=False)
        kept_texts = [kept_texts[i] for i in sorted(pick)]
    unknown, words = tokenizer.unknown_words(new_texts)
    kept_unknown, kept_words = tokenizer.unknown_words(kept_texts)
    return {"tokenizer": f"{tokenizer.kind}, {tokenizer.vocab_size} ids",
            "new_words": words,
            "new_unknown_word_share": round(sum(unknown.values()) / words, 4) if words else 0.0,
            "kept_unknown_word_share": round(sum(kept_unknown.values()) / kept_words, 4)
            if kept_words else 0.0,
            "top_new_unknown_words": [[w, n] for w, n in unknown.most_common(TOP)]}


def _sizes(catalog: pd.DataFrame, keys: np.ndarray, new: np.ndarray) -> dict[str, Any]:
    held = catalog[catalog["status"].isin(HELD)].set_index("key")
    short = held[["original_width", "original_height"]].min(axis=1)
    out: dict[str, Any] = {}
    for name, mask in (("new", new), ("kept", ~new)):
        values = short.reindex(keys[mask]).dropna().astype(float).tolist()
        out |= _percentiles(f"{name}_short_side", values)
    return out


def _percentiles(prefix: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_mean": None, f"{prefix}_p5": None, f"{prefix}_p50": None,
                f"{prefix}_p95": None}
    p5, p50, p95 = np.percentile(values, [5, 50, 95])
    return {f"{prefix}_mean": round(float(np.mean(values)), 2), f"{prefix}_p5": float(p5),
            f"{prefix}_p50": float(p50), f"{prefix}_p95": float(p95)}


def _schema_changes(today: Today, new_rows: np.ndarray, new_images: np.ndarray,
                    baseline: Snapshot | None) -> dict[str, Any]:
    now = schema_of(today.metadata, new_rows, today.images["labels"][new_images])
    if baseline is None:
        return {**now, "changed": []}
    before, changed = baseline.schema, []
    if now["source_columns"] != before["source_columns"]:
        changed.append(f"the source's columns were {_columns(before['source_columns'])}, now "
                       f"{_columns(now['source_columns'])}")
    if new_rows.any() and now["populated"] != before["populated"]:
        changed.append(f"metadata columns with values: {before['populated']} before, "
                       f"{now['populated']} in the new rows")
    if new_images.any() and now["label_fields"] != before["label_fields"]:
        changed.append(f"label fields: {before['label_fields']} before, "
                       f"{now['label_fields']} in the new images")
    return {**now, "changed": changed}


def _columns(columns: list[list[str]] | None) -> str:
    if columns is None:
        return "not recorded"
    return ", ".join(f"{name} ({kind})" for name, kind in columns)


# ---------------------------------------------------------------- checks


def checks(result: dict[str, Any], limits: Thresholds) -> dict[str, dict[str, Any]]:
    """Each check: value, limit, ok (None: not checked, too few new rows) and a message."""
    download, rows = result["download"], result["rows"]
    out = {
        "new_failure_rate": _share_check(
            download["new_failure_rate"], limits.max_new_failure_rate, download["new"],
            limits.min_new, "changes.max_new_failure_rate",
            f"{download['new'] - download['new_held']:,} of {download['new']:,} new images did "
            "not arrive (failed or refused)" + _reasons(download["top_reasons"])),
        "empty_caption_share": _share_check(
            rows["new_empty_share"], limits.max_empty_caption_share, rows["new"], limits.min_new,
            "changes.max_empty_caption_share",
            f"{rows['new_empty']:,} of {rows['new']:,} new caption rows are empty"),
    }
    changed = result["schema"]["changed"]
    out["schema"] = {"value": len(changed), "limit": limits.on_schema_change,
                     "ok": not changed or limits.on_schema_change == "warn",
                     "message": "the metadata's schema changed: " + "; ".join(changed)
                     + " (changes.on_schema_change: warn accepts it)" if changed else ""}
    if limits.max_unknown_word_share is not None and result["tokens"].get("tokenizer"):
        tokens = result["tokens"]
        out["unknown_word_share"] = _share_check(
            tokens["new_unknown_word_share"], limits.max_unknown_word_share, tokens["new_words"],
            limits.min_new, "changes.max_unknown_word_share",
            f"the tokenizer ({tokens['tokenizer']}) has no token for "
            f"{tokens['new_unknown_word_share']:.1%} of the new captions' words (kept captions: "
            f"{tokens['kept_unknown_word_share']:.1%}), e.g. "
            + ", ".join(w for w, _ in tokens["top_new_unknown_words"][:5]))
    return out


def _share_check(value: float, limit: float, count: int, minimum: int, key: str,
                 what: str) -> dict[str, Any]:
    if count < minimum:
        return {"value": value, "limit": limit, "ok": None,
                "message": f"not checked: {count} new, fewer than changes.min_new {minimum}"}
    ok = value <= limit
    return {"value": value, "limit": limit, "ok": ok,
            "message": "" if ok else f"{what} ({value:.3f} > {key} {limit:g})"}


def _reasons(top: list[list[Any]]) -> str:
    return "; top reasons: " + "; ".join(f"{n:,} x {r}" for r, n in top[:3]) if top else ""


def check_passed(result: dict[str, Any]) -> None:
    """ChangesError naming every failed check."""
    if result["failures"]:
        raise ChangesError("the new data looks broken, so the run stops before training:\n  - "
                           + "\n  - ".join(result["failures"]))


def summary(result: dict[str, Any]) -> str:
    """The one-paragraph end-of-stage summary."""
    rows, images, download = result["rows"], result["images"], result["download"]
    against = ("first run: everything is new" if result["baseline"]["first_run"] else
               f"against the last accepted run ({result['baseline']['images']:,} images)")
    tokens = result["tokens"]
    unknown = (f"; {tokens['new_unknown_word_share']:.1%} of the new captions' words have no "
               f"token ({tokens['kept_unknown_word_share']:.1%} of the kept ones')"
               if tokens.get("tokenizer") else "")
    changed = result["schema"]["changed"]
    return (f"changes ({against}): images {images['new']:,} new, {images['removed']:,} removed, "
            f"{images['captions_changed']:,} with other captions; caption rows {rows['new']:,} "
            f"new ({rows['new_empty']:,} empty), {rows['removed']:,} removed; "
            f"{download['new_held']:,} of the {download['new']:,} new images arrived{unknown}; "
            f"schema {'changed: ' + '; '.join(changed) if changed else 'unchanged'}.")


def run(metadata_file: Path, images_file: Path, catalog: Catalog, tokenizer: Any, state: Path,
        metrics_file: Path, thresholds: Thresholds,
        print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Report, write the metrics, then raise ChangesError (snapshots untouched) or accept today."""
    today = Today.read(metadata_file, images_file, catalog)
    baseline, new_night = baseline_for(state, today)
    result = report(today, baseline, tokenizer, thresholds)
    write_json(metrics_file, result)
    print_fn(summary(result))
    check_passed(result)
    if new_night:
        accept(state, today)
    return result
