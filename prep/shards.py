"""Validate downloaded webdataset samples and rewrite them as train/val shards with a manifest.

Input: img2dataset's `NNNNN.tar` files, in a local folder or at an fsspec URL (`<k>.jpg`,
`<k>.txt`, `<k>.json` carrying our `captions`, `split`, `image_key`, `labels`). With a catalog
(`prep.catalog.TarInput`s: the pipeline's case) only the tars it names are read, only the
images it lists are taken from them, and each sample's captions, split, labels and URL are the
catalog's - today's images.parquet - not the ones written into the tar by the run that fetched
the image; without one, every tar of the folder and its own metadata. Every sample is decoded with
PIL and checked; a bad sample is dropped and counted by reason, a truncated or corrupt input tar is
reported and skipped whole. The output key is the sample's `image_key` (dedupe's stable key),
checked against the shard key format of `clipms.data.webds` here, where keys enter the shards; the
format itself is `clipms.data.webds`'.

Output is a pure function of the input samples and the settings: samples are sorted by key,
shuffled once with a seeded RNG per split, and written to tars whose headers carry fixed
mtimes/owners, so the same input always gives the same bytes (and the same DVC hashes). JPEG bytes
that decoded are copied as they are, never re-encoded.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from clipms.data import webds
from clipms.data.preprocess import PixelLimitError, open_image
from clipms.utils.atomic import atomic_write
from clipms.utils.redact import redact_text, redact_url
from prep import remote
from prep.catalog import TarInput

SPLITS = ("train", "val")
DROP_REASONS = (
    "missing_image", "undecodable_image", "too_large", "too_small", "no_caption", "missing_split",
    "bad_metadata", "bad_key", "duplicate_key", "not_in_tar",
)
Records = dict[str, dict[str, Any]]  # image key -> its metadata (captions, split, labels, url)


@dataclass(frozen=True)
class ShardSettings:
    samples_per_shard: int = 512
    min_image_size: int = 32
    seed: int = 0
    workers: int = 2


@dataclass(frozen=True)
class Sample:
    """A validated sample: its metadata and where its image bytes live (or the bytes themselves)."""

    key: str
    split: str
    meta: bytes                      # the output <key>.json
    text: bytes                      # the output <key>.txt (first caption)
    source: str                      # input tar the image comes from
    span: webds.Span                 # where the image data lies in that tar
    image: bytes | None = None       # set only when the image had to be converted to JPEG


@dataclass
class TarScan:
    name: str
    samples: list[Sample] = field(default_factory=list)
    seen: int = 0
    skipped: int = 0  # samples of the tar the catalog does not list (not wanted today)
    digest: str | None = None  # the tar's key in the checks cache (when one is used)
    from_cache: bool = False  # its images' checks were read back, not decoded again
    dropped: Counter = field(default_factory=Counter)
    error: str | None = None


class ShardError(ValueError):
    """The shard stage cannot run at all (e.g. no input folder)."""


# ---------------------------------------------------------------- reading and validating


def scan_tar(path: str, min_image_size: int, records: Records | None = None,
             name: str | None = None, checks_dir: str | None = None,
             digest: str | None = None) -> TarScan:
    """Read and validate the samples of one input tar - every one, or with `records` only those
    whose `image_key` it lists, with its metadata; a corrupt tar gives `error`, no samples. With
    `checks_dir` (catalog mode), what decoding each image found is kept there under the tar's
    sha256 and read back instead of decoding again: a download part's tar never changes.
    `digest`: the tar's `ChecksCache.digest`, when the caller has computed it already."""
    scan = TarScan(name=name or Path(path).name)
    cache = ChecksCache(checks_dir) if checks_dir and records is not None else None
    try:
        if cache is not None:
            scan.digest = digest or cache.digest(path)
            checks = cache.load(scan.digest)
            raws: list[webds.Sample | None] = [None] * len(checks or [])
            scan.from_cache = checks is not None
        if cache is None or checks is None:
            webds.check_complete(path)
            raws = sorted(webds.read_tar(path), key=lambda s: s.key)
            checks = [check_image(raw) for raw in raws]
            if cache is not None:
                cache.save(scan.digest, checks)
    except webds.DataError as err:
        scan.error = str(err).removeprefix(f"{path}: ")
        if records is not None:
            scan.dropped["not_in_tar"] += len(records)
        return scan
    found: set[str] = set()
    for check, raw in zip(checks, raws, strict=True):
        record = None
        if records is not None:
            record = records.get(check.image_key) if check.image_key else None
            if record is None or check.image_key in found:
                scan.skipped += 1
                continue
            found.add(check.image_key)
        scan.seen += 1
        sample, reason = _validate(check, raw, path, min_image_size, record)
        if sample is None:
            scan.dropped[reason] += 1
        else:
            scan.samples.append(sample)
    if records is not None:
        scan.dropped["not_in_tar"] += len(set(records) - found)
    return scan


@dataclass(frozen=True)
class ImageCheck:
    """What decoding one sample's image found: it depends on the tar's bytes alone."""

    image_key: str | None       # the `image_key` of the sample's json (None: none, or bad json)
    problem: str                # "", "missing_image", "undecodable_image" or "too_large"
    meta_ok: bool = True        # the json member is a readable object
    width: int = 0
    height: int = 0
    offset: int = 0             # where the image data lies in the tar
    size: int = 0
    converted: bytes | None = None  # the image as JPEG, when it is another format


def check_image(raw: webds.Sample) -> ImageCheck:
    try:
        key = raw.meta.get("image_key")
        meta_ok = True
    except webds.DataError:
        key, meta_ok = None, False
    key = key if isinstance(key, str) else None
    ext = raw.image_ext
    if ext is None:
        return ImageCheck(key, "missing_image", meta_ok)
    span = raw.spans[ext]
    try:
        # The one decoder (JPEG/PNG/WEBP, the pixel limit read from the header, then a full
        # decode: the header alone misses truncated image data).
        image = open_image(raw.files[ext], raw.key)
        converted = None if image.format == "JPEG" else _to_jpeg(image)
    except PixelLimitError:  # a decompression bomb or an oversized image, refused unallocated
        return ImageCheck(key, "too_large", meta_ok, offset=span.offset, size=span.size)
    except Exception:  # PreprocessError, or an encoder error while converting to JPEG
        return ImageCheck(key, "undecodable_image", meta_ok, offset=span.offset, size=span.size)
    return ImageCheck(key, "", meta_ok, image.width, image.height, span.offset, span.size,
                      converted)


def _validate(check: ImageCheck, raw: webds.Sample | None, path: str, min_image_size: int,
              record: dict[str, Any] | None = None) -> tuple[Sample | None, str]:
    """The sample, or why it is dropped. `record`: its metadata from the catalog (with its key
    added), instead of the tar's own (`raw`, which a cached check does not need)."""
    if check.problem == "missing_image":
        return None, "missing_image"
    if record is None and (raw is None or not check.meta_ok):
        return None, "bad_metadata"
    meta = raw.meta if record is None else {**record, "image_key": check.image_key}
    if check.problem:
        return None, check.problem
    if min(check.width, check.height) < min_image_size:
        return None, "too_small"
    captions = _captions(meta, raw.caption if record is None and raw is not None else "")
    if not captions:
        return None, "no_caption"
    split = meta.get("split")
    if split not in SPLITS:
        return None, "missing_split"
    labels = meta.get("labels")
    try:
        labels = json.loads(labels) if isinstance(labels, str) else labels
    except json.JSONDecodeError:
        return None, "bad_metadata"
    # The key becomes the output member names: it must be in the format the loader accepts
    # (which also keeps path separators and `..` out of every name).
    key = meta.get("image_key")
    if not webds.is_valid_key(key):
        return None, "bad_key"
    out = {"captions": captions, "url": meta.get("url"), "key": key, "split": split,
           "labels": labels}
    return Sample(
        key=key, split=split, meta=json.dumps(out, ensure_ascii=False, sort_keys=True).encode(),
        text=captions[0].encode(), source=path, span=webds.Span(check.offset, check.size),
        image=check.converted,
    ), ""


class ChecksCache:
    """`ImageCheck`s of input tars by the tar's sha256, one parquet file each, in a folder the
    shard stage owns (what it did not use in a run is removed at the end: `prune`)."""

    VERSION = "1"  # of what a check holds and how it is decided: another version is not read
    COLUMNS = ("image_key", "problem", "meta_ok", "width", "height", "offset", "size",
               "converted")

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    @classmethod
    def digest(cls, path: str | Path) -> str:
        sha = hashlib.sha256(f"checks-v{cls.VERSION}\0".encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                sha.update(block)
        return sha.hexdigest()

    def known(self) -> set[str]:
        """The digests whose checks are kept."""
        return {p.stem for p in self.folder.glob("*.parquet")}

    def load(self, digest: str) -> list[ImageCheck] | None:
        path = self.folder / f"{digest}.parquet"
        if not path.is_file():
            return None
        try:
            table = pq.read_table(str(path))
            columns = [table.column(name).to_pylist() for name in self.COLUMNS]
        except (pa.ArrowException, OSError, KeyError):
            return None  # unreadable: decode again
        return [ImageCheck(*row) for row in zip(*columns, strict=True)]

    def save(self, digest: str, checks: list[ImageCheck]) -> None:
        table = pa.table({
            "image_key": pa.array([c.image_key for c in checks], pa.string()),
            "problem": pa.array([c.problem for c in checks], pa.string()),
            "meta_ok": pa.array([c.meta_ok for c in checks], pa.bool_()),
            **{name: pa.array([getattr(c, name) for c in checks], pa.int64())
               for name in ("width", "height", "offset", "size")},
            "converted": pa.array([c.converted for c in checks], pa.binary())})
        with atomic_write(self.folder / f"{digest}.parquet") as tmp:
            pq.write_table(table, str(tmp))

    def prune(self, used: set[str]) -> int:
        """Remove the checks of tars not read in this run; how many were removed."""
        stale = [p for p in self.folder.glob("*.parquet") if p.stem not in used]
        for path in stale:
            path.unlink()
        return len(stale)


def _captions(meta: dict[str, Any], text: str) -> list[str]:
    raw = meta.get("captions")
    captions = [c.strip() for c in raw if isinstance(c, str) and c.strip()] if isinstance(
        raw, list) else []
    if not captions and text:
        captions = [text]
    return captions


def _to_jpeg(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.convert("RGB").save(out, format="JPEG", quality=95)
    return out.getvalue()


def _scan_worker(args: tuple[str, int, Records | None, str | None, str | None, str | None]
                 ) -> TarScan:
    return scan_tar(*args)


def scan_all(tars: list[Path], settings: ShardSettings,
             wanted: list[Records] | None = None, names: list[str] | None = None,
             checks_dir: Path | None = None) -> Iterator[TarScan]:
    """Scan tars in order, in `workers` processes (decoding is the costly part); `wanted`: each
    tar's records (catalog mode), `names`: how each tar is named in reports, `checks_dir`: the
    checks cache (catalog mode). Tars whose checks are cached are read here: starting worker
    processes would cost more than reading their checks back. Each tar is hashed once: here when
    some checks are cached (to tell which), else where it is scanned."""
    cache = None if checks_dir is None or wanted is None else str(checks_dir)
    known = ChecksCache(checks_dir).known() if cache else set()
    digests = [ChecksCache.digest(t) if known else None for t in tars]
    jobs = [(str(t), settings.min_image_size, wanted[i] if wanted else None,
             names[i] if names else None, cache, digests[i]) for i, t in enumerate(tars)]
    decode = {i for i, digest in enumerate(digests) if digest is None or digest not in known}
    if settings.workers <= 1 or len(decode) <= 1:
        yield from map(_scan_worker, jobs)
        return
    with get_context("spawn").Pool(min(settings.workers, len(decode))) as pool:
        decoded = pool.imap(_scan_worker, [jobs[i] for i in sorted(decode)])
        for i, job in enumerate(jobs):
            yield next(decoded) if i in decode else _scan_worker(job)



# ---------------------------------------------------------------- writing


class _ImageReader:
    """Reads image bytes back from the input tars by offset, keeping the files open."""

    def __init__(self) -> None:
        self.handles: dict[str, Any] = {}

    def read(self, sample: Sample) -> bytes:
        if sample.image is not None:
            return sample.image
        handle = self.handles.get(sample.source)
        if handle is None:
            handle = self.handles[sample.source] = open(sample.source, "rb")  # noqa: SIM115
        return webds.read_span(handle, sample.span)

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


def output_files(samples: list[Sample], reader: _ImageReader,
                 progress: Callable[[int], None]) -> Iterator[webds.SampleFiles]:
    """The members of each output sample, in the order they are written (image bytes read late)."""
    for sample in samples:
        yield sample.key, {"jpg": reader.read(sample), "json": sample.meta, "txt": sample.text}
        progress(1)


def shuffled(samples: list[Sample], seed: int, split: str) -> list[Sample]:
    """Sorted by key (independent of input order), then one seeded shuffle per split."""
    ordered = sorted(samples, key=lambda s: s.key)
    random.Random(f"{seed}:{split}").shuffle(ordered)
    return ordered


# ---------------------------------------------------------------- the stage


def build_shards(input_dir: Path | str, output_dir: Path | str, settings: ShardSettings,
                 print_fn: Callable[[str], None] = print,
                 recorded: list[dict[str, Any]] | None = None,
                 inputs: list[TarInput] | None = None,
                 checks_dir: Path | None = None) -> dict[str, Any]:
    """Validate the input samples and write `output_dir/{train,val}/*.tar` + `manifest.json`.

    `input_dir` is a local folder or an fsspec URL. `inputs` (the download catalog's tars, paths
    relative to `input_dir`, with today's records) names what to read; without it, every tar of
    the folder. The tars at a URL must be the `recorded` ones (the download stage's pointer,
    `prep.remote`); they are copied into a temporary folder beside `output_dir` first
    (removed after), so validating and writing read local files, as for a local input.
    `checks_dir` (with `inputs`) keeps what decoding each tar's images found, by the tar's
    sha256, so a tar read on an earlier run is not decoded again (`ChecksCache`)."""
    output_dir = Path(output_dir)
    cache = checks_dir if inputs is not None else None
    names = None if inputs is None else [entry.tar for entry in inputs]
    wanted = None if inputs is None else [entry.records for entry in inputs]
    if remote.is_url(input_dir):
        url = str(input_dir)
        if not recorded and names != []:
            raise ShardError(f"no record of the tars at {redact_url(url)} (the download stage's "
                             "pointer); rerun the download stage")
        try:
            sources = remote.check_shards(url, recorded or [])
        except (remote.RemoteError, OSError) as err:
            raise ShardError(redact_text(str(err))) from None
        relative = names if names is not None else [s.rsplit("/", 1)[-1] for s in sources]
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".shard-input-", dir=output_dir.parent) as tmp:
            started = time.perf_counter()
            tars = fetch_tars(url, _sources_of(url, relative, sources), Path(tmp), relative)
            print_fn(f"shard: copied {len(tars)} tar(s) from {redact_url(url)} "
                     f"({time.perf_counter() - started:.1f} s)")
            return _build(tars, output_dir, settings, print_fn, wanted, names, cache)
    input_dir = Path(input_dir)
    if not input_dir.is_dir():
        raise ShardError(f"{input_dir}: input folder not found (run the download stage first)")
    tars = sorted(input_dir.glob("*.tar")) if names is None else [input_dir / n for n in names]
    return _build(tars, output_dir, settings, print_fn, wanted, names, cache)


def _sources_of(url: str, relative: list[str], recorded: list[str]) -> list[str]:
    """The fsspec paths of the `relative` tars at `url`: each must be one the pointer records."""
    _fs, root = fsspec.core.url_to_fs(url)
    paths = [f"{root.rstrip('/')}/{name}" for name in relative]
    known = set(recorded)
    unknown = [name for name, path in zip(relative, paths, strict=True) if path not in known]
    if unknown:
        raise ShardError(f"the download catalog names tars the pointer does not record "
                         f"({', '.join(unknown[:5])}); rerun the download stage")
    return paths


def fetch_tars(url: str, sources: list[str], folder: Path,
               names: list[str] | None = None) -> list[Path]:
    """Copy the tars (fsspec paths of `url`'s filesystem) into `folder` - as `names` (relative
    paths) when given, else by file name - in one call (concurrent on stores that support it);
    the local copies, in the same order."""
    fs, _root = fsspec.core.url_to_fs(url)
    local = [folder / (name if names else source.rsplit("/", 1)[-1])
             for source, name in zip(sources, names or sources, strict=True)]
    for path in local:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if sources:
            fs.get(sources, [str(path) for path in local])
    except OSError as err:
        raise ShardError(f"copying the tars from {redact_url(url)}: "
                         f"{redact_text(str(err))}") from None
    return local


def _build(tars: list[Path], output_dir: Path, settings: ShardSettings,
           print_fn: Callable[[str], None], wanted: list[Records] | None = None,
           names: list[str] | None = None, checks_dir: Path | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    samples, metrics = _collect(tars, settings, print_fn, started, wanted, names, checks_dir)
    if output_dir.exists():
        shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True)
    reader = _ImageReader()
    written = [0]

    def progress(n: int) -> None:
        written[0] += n
        if written[0] % (settings.samples_per_shard * 20) == 0 or written[0] == len(samples):
            print_fn(f"shard: wrote {written[0]:,}/{len(samples):,} samples "
                     f"({time.perf_counter() - started:.1f} s)")

    splits: dict[str, Any] = {}
    try:
        for split in SPLITS:
            chosen = shuffled([s for s in samples if s.split == split], settings.seed, split)
            splits[split] = webds.write_split(output_dir, split,
                                              output_files(chosen, reader, progress),
                                              settings.samples_per_shard)
    finally:
        reader.close()
    webds.write_manifest(output_dir, settings.samples_per_shard, splits)
    for split, entry in splits.items():
        metrics[split] = {"samples": entry["samples"], "shards": len(entry["shards"]),
                          "bytes": entry["bytes"]}
    seconds = time.perf_counter() - started
    print_fn(summary(metrics, seconds))
    return metrics


def _collect(tars: list[Path], settings: ShardSettings, print_fn: Callable[[str], None],
             started: float, wanted: list[Records] | None = None,
             names: list[str] | None = None,
             checks_dir: Path | None = None) -> tuple[list[Sample], dict[str, Any]]:
    dropped: Counter[str] = Counter()
    corrupt: list[str] = []
    samples: list[Sample] = []
    seen = skipped = cached = 0
    digests: set[str] = set()
    if checks_dir is not None:
        Path(checks_dir).mkdir(parents=True, exist_ok=True)
    for done, scan in enumerate(scan_all(tars, settings, wanted, names, checks_dir), start=1):
        if scan.error:
            corrupt.append(f"{scan.name}: {scan.error}")
            print_fn(f"shard: skipping corrupt input {scan.name} ({scan.error})")
        seen += scan.seen
        skipped += scan.skipped
        dropped.update(scan.dropped)
        if scan.digest:
            digests.add(scan.digest)
        cached += scan.from_cache
        samples.extend(scan.samples)
        if done % 10 == 0 or done == len(tars):
            print_fn(f"shard: checked {done}/{len(tars)} input tars, {seen:,} samples "
                     f"({time.perf_counter() - started:.1f} s)")
    if checks_dir is not None:
        ChecksCache(checks_dir).prune(digests)
    unique: dict[str, Sample] = {}
    for sample in samples:  # tars are in name order, so the first copy of a key wins
        if sample.key in unique:
            dropped["duplicate_key"] += 1
        else:
            unique[sample.key] = sample
    metrics = {
        "input_shards": len(tars),
        "input_shards_corrupt": len(corrupt),
        "input_shards_checked_before": cached,  # their images' checks read back, not decoded
        "corrupt_input_shards": corrupt,
        "samples_in": seen,
        "samples_not_listed": skipped,  # in the tars read, but not among today's images
        "samples_out": len(unique),
        "dropped": {reason: dropped.get(reason, 0) for reason in DROP_REASONS},
    }
    return list(unique.values()), metrics


def summary(metrics: dict[str, Any], seconds: float) -> str:
    """The one-paragraph end-of-stage summary."""
    drops = ", ".join(f"{k} {v:,}" for k, v in metrics["dropped"].items() if v) or "none"
    rate = metrics["samples_in"] / seconds if seconds > 0 else 0.0
    corrupt = "; ".join(metrics["corrupt_input_shards"]) or "none"
    return (
        f"shard: {metrics['samples_in']:,} samples from {metrics['input_shards']} input tar(s) "
        f"checked in {seconds:.1f} s (~{rate:,.0f} samples/s) -> {metrics['train']['samples']:,} "
        f"train samples in {metrics['train']['shards']} shard(s), {metrics['val']['samples']:,} "
        f"val samples in {metrics['val']['shards']} shard(s). Dropped: {drops}. "
        f"Corrupt input tars skipped: {corrupt}."
    )
