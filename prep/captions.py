"""Caption cleaning and dedupe: metadata (one row per caption) -> images (one row per image).

Everything is vectorised pandas, so an MSCOCO-sized file (~600k captions, ~120k images) takes
seconds. Rows are removed in a fixed order; each is counted under the first reason that applies:

    missing_url -> disallowed_scheme -> empty_caption -> short_caption -> exact_duplicate
    -> duplicate_caption -> not_first_caption (only with keep="first")
"""

from __future__ import annotations

import json
import time
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from clipms.utils.atomic import atomic_write
from prep.identity import (
    Identity,
    IdentityError,
    assign_splits,
    image_identities,
    stable_keys,
)
from prep.urlguard import SCHEME_PATTERN

URL_COL = "URL"
TEXT_COL = "TEXT"
LABELS_COL = "LABELS"
ID_COL = "ID"  # optional: an image id from the source (metadata.id_col), for identity "id"
SPLIT_COL = "SPLIT"  # optional: train/val from a split file (metadata.karpathy_split)
REASONS = (
    "missing_url", "disallowed_scheme", "empty_caption", "short_caption",
    "exact_duplicate", "duplicate_caption", "not_first_caption",
)
IMAGE_COLUMNS = ["url", "key", "caption", "captions", "split", "labels"]
IMAGES_SCHEMA = pa.schema([  # the data/images.parquet contract, also when it is empty
    ("url", pa.string()), ("key", pa.string()), ("caption", pa.string()),
    ("captions", pa.list_(pa.string())), ("split", pa.string()), ("labels", pa.string()),
])

KeepMode = Literal["all", "first"]


class MetadataError(ValueError):
    """The metadata file is missing, unreadable or lacks a required column."""


@dataclass
class DedupeResult:
    images: pd.DataFrame                       # IMAGE_COLUMNS, one row per image
    stats: dict[str, Any] = field(default_factory=dict)


def normalise_captions(captions: pd.Series) -> pd.Series:
    """Unicode NFC, any whitespace run (tabs, newlines, NBSP) -> one space, stripped; nulls stay."""
    return _to_series(_normalise(_strings(captions)), captions.index)


def comparison_keys(normalised: pd.Series) -> pd.Series:
    """What two captions must share to count as the same: compatibility forms folded (NFKC:
    the `ﬁ` ligature is `fi`, fullwidth `ＡＢＣ` is `ABC`), lower-cased, punctuation deleted."""
    return _to_series(_comparison(_strings(normalised)), normalised.index)


# The string work runs in Arrow's C++ kernels (RE2 regexes): pandas' .str methods loop in Python
# (docs/data-pipeline.md, "Measurements behind the code"). RE2's \w/\s are ASCII-only, hence the
# Unicode classes.
# Whitespace that must become one plain space: runs of 2+, or any single whitespace character other
# than U+0020. Matching every lone space too (`[\s\p{Z}]+`) gives the same result at a multiple of
# the cost, since nearly every caption is full of single spaces that would each be "replaced".
_OTHER_SPACES = (r"\t\n\x{0B}\f\r\x{1C}-\x{1F}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}"
                 r"\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}")  # = Python's str.isspace() minus " "
_WHITESPACE_TO_FIX = rf"[\s{_OTHER_SPACES}]{{2,}}|[{_OTHER_SPACES}]"


def _normalise(text: pa.Array) -> pa.Array:
    text = _nfc(text)
    return pc.utf8_trim_whitespace(pc.replace_substring_regex(text, _WHITESPACE_TO_FIX, " "))


def _nfc(text: pa.Array, form: Literal["NFC", "NFKC"] = "NFC") -> pa.Array:
    """Unicode NFC (or `form`). Arrow 18's utf8_normalize leaves NFC/NFD input unchanged ('e' +
    U+0301 stays two code points), so Python's unicodedata does it, only for the (rare)
    non-ASCII captions."""
    non_ascii = pc.fill_null(pc.match_substring_regex(text, r"[^\x00-\x7F]"), False)
    if not pc.any(non_ascii).as_py():
        return text
    composed = [unicodedata.normalize(form, s) for s in text.filter(non_ascii).to_pylist()]
    return pc.replace_with_mask(text, non_ascii, pa.array(composed, type=pa.string()))


def _comparison(normalised: pa.Array) -> pa.Array:
    # NFKC for comparing only: the kept caption keeps its own characters (NFC), but captions that
    # differ by a ligature, a fullwidth or a superscript form are the same caption.
    folded = _nfc(normalised, "NFKC")
    folded = pc.replace_substring_regex(pc.utf8_lower(folded), r"[^\pL\pN\pM ]", "")
    return pc.utf8_trim_whitespace(pc.replace_substring_regex(folded, "  +", " "))


def _strings(values: pd.Series) -> pa.Array:
    """A pandas column as an Arrow string array (numbers etc. are stringified, nulls kept)."""
    try:
        return pa.array(values, type=pa.string(), from_pandas=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        as_text = values.astype(object).where(values.isna(), values.astype(str))
        return pa.array(as_text, type=pa.string(), from_pandas=True)


def _to_series(values: pa.Array, index: pd.Index) -> pd.Series:
    return pd.Series(values.to_numpy(zero_copy_only=False), index=index, dtype=object)


def scheme_array(urls: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Lower-cased URL scheme of each URL ('' when there is none, e.g. ' file://' or '/etc/x'),
    by the download's one scheme rule (`urlguard.SCHEME_PATTERN`), vectorised in Arrow."""
    found = pc.extract_regex(urls, SCHEME_PATTERN)
    return pc.fill_null(pc.utf8_lower(pc.struct_field(found, [0])), "")


def read_metadata(path: Path | str) -> pa.Table:
    """Read metadata.parquet as an Arrow table (dedupe works on Arrow: no pandas round trip); a
    clear error for a missing/unreadable file or missing columns."""
    path = Path(path)
    if not path.is_file():
        raise MetadataError(f"{path}: metadata file not found (run the metadata stage first)")
    try:
        table = pq.read_table(str(path))  # a path, not a file object: see download.read_parquet
    except Exception as err:  # pyarrow raises several unrelated types for a bad file
        raise MetadataError(f"{path}: not a readable parquet file ({err})") from err
    missing = [c for c in (URL_COL, TEXT_COL) if c not in table.column_names]
    if missing:
        raise MetadataError(
            f"{path}: missing column(s) {missing}; found {table.column_names} "
            f"(expected {URL_COL!r} and {TEXT_COL!r}, one row per caption)"
        )
    return table


def dedupe(
    metadata: pd.DataFrame | pa.Table,
    allowed_schemes: Iterable[str],
    min_caption_chars: int = 5,
    keep: KeepMode = "all",
    val_fraction: float = 0.1,
    split_salt: str = "clipms",
    identity: Identity = "path",
    log: Callable[[str], None] = print,
) -> DedupeResult:
    """Clean, dedupe and group captions by image; stable keys and a train/val split by image."""
    tick = _ticker(log, time.perf_counter())
    urls = pc.utf8_trim_whitespace(_column(metadata, URL_COL))
    raw = _column(metadata, TEXT_COL)
    captions = _normalise(raw)
    tick(f"normalised {len(metadata):,} captions")

    rules = _Rules(len(metadata))
    rules.drop("missing_url", _null_or_empty(urls))
    schemes = scheme_array(urls)
    rules.drop("disallowed_scheme", ~_np(pc.is_in(schemes, value_set=pa.array(
        sorted({s.lower() for s in allowed_schemes}), type=pa.string()))))
    rules.drop("empty_caption", _null_or_empty(captions))
    rules.drop("short_caption", _np(pc.fill_null(pc.utf8_length(captions), 0)) < min_caption_chars)
    rules.drop_duplicates("exact_duplicate", urls, raw)
    rules.drop_duplicates("duplicate_caption", urls, _comparison(captions))
    if keep == "first":
        rules.drop_duplicates("not_first_caption", urls)
    else:
        rules.removed["not_first_caption"] = 0
    tick(f"applied the dedupe rules, {int(rules.keep.sum()):,} captions kept")

    rows = np.flatnonzero(rules.keep)
    images = _group_by_image(urls.take(rows), captions.take(rows))
    images["labels"] = _first_by_url(images["url"], urls, _labels(metadata))
    given = _given_splits(images["url"], urls, metadata)
    images, same = _by_identity(images, identity, _first_by_url(images["url"], urls, _optional(
        metadata, ID_COL)) if identity == "id" else None, val_fraction, split_salt, given)
    if given is not None:
        tick("split from the metadata's SPLIT column (a split file), not by hash")
    if same:
        log(f"dedupe: warning: {same:,} images share their identity (dedupe.identity: "
            f"{identity}) with an earlier image and were dropped as copies; if distinct images "
            f"differ only in host or query string, set dedupe.identity: url")
    tick(f"grouped into {len(images):,} images")
    stats = _stats(len(metadata), urls, images, rules.removed)
    return DedupeResult(images=images, stats={**stats, "same_identity": same})


def _by_identity(images: pd.DataFrame, identity: Identity, ids: np.ndarray | None,
                 val_fraction: float, salt: str,
                 given: np.ndarray | None = None) -> tuple[pd.DataFrame, int]:
    """Keys and splits from each image's identity (the split: `given` per image, when a split
    file decided it); a later image whose identity was already seen (the same image from another
    host, with identity path) is dropped. -> (images, dropped)."""
    id_array = None if ids is None else pa.array(ids, type=pa.string(), from_pandas=True)
    try:
        names = image_identities(pa.array(images["url"], type=pa.string()), identity, id_array)
    except IdentityError as err:
        raise MetadataError(str(err)) from err
    names = pd.Series(names.to_numpy(zero_copy_only=False), dtype=object)
    first = ~names.duplicated().to_numpy()
    images, names = images[first].reset_index(drop=True), names[first]
    images["key"] = stable_keys(names)
    images["split"] = (assign_splits(names, val_fraction, salt) if given is None
                       else given[first])
    return images[IMAGE_COLUMNS], int((~first).sum())


class _Rules:
    """The keep-mask over metadata rows, and how many rows each rule removed (first reason wins)."""

    def __init__(self, rows: int) -> None:
        self.keep = np.ones(rows, dtype=bool)
        self.removed: dict[str, int] = {}

    def drop(self, reason: str, mask: np.ndarray) -> None:
        hit = mask & self.keep
        self.removed[reason] = int(hit.sum())
        self.keep &= ~hit

    def drop_duplicates(self, reason: str, *columns: pa.Array) -> None:
        """Drop kept rows whose values in `columns` equal those of an earlier kept row."""
        rows = np.flatnonzero(self.keep)
        combined = np.zeros(len(rows), dtype=np.int64)
        for column in columns:
            codes = _np(pc.fill_null(column.take(rows).dictionary_encode().indices, -1))
            combined = combined * (int(codes.max(initial=0)) + 2) + codes + 1
        mask = np.zeros_like(self.keep)
        mask[rows] = pd.Series(combined).duplicated().to_numpy()
        self.drop(reason, mask)


def _np(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return values.to_numpy(zero_copy_only=False)


def _null_or_empty(values: pa.Array) -> np.ndarray:
    return _np(pc.fill_null(pc.equal(values, ""), True))


def _group_by_image(urls: pa.Array, captions: pa.Array) -> pd.DataFrame:
    """One row per URL, in order of first appearance; captions in their original order."""
    encoded = urls.dictionary_encode()
    codes = _np(encoded.indices)
    order = np.argsort(codes, kind="stable")
    offsets = np.zeros(len(encoded.dictionary) + 1, dtype=np.int32)
    np.cumsum(np.bincount(codes, minlength=len(encoded.dictionary)), out=offsets[1:])
    grouped = captions.take(pa.array(order))
    captions_list = pa.ListArray.from_arrays(pa.array(offsets), grouped)
    images = pd.DataFrame({
        "url": _np(encoded.dictionary).astype(object),
        "caption": _np(grouped.take(pa.array(offsets[:-1]))).astype(object),
        "captions": pd.Series(captions_list, dtype=pd.ArrowDtype(captions_list.type)),
    })
    return images


def _first_by_url(image_urls: pd.Series, urls: pa.Array, values: pa.Array | None) -> np.ndarray:
    """Each image's first non-null value (LABELS, ID) over all its metadata rows (dropped ones
    too)."""
    if values is None:
        return np.full(len(image_urls), None, dtype=object)
    firsts = pa.table({"url": urls, "value": values}).group_by("url", use_threads=False).aggregate(
        [("value", "first")])
    where = pc.index_in(pa.array(image_urls, type=pa.string()), value_set=firsts["url"])
    return _np(firsts["value_first"].take(where)).astype(object)


def _optional(metadata: pd.DataFrame | pa.Table, name: str) -> pa.Array | None:
    names = metadata.column_names if isinstance(metadata, pa.Table) else metadata.columns
    return _column(metadata, name) if name in names else None


def _given_splits(image_urls: pd.Series, urls: pa.Array,
                  metadata: pd.DataFrame | pa.Table) -> np.ndarray | None:
    """Each image's split from the SPLIT column, or None when the column is absent or empty."""
    column = _optional(metadata, SPLIT_COL)
    if column is None or column.null_count == len(column):
        return None
    given = _first_by_url(image_urls, urls, column)
    bad = sorted({str(v) for v in given if v not in ("train", "val")})
    if bad:
        raise MetadataError(f"{SPLIT_COL} column: every image needs 'train' or 'val', found "
                            f"{bad[:5]}")
    return given


def _column(metadata: pd.DataFrame | pa.Table, name: str) -> pa.Array:
    """One column as an Arrow string array, whichever container it came in."""
    if isinstance(metadata, pd.DataFrame):
        return _strings(metadata[name])
    column = metadata.column(name).combine_chunks()
    if column.type == pa.string():
        return column
    try:
        return pc.cast(column, pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return _strings(column.to_pandas())


def _labels(metadata: pd.DataFrame | pa.Table) -> pa.Array | None:
    """LABELS as JSON strings (dicts are serialised; nulls stay null), or None when absent."""
    if isinstance(metadata, pa.Table):
        if LABELS_COL not in metadata.column_names:
            return None
        column = metadata.column(LABELS_COL).combine_chunks()
        if column.type in (pa.string(), pa.null()):
            return column.cast(pa.string())
        metadata = pd.DataFrame({LABELS_COL: column.to_pylist()})
    if LABELS_COL not in metadata.columns:
        return None
    labels = metadata[LABELS_COL].astype(object)
    not_str = labels.notna() & ~labels.map(lambda v: isinstance(v, str))
    if not_str.any():
        labels = labels.copy()
        labels[not_str] = labels[not_str].map(lambda v: json.dumps(v, sort_keys=True))
    return pa.array(labels, type=pa.string(), from_pandas=True)


def _stats(rows_in: int, urls: pa.Array, images: pd.DataFrame,
           removed: dict[str, int]) -> dict[str, Any]:
    named = urls.filter(pc.not_equal(urls, ""))  # a blank URL is no image
    images_in = int(pc.count_distinct(named, mode="only_valid").as_py())
    return {
        "rows_in": rows_in,
        "images_in": images_in,
        "images_out": len(images),
        "images_removed": images_in - len(images),
        "captions_kept": int(images["captions"].list.len().sum()) if len(images) else 0,
        "train_images": int((images["split"] == "train").sum()),
        "val_images": int((images["split"] == "val").sum()),
        "removed": {reason: removed.get(reason, 0) for reason in REASONS},
    }


def check_usable(stats: dict[str, Any]) -> None:
    """MetadataError when nothing useful is left: no image at all, or an empty split (a run would
    only fail stages later, after the download)."""
    if not stats["images_out"]:
        removed = ", ".join(f"{k} {v:,}" for k, v in stats["removed"].items() if v) or "none"
        raise MetadataError(f"no image left after dedupe ({stats['rows_in']:,} caption rows in; "
                            f"rows removed: {removed}); check the metadata and "
                            f"download.allowed_schemes")
    for split in ("train", "val"):
        if not stats[f"{split}_images"]:
            raise MetadataError(f"the {split} split is empty ({stats['images_out']:,} images, "
                                f"dedupe.val_fraction decides the split); use more images or "
                                f"another val_fraction")


def summary(stats: dict[str, Any], seconds: float) -> str:
    """The one-paragraph end-of-stage summary."""
    reasons = ", ".join(f"{k} {v:,}" for k, v in stats["removed"].items() if v) or "nothing"
    return (
        f"dedupe: {stats['rows_in']:,} caption rows for {stats['images_in']:,} images in "
        f"{seconds:.1f} s -> {stats['images_out']:,} images ({stats['train_images']:,} train, "
        f"{stats['val_images']:,} val) with {stats['captions_kept']:,} captions. Removed rows: "
        f"{reasons}; {stats['images_removed']:,} images removed ({stats['same_identity']:,} of "
        f"them copies of an image already kept, by identity)."
    )


def _ticker(log: Callable[[str], None], started: float) -> Callable[[str], None]:
    def tick(message: str) -> None:
        log(f"dedupe: {message} ({time.perf_counter() - started:.1f} s)")
    return tick


def write_images(images: pd.DataFrame, path: Path | str) -> None:
    """Write images.parquet atomically (a killed stage never leaves half a file)."""
    table = pa.Table.from_pandas(images[IMAGE_COLUMNS], schema=IMAGES_SCHEMA, preserve_index=False)
    with atomic_write(path) as tmp:
        # No pandas metadata: it would name the Arrow list dtype, which pandas cannot read back.
        pq.write_table(table.replace_schema_metadata(None), tmp)
