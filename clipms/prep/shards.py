"""Validate downloaded webdataset samples and rewrite them as train/val shards with a manifest.

Input: img2dataset's `NNNNN.tar` files (`<k>.jpg`, `<k>.txt`, `<k>.json` carrying our `captions`,
`split`, `image_key`, `labels`). Every sample is decoded with PIL and checked; a bad sample is
dropped and counted by reason, a truncated or corrupt input tar is reported and skipped whole.

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
import tarfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from PIL import Image

from clipms.jsonio import write_json
from clipms.preprocess import open_image

SPLITS = ("train", "val")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
DROP_REASONS = (
    "missing_image", "undecodable_image", "too_small", "no_caption", "missing_split",
    "bad_metadata", "duplicate_key",
)
END_OF_ARCHIVE = b"\0" * 1024  # a complete tar ends with (at least) two zero blocks


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
    offset: int                      # image data offset in that tar
    size: int
    image: bytes | None = None       # set only when the image had to be converted to JPEG


@dataclass
class TarScan:
    name: str
    samples: list[Sample] = field(default_factory=list)
    seen: int = 0
    dropped: Counter = field(default_factory=Counter)
    error: str | None = None


class ShardError(ValueError):
    """The shard stage cannot run at all (e.g. no input folder)."""


# ---------------------------------------------------------------- reading and validating


def scan_tar(path: str, min_image_size: int) -> TarScan:
    """Read and validate every sample of one input tar; a corrupt tar gives `error`, no samples."""
    scan = TarScan(name=Path(path).name)
    try:
        _check_complete(path)
        groups = _read_groups(path)
    except (tarfile.TarError, EOFError, OSError, ValueError) as err:
        scan.error = f"{type(err).__name__}: {err}"
        return scan
    for key in sorted(groups):
        scan.seen += 1
        sample, reason = _validate(key, groups[key], path, min_image_size)
        if sample is None:
            scan.dropped[reason] += 1
        else:
            scan.samples.append(sample)
    return scan


def _check_complete(path: str) -> None:
    """A tar cut at a member boundary still parses; only the end-of-archive blocks prove it is."""
    with open(path, "rb") as handle:
        handle.seek(0, io.SEEK_END)
        size = handle.tell()
        if size < len(END_OF_ARCHIVE) or size % 512:
            raise ValueError(f"truncated tar ({size} bytes, not a whole number of 512-byte blocks)")
        handle.seek(size - len(END_OF_ARCHIVE))
        if handle.read() != END_OF_ARCHIVE:
            raise ValueError("truncated tar (no end-of-archive marker)")


def _read_groups(path: str) -> dict[str, dict[str, tuple[bytes, int]]]:
    """{sample key: {extension: (bytes, data offset)}}; reads every member, so cuts surface."""
    groups: dict[str, dict[str, tuple[bytes, int]]] = {}
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            base = member.name.rsplit("/", 1)[-1]
            key, _, ext = base.partition(".")
            handle = tar.extractfile(member)
            data = handle.read() if handle else b""
            if len(data) != member.size:
                raise tarfile.ReadError(f"member {member.name} is cut short")
            groups.setdefault(key, {})[ext.lower()] = (data, member.offset_data)
    return groups


def _validate(key: str, files: dict[str, tuple[bytes, int]], path: str,
              min_image_size: int) -> tuple[Sample | None, str]:
    ext = next((e for e in IMAGE_EXTS if e in files), None)
    if ext is None:
        return None, "missing_image"
    try:
        meta = json.loads(files["json"][0]) if "json" in files else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, "bad_metadata"
    if not isinstance(meta, dict):
        return None, "bad_metadata"
    data, offset = files[ext]
    try:
        # The one decoder (JPEG/PNG/WEBP, pixel limit from the header, a full decode: verify()
        # alone misses truncated JPEG data); a decompression bomb is undecodable here too.
        image = open_image(data, key)
        width, height, fmt = image.width, image.height, image.format
        converted = None if fmt == "JPEG" else _to_jpeg(image)
    except Exception:  # PreprocessError, or an encoder error while converting to JPEG
        return None, "undecodable_image"
    if min(width, height) < min_image_size:
        return None, "too_small"
    text = files["txt"][0].decode("utf-8", "replace") if "txt" in files else ""
    captions = _captions(meta, text)
    if not captions:
        return None, "no_caption"
    split = meta.get("split")
    if split not in SPLITS:
        return None, "missing_split"
    url = meta.get("url")
    labels = meta.get("labels")
    try:
        labels = json.loads(labels) if isinstance(labels, str) else labels
    except json.JSONDecodeError:
        return None, "bad_metadata"
    key = meta.get("image_key") or (_url_key(url) if url else key)
    out = {"captions": captions, "url": url, "key": key, "split": split, "labels": labels}
    return Sample(
        key=key, split=split, meta=json.dumps(out, ensure_ascii=False, sort_keys=True).encode(),
        text=captions[0].encode(), source=path, offset=offset, size=len(data), image=converted,
    ), ""


def _url_key(url: str) -> str:
    """dedupe's stable key, for a sample that lost ours (imported here only: captions.py pulls in
    pandas/pyarrow, which every spawned worker would otherwise pay for)."""
    from clipms.prep.captions import stable_keys

    return stable_keys([url])[0]


def _captions(meta: dict[str, Any], text: str) -> list[str]:
    raw = meta.get("captions")
    captions = [c.strip() for c in raw if isinstance(c, str) and c.strip()] if isinstance(
        raw, list) else []
    if not captions and text.strip():
        captions = [text.strip()]
    return captions


def _to_jpeg(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.convert("RGB").save(out, format="JPEG", quality=95)
    return out.getvalue()


def _scan_worker(args: tuple[str, int]) -> TarScan:
    return scan_tar(*args)


def scan_all(tars: list[Path], settings: ShardSettings) -> Iterator[TarScan]:
    """Scan tars in order, in `workers` processes (decoding is the costly part)."""
    jobs = [(str(t), settings.min_image_size) for t in tars]
    if settings.workers <= 1 or len(jobs) <= 1:
        yield from map(_scan_worker, jobs)
        return
    with get_context("spawn").Pool(min(settings.workers, len(jobs))) as pool:
        yield from pool.imap(_scan_worker, jobs)


# ---------------------------------------------------------------- writing


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


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
        handle.seek(sample.offset)
        return handle.read(sample.size)

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


def write_split(samples: list[Sample], split: str, out_dir: Path, samples_per_shard: int,
                reader: _ImageReader, progress: Callable[[int], None]) -> dict[str, Any]:
    """Write one split's shards; return its manifest entry."""
    (out_dir / split).mkdir(parents=True, exist_ok=True)
    shards = []
    for index, start in enumerate(range(0, len(samples), samples_per_shard)):
        chunk = samples[start:start + samples_per_shard]
        name = f"{split}/{index:06d}.tar"
        path = out_dir / name
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            for sample in chunk:
                _add_member(tar, f"{sample.key}.jpg", reader.read(sample))
                _add_member(tar, f"{sample.key}.json", sample.meta)
                _add_member(tar, f"{sample.key}.txt", sample.text)
        shards.append({"name": name, "samples": len(chunk), "bytes": path.stat().st_size,
                       "sha256": _sha256(path)})
        progress(len(chunk))
    return {"samples": len(samples), "bytes": sum(s["bytes"] for s in shards), "shards": shards}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shuffled(samples: list[Sample], seed: int, split: str) -> list[Sample]:
    """Sorted by key (independent of input order), then one seeded shuffle per split."""
    ordered = sorted(samples, key=lambda s: s.key)
    random.Random(f"{seed}:{split}").shuffle(ordered)
    return ordered


# ---------------------------------------------------------------- the stage


def build_shards(input_dir: Path | str, output_dir: Path | str, settings: ShardSettings,
                 print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Validate every input sample and write `output_dir/{train,val}/*.tar` + `manifest.json`."""
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    if not input_dir.is_dir():
        raise ShardError(f"{input_dir}: input folder not found (run the download stage first)")
    started = time.perf_counter()
    tars = sorted(input_dir.glob("*.tar"))
    samples, metrics = _collect(tars, settings, print_fn, started)
    if output_dir.exists():
        shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True)
    manifest: dict[str, Any] = {"samples_per_shard": settings.samples_per_shard, "splits": {}}
    reader = _ImageReader()
    written = [0]

    def progress(n: int) -> None:
        written[0] += n
        if written[0] % (settings.samples_per_shard * 20) < n or written[0] == len(samples):
            print_fn(f"shard: wrote {written[0]:,}/{len(samples):,} samples "
                     f"({time.perf_counter() - started:.1f} s)")

    try:
        for split in SPLITS:
            chosen = shuffled([s for s in samples if s.split == split], settings.seed, split)
            manifest["splits"][split] = write_split(chosen, split, output_dir,
                                                    settings.samples_per_shard, reader, progress)
    finally:
        reader.close()
    write_json(output_dir / "manifest.json", manifest)
    for split in SPLITS:
        entry = manifest["splits"][split]
        metrics[split] = {"samples": entry["samples"], "shards": len(entry["shards"]),
                          "bytes": entry["bytes"]}
    seconds = time.perf_counter() - started
    print_fn(summary(metrics, seconds))
    return metrics


def _collect(tars: list[Path], settings: ShardSettings, print_fn: Callable[[str], None],
             started: float) -> tuple[list[Sample], dict[str, Any]]:
    dropped: Counter[str] = Counter()
    corrupt: list[str] = []
    samples: list[Sample] = []
    seen = 0
    for done, scan in enumerate(scan_all(tars, settings), start=1):
        if scan.error:
            corrupt.append(f"{scan.name}: {scan.error}")
            print_fn(f"shard: skipping corrupt input {scan.name} ({scan.error})")
        seen += scan.seen
        dropped.update(scan.dropped)
        samples.extend(scan.samples)
        if done % 10 == 0 or done == len(tars):
            print_fn(f"shard: checked {done}/{len(tars)} input tars, {seen:,} samples "
                     f"({time.perf_counter() - started:.1f} s)")
    unique: dict[str, Sample] = {}
    for sample in samples:  # tars are in name order, so the first copy of a key wins
        if sample.key in unique:
            dropped["duplicate_key"] += 1
        else:
            unique[sample.key] = sample
    metrics = {
        "input_shards": len(tars),
        "input_shards_corrupt": len(corrupt),
        "corrupt_input_shards": corrupt,
        "samples_in": seen,
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
