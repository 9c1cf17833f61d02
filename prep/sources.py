"""Caption metadata from one of three sources -> `data/metadata.parquet` (URL, TEXT, LABELS, ID).

- `synthetic`: the generated MSCOCO look-alike (`prep.synthetic`), images written next to it.
- `mscoco`: the public MSCOCO 2017 URL/TEXT parquet, downloaded with retries and a checksum.
- `local`: any parquet (a path or an http(s) URL) whose URL/caption columns are named in params.

One row per caption, as MSCOCO's file: URL, TEXT, LABELS (a JSON string of the generator's
attributes for synthetic rows, null otherwise) and ID (the source's `metadata.id_col` column, for
`dedupe.identity: id`; null when none is named). The source's own columns and their types are kept
in the file's metadata (`prep.sourceschema`), so that a later stage can
tell when the source's schema changed. The file is written atomically and deterministically: the
same inputs give the same bytes.
"""

from __future__ import annotations

import hashlib
import http.client
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from clipms.utils.atomic import atomic_write
from clipms.utils.redact import redact_text, redact_url
from prep import karpathy, synthetic
from prep.sourceschema import kept_metadata, with_source_columns
from prep.urlguard import FetchPolicy, RefusedURL, build_opener, check_url

MSCOCO_URL = ("https://huggingface.co/datasets/ChristophSchuhmann/MS_COCO_2017_URL_TEXT/resolve/"
              "main/mscoco.parquet")
SOURCES = ("synthetic", "mscoco", "local")
# SPLIT: train/val from a split file (metadata.karpathy_split), null otherwise (dedupe then
# splits by a hash of each image's identity).
SCHEMA = pa.schema([("URL", pa.string()), ("TEXT", pa.string()), ("LABELS", pa.string()),
                    ("ID", pa.string()), ("SPLIT", pa.string())])
_CHUNK = 1 << 20


class MetadataError(RuntimeError):
    """Metadata could not be obtained: unreachable, wrong checksum, unreadable or bad columns."""


@dataclass(frozen=True)
class MetadataSpec:
    """What to fetch; the fields mirror the `metadata` section of params.yaml."""

    source: str = "synthetic"
    num_images: int = 2000
    synthetic_image_size: int = 128
    seed: int = 0
    synthetic_captions: str = "templates"  # templates | mscoco (MSCOCO's caption lengths)
    synthetic_val_images: int | None = None  # the last N images are val (None: dedupe decides)
    synthetic_url: str | None = None  # a base URL serving data/synthetic (None: file: URLs)
    url: str = MSCOCO_URL
    sha256: str | None = None
    retries: int = 3
    timeout: float = 60.0
    path: str | None = None
    url_col: str = "URL"
    caption_col: str = "TEXT"
    id_col: str | None = None  # a source column naming each image (for dedupe.identity: id)
    karpathy_split: str | None = None  # mscoco/local: dataset_coco.json (path or http(s) URL)
    # mscoco/local: a parquet with more rows is refused from its footer, before it is read (a
    # few KB of dictionary-encoded parquet can hold 20 million rows; ~1 GB of memory per million)
    max_rows: int = 5_000_000
    # mscoco/local: the text of one value (a URL, a caption, ...) and of the whole file, in bytes:
    # 1000 rows of one dictionary-encoded 1 MiB caption are a parquet of under 1 KB that holds
    # 1 GiB of text. Checked from the footer, then on the dictionaries, before decoding.
    max_text_bytes: int = 65_536
    max_total_text_bytes: int = 1 << 30


@dataclass(frozen=True)
class TextLimits:
    """How much text a source parquet may hold (`MetadataSpec.max_text_bytes`,
    `max_total_text_bytes`)."""

    per_value: int
    total: int

    @classmethod
    def of(cls, spec: MetadataSpec) -> TextLimits:
        return cls(spec.max_text_bytes, spec.max_total_text_bytes)


@dataclass(frozen=True)
class MetadataSummary:
    source: str
    rows: int
    images: int
    exact_duplicates: int  # rows repeating an earlier (URL, TEXT) pair verbatim
    # rows equal to an earlier caption of the same image up to case, spacing and punctuation
    near_duplicates: int
    labelled_rows: int
    seconds: float
    out_path: str
    split_note: str = ""  # what a split file decided

    def paragraph(self) -> str:
        return (f"metadata: {self.rows} caption rows for {self.images} images from source "
                f"'{self.source}' written to {self.out_path} in {self.seconds:.1f} s; "
                f"{self.exact_duplicates} rows are exact duplicates and {self.near_duplicates} "
                f"near-duplicates (case/spacing/punctuation) of another caption of the same image, "
                f"left for the dedupe stage; {self.labelled_rows} rows carry LABELS."
                + (f" {self.split_note}" if self.split_note else ""))


def build_metadata(spec: MetadataSpec, out_path: Path | str, synthetic_dir: Path | str,
                   policy: FetchPolicy, backoff_seconds: float = 1.0) -> MetadataSummary:
    """Fetch or generate the metadata of `spec.source` and write it to `out_path`; an http(s)
    `url`/`path` is fetched under `policy` (the download stage's URL rule, `prep.urlguard`).

    `synthetic_dir` is recreated for every source, so that it always exists as the declared output
    (empty unless the source is synthetic). Keep it relative to the working directory: synthetic
    URLs embed it (`file:data/synthetic/000001.png`) and must not depend on the checkout. On an
    error, the previous outputs are left as they were.
    """
    start = time.monotonic()
    out_path, synthetic_dir = Path(out_path), Path(synthetic_dir)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if spec.source == "synthetic":
        _reset_dir(synthetic_dir)
        table = synthetic_table(spec, synthetic_dir)
    elif spec.source == "mscoco":
        table = _fetch_parquet(spec.url, out_path.parent, spec, "URL", "TEXT", policy,
                               backoff_seconds)
        _reset_dir(synthetic_dir)
    elif spec.source == "local":
        table = local_table(spec, out_path.parent, policy, backoff_seconds)
        _reset_dir(synthetic_dir)
    else:
        raise MetadataError(f"metadata.source = {spec.source!r}: expected one of {SOURCES}")
    note = ""
    if spec.karpathy_split:
        table, note = karpathy_table(table, spec, out_path.parent, policy, backoff_seconds)
    write_table(table, out_path)
    return replace(summarise(table, spec.source, out_path, time.monotonic() - start),
                   split_note=note)


def karpathy_table(table: pa.Table, spec: MetadataSpec, work_dir: Path, policy: FetchPolicy,
                   backoff_seconds: float) -> tuple[pa.Table, str]:
    """SPLIT from Karpathy's dataset_coco.json (`prep.karpathy`): its test images `val`."""
    if spec.source == "synthetic":
        raise MetadataError("metadata.karpathy_split applies to COCO URLs (source mscoco or "
                            "local), not to the synthetic source")
    source = spec.karpathy_split
    with tempfile.TemporaryDirectory(dir=work_dir, prefix=".metadata-download-") as scratch:
        if source.startswith(("http://", "https://")):
            path = Path(scratch) / "dataset_coco.json"
            download(source, path, policy=policy, timeout=spec.timeout, retries=spec.retries,
                     backoff_seconds=backoff_seconds)
        else:
            path = Path(source)
        try:
            test = karpathy.test_ids(path)
        except ValueError as err:
            raise MetadataError(f"metadata.karpathy_split: {err}") from err
    column, found = karpathy.splits(table["URL"], test)
    note = (f"Split from {source}: {found} of its {len(test)} test images are in the metadata "
            f"and form the val split; every other image is train.")
    if found < len(test):
        print(f"metadata: warning: only {found} of the {len(test)} Karpathy test images are in "
              f"the metadata (matched by the COCO image id in each URL's file name)", flush=True)
    return table.set_column(SCHEMA.get_field_index("SPLIT"), "SPLIT", column), note


def _reset_dir(path: Path) -> None:
    """An empty `path`: images of an earlier, larger run must not linger."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


# ---------------------------------------------------------------------------------------------
# Sources


def synthetic_table(spec: MetadataSpec, image_dir: Path) -> pa.Table:
    """Generate the synthetic images into `image_dir` and return one row per caption.

    URLs are `file:` URLs of the images, or `synthetic_url` + file name when a server (a loopback
    mirror of `image_dir`) is to be downloaded from; with `synthetic_val_images` the last images
    are the val split (as a split file would say), otherwise SPLIT is left to dedupe."""
    records = synthetic.generate(image_dir, spec.num_images, spec.synthetic_image_size, spec.seed,
                                 spec.synthetic_captions)
    first_val = spec.num_images - (spec.synthetic_val_images or 0)
    urls, texts, labels, splits = [], [], [], []
    for position, record in enumerate(records):
        url = synthetic_image_url(spec.synthetic_url, image_dir, record.file_name)
        split = "val" if position >= first_val else "train"
        for caption in record.captions:
            urls.append(url)
            texts.append(caption)
            labels.append(record.labels_json)
            splits.append(split)
    nulls = pa.nulls(len(urls), pa.string())
    split_column = pa.array(splits, pa.string()) if spec.synthetic_val_images else nulls
    table = pa.table({"URL": urls, "TEXT": texts, "LABELS": labels, "ID": nulls,
                      "SPLIT": split_column}, schema=SCHEMA)
    return with_source_columns(table, SCHEMA)


def synthetic_image_url(base_url: str | None, image_dir: Path, file_name: str) -> str:
    """Where the download stage fetches a synthetic image: a `file:` URL, or under `base_url`."""
    if base_url is None:
        return file_url(image_dir / file_name)
    return base_url.rstrip("/") + "/" + file_name


def file_url(path: Path) -> str:
    """`file:` URL of a path, kept relative when the path is relative (urllib resolves it against
    the working directory), so the URL - and the train/val split hashed from it - is the same in
    every checkout. An absolute path gives `file:/abs/path`."""
    return "file:" + urllib.request.pathname2url(path.as_posix())


def local_table(spec: MetadataSpec, work_dir: Path, policy: FetchPolicy,
                backoff_seconds: float) -> pa.Table:
    """A user's parquet (path or http(s) URL), its `url_col`/`caption_col` renamed to URL/TEXT."""
    if not spec.path:
        raise MetadataError("metadata.path must be set when metadata.source is 'local' "
                            "(a parquet file path or an http(s) URL)")
    if spec.path.startswith(("http://", "https://")):
        return _fetch_parquet(spec.path, work_dir, spec, spec.url_col, spec.caption_col, policy,
                              backoff_seconds)
    path = Path(spec.path)
    if not path.is_file():
        raise MetadataError(f"metadata.path = {redact_text(repr(spec.path))}: no such file")
    if spec.sha256:
        verify_sha256(path, spec.sha256)
    return read_captions(path, spec.url_col, spec.caption_col, spec.id_col,
                         max_rows=spec.max_rows, text_limits=TextLimits.of(spec))


def _fetch_parquet(url: str, work_dir: Path, spec: MetadataSpec, url_col: str, caption_col: str,
                   policy: FetchPolicy, backoff_seconds: float) -> pa.Table:
    """Download a parquet next to the output, read the caption columns, delete the download."""
    with tempfile.TemporaryDirectory(dir=work_dir, prefix=".metadata-download-") as scratch:
        tmp = Path(scratch) / "download.parquet"
        download(url, tmp, policy=policy, timeout=spec.timeout, retries=spec.retries,
                 sha256=spec.sha256, backoff_seconds=backoff_seconds)
        return read_captions(tmp, url_col, caption_col, spec.id_col, shown_name=redact_url(url),
                             max_rows=spec.max_rows, text_limits=TextLimits.of(spec))


# ---------------------------------------------------------------------------------------------
# Download with retries and checksum


def download(url: str, dest: Path, *, policy: FetchPolicy, timeout: float, retries: int,
             sha256: str | None = None, backoff_seconds: float = 1.0) -> str:
    """Download `url` to `dest` (via a temp file + rename) under `policy`; return its sha256.

    Connection errors, timeouts and HTTP 5xx/429 are retried `retries` times with exponential
    backoff; other HTTP errors, a URL the policy refuses (scheme, address, redirect) and a checksum
    mismatch fail at once, since retrying cannot fix them.
    """
    last_error: Exception | None = None
    shown = redact_url(url)  # printed and raised: no credentials, signature or token
    print(f"metadata: downloading {shown}", flush=True)
    opener = build_opener(replace(policy, max_bytes=None))  # streamed to disk, not to memory
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_seconds * 2 ** (attempt - 1))
        try:
            check_url(url, policy)
            digest = _download_once(opener, url, dest, timeout)
        except urllib.error.HTTPError as err:
            if err.code < 500 and err.code != 429:
                raise MetadataError(f"downloading {shown}: HTTP {err.code} {err.reason}") from err
            last_error = err
        except (RefusedURL, urllib.error.URLError) as err:
            refused = err if isinstance(err, RefusedURL) else err.reason
            if isinstance(refused, RefusedURL) and refused.reason != "unresolvable_host":
                raise MetadataError(f"downloading {shown}: {redact_text(str(refused))}") from err
            last_error = err  # DNS may come back: retried like a connection error
        except (OSError, http.client.HTTPException) as err:  # refused, DNS, timeout, cut short
            last_error = err
        else:
            if sha256 and digest != sha256.lower():
                dest.unlink(missing_ok=True)
                raise MetadataError(f"checksum mismatch for {shown}: sha256 is {digest}, "
                                    f"metadata.sha256 expects {sha256.lower()}")
            return digest
        print(f"metadata: download attempt {attempt + 1}/{retries + 1} of {shown} failed: "
              f"{_reason(last_error)}", flush=True)
    raise MetadataError(
        f"could not download {shown} after {retries + 1} attempts (last error: "
        f"{_reason(last_error)}). Offline or unreachable? Use metadata.source: synthetic, or fetch "
        f"the file elsewhere and set metadata.source: local with metadata.path.")


def _download_once(opener: urllib.request.OpenerDirector, url: str, dest: Path,
                   timeout: float) -> str:
    digest = hashlib.sha256()
    request = urllib.request.Request(url, headers={"User-Agent": "clipms-metadata"})
    with atomic_write(dest) as tmp, open(tmp, "wb") as handle, \
            opener.open(request, timeout=timeout) as response:
        expected = response.headers.get("Content-Length")
        received = 0
        while chunk := response.read(_CHUNK):
            digest.update(chunk)
            handle.write(chunk)
            received += len(chunk)
        # http.client ends a chunked read quietly when the server hangs up early: check the size.
        if expected is not None and received != int(expected):
            raise ConnectionError(f"connection closed after {received} of {expected} bytes")
    return digest.hexdigest()


def _reason(err: Exception | None) -> str:
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code} {err.reason}"
    if isinstance(err, urllib.error.URLError):
        return redact_text(str(err.reason))
    return redact_text(repr(err))


def verify_sha256(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected.lower():
        raise MetadataError(f"checksum mismatch for {path}: sha256 is {digest.hexdigest()}, "
                            f"metadata.sha256 expects {expected.lower()}")


# ---------------------------------------------------------------------------------------------
# Reading and writing


def read_captions(path: Path, url_col: str, caption_col: str, id_col: str | None = None,
                  shown_name: str | None = None, max_rows: int | None = None,
                  text_limits: TextLimits | None = None) -> pa.Table:
    """The URL/caption columns of a parquet as URL, TEXT (strings), LABELS (kept if present) and
    ID (the `id_col` column, if one is named); a file of more than `max_rows` rows is refused
    from its footer, before a row is read, and one of more text than `text_limits` before its
    text is decoded (`_check_text`)."""
    name = shown_name or str(path)
    try:
        footer = pq.read_metadata(path)
        schema = footer.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as err:
        raise MetadataError(f"{name}: not a readable parquet file ({err})") from err
    if max_rows is not None and footer.num_rows > max_rows:
        raise MetadataError(f"{name}: {footer.num_rows:,} rows, over metadata.max_rows "
                            f"({max_rows:,}); raise it if the file is meant (reading takes about "
                            f"1 GB of memory per million rows)")
    named = {"URL": url_col, "TEXT": caption_col, "ID": id_col,
             "LABELS": "LABELS" if "LABELS" in schema.names else None}
    missing = [c for c in named.values() if c is not None and c not in schema.names]
    if missing:
        raise MetadataError(
            f"{name}: missing column(s) {missing} (set metadata.url_col / metadata.caption_col / "
            f"metadata.id_col); columns found: {schema.names}")
    wanted = list(dict.fromkeys(c for c in named.values() if c is not None))
    texts = [c for c in wanted if _is_text(schema.field(c).type)]
    if text_limits is not None:
        _check_stored_text(footer, wanted, text_limits.total, name)
    try:  # text columns kept dictionary-encoded: a repeated value is held once until checked
        table = pq.read_table(path, columns=wanted, read_dictionary=texts)
    except (pa.ArrowException, OSError) as err:
        raise MetadataError(f"{name}: could not read columns {wanted} ({err})") from err
    if text_limits is not None:
        _check_text(table, texts, text_limits, name)
    columns = {out: table[named[out]] if named.get(out) else pa.nulls(table.num_rows, pa.string())
               for out in SCHEMA.names}
    try:
        read = pa.table({k: pc.cast(v, pa.string()) for k, v in columns.items()}, schema=SCHEMA)
    except pa.ArrowException as err:
        raise MetadataError(f"{name}: columns {wanted} cannot be read as text ({err})") from err
    return with_source_columns(read, schema)


def _is_text(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):  # a file written from Arrow keeps its dictionary type
        kind = kind.value_type
    return any(check(kind) for check in (pa.types.is_string, pa.types.is_large_string,
                                         pa.types.is_binary, pa.types.is_large_binary))


_RAISE_IT = "raise it if the file is meant (decoded, text takes several times its size in memory)"


def _check_stored_text(footer: pq.FileMetaData, wanted: list[str], limit: int,
                       name: str) -> None:
    """MetadataError when the columns' pages alone (uncompressed, as the footer records them)
    hold more than `limit` bytes: a plain-encoded column whose zstd hid the size."""
    stored = 0
    for group in range(footer.num_row_groups):
        row_group = footer.row_group(group)
        for i in range(row_group.num_columns):
            if row_group.column(i).path_in_schema.split(".")[0] in wanted:
                stored += row_group.column(i).total_uncompressed_size
    if stored > limit:
        raise MetadataError(f"{name}: columns {wanted} hold {stored:,} bytes uncompressed, over "
                            f"metadata.max_total_text_bytes ({limit:,}); {_RAISE_IT}")


def _check_text(table: pa.Table, texts: list[str], limits: TextLimits, name: str) -> None:
    """MetadataError when a text value is longer than `limits.per_value` bytes or the text
    columns decode to more than `limits.total` bytes, computed on the dictionaries (each
    distinct value measured once, then counted per row) before anything is decoded."""
    total = 0
    for column in texts:
        for chunk in table[column].chunks:
            if pa.types.is_dictionary(chunk.type):
                lengths = pc.binary_length(chunk.dictionary)
                used = pc.take(lengths, chunk.indices)
            else:
                used = pc.binary_length(chunk)
            longest = pc.max(used).as_py() or 0
            if longest > limits.per_value:
                raise MetadataError(
                    f"{name}: column '{column}' holds a value of {longest:,} bytes, over "
                    f"metadata.max_text_bytes ({limits.per_value:,}); {_RAISE_IT}")
            total += pc.sum(used).as_py() or 0
    if total > limits.total:
        raise MetadataError(f"{name}: columns {texts} hold {total:,} bytes of text, over "
                            f"metadata.max_total_text_bytes ({limits.total:,}); {_RAISE_IT}")


def write_table(table: pa.Table, out_path: Path) -> None:
    """Write atomically. Fixed schema, codec and row-group size, no pandas metadata (only the
    source's columns): the same rows give the same bytes (with the pinned pyarrow)."""
    with atomic_write(out_path) as tmp:
        pq.write_table(table.cast(SCHEMA).replace_schema_metadata(kept_metadata(table)), tmp,
                       compression="zstd", row_group_size=1 << 20)


def caption_key(text: pa.ChunkedArray) -> pa.ChunkedArray:
    """Captions compared case-, spacing- and punctuation-insensitively (for counting only)."""
    lowered = pc.utf8_lower(pc.fill_null(text, ""))
    no_punct = pc.replace_substring_regex(lowered, r"[^\w\s]", "")
    return pc.utf8_trim_whitespace(pc.replace_substring_regex(no_punct, r"\s+", " "))


def summarise(table: pa.Table, source: str, out_path: Path, seconds: float) -> MetadataSummary:
    frame = table.to_pandas()
    frame["KEY"] = caption_key(table["TEXT"]).to_pandas()
    exact = int(frame.duplicated(["URL", "TEXT"]).sum())
    near = int(frame.duplicated(["URL", "KEY"]).sum()) - exact
    return MetadataSummary(source=source, rows=table.num_rows, images=int(frame["URL"].nunique()),
                           exact_duplicates=exact, near_duplicates=near,
                           labelled_rows=int(frame["LABELS"].notna().sum()), seconds=seconds,
                           out_path=str(out_path))
