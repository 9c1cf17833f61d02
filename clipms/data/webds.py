"""The webdataset shard format: the one module that knows how samples sit in a tar.

A shard is a tar whose members are `<key>.<ext>`; the members of one sample share a key. This
project's shards (written by the `shard` stage, read by the loader, the evaluation and search) hold
per sample `<key>.jpg` (the image), `<key>.json` ({"captions": [...], "url", "key", "split",
"labels"}) and `<key>.txt` (the first caption), in split folders (`train/000000.tar`, ...) beside a
`manifest.json`:

    {"samples_per_shard": N,
     "splits": {split: {"samples": n, "bytes": b,
                        "shards": [{"name": "train/000000.tar", "samples": n, "bytes": b,
                                    "sha256": hex}, ...]}}}

Two rules, both here and nowhere else:
- the key rule (webdataset's): a member's key is its name up to the first dot of the file name,
  folders included (`a/b.c.jpg` -> key `a/b`, extension `c.jpg`); extensions are lower-cased;
- the key format (`KEY_PATTERN`): what this project writes and its loader accepts: letters, digits,
  `_` and `-`. A key therefore never holds a path separator or `..`, so no member name can point
  outside its tar's folder when a tool extracts it. Other webdatasets (zero-shot sets, a folder
  given to `search`) are read with the key rule alone.

Shards are written deterministically (fixed member headers, the given order) and atomically.

Shards are read as untrusted input (a downloaded tar, a folder given to `search`): a member is
read only when it is a plain regular file of at most MAX_MEMBER_BYTES (`check_member`). A GNU
sparse member (a 10 KB tar can declare 1.5 GB, which tarfile reads back as zeros), a link, a
device or a FIFO is refused with an error naming it; directory entries hold nothing and are
skipped.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO

from clipms.utils.atomic import atomic_write
from clipms.utils.jsonio import read_json, write_json

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # in the order a sample's image is looked for
KEY_PATTERN = r"[A-Za-z0-9_-]{1,128}"
MANIFEST = "manifest.json"
SHARD_NAME = "{split}/{index:06d}.tar"
_KEY = re.compile(KEY_PATTERN)
_EXT = re.compile(r"[a-z0-9]{1,16}")  # what the writer accepts (one dot-free extension)
_MEMBER = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's base_plus_ext
END_OF_ARCHIVE = b"\0" * 1024  # a complete tar ends with (at least) two zero blocks


class DataError(ValueError):
    """A shard, a manifest or a sample that breaks the format; the message names which."""


# ---------------------------------------------------------------- keys and names


def split_name(name: str) -> tuple[str, str] | None:
    """(key, lower-cased extension) of a member name by the key rule; None without an extension."""
    match = _MEMBER.match(name)
    return (match.group(1), match.group(2).lower()) if match else None


def is_valid_key(key: object) -> bool:
    """Whether `key` is in the key format that this project writes and its loader reads."""
    return isinstance(key, str) and _KEY.fullmatch(key) is not None


def check_key(key: object, where: str) -> str:
    if not is_valid_key(key):
        raise DataError(f"{where}: sample key {key!r} is not in the shard key format "
                        f"{KEY_PATTERN} (letters, digits, '_' and '-')")
    return key  # type: ignore[return-value]


def image_ext(exts: Iterable[str]) -> str | None:
    """The extension of a sample's image among its members' extensions (None: no image)."""
    present = set(exts)
    return next((ext for ext in IMAGE_EXTS if ext in present), None)


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class Span:
    """Where a member's data lies in its tar file."""

    offset: int
    size: int


@dataclass
class Sample:
    """One sample of a tar: its members' bytes by extension, and where each lies in the tar."""

    key: str
    files: dict[str, bytes] = field(default_factory=dict)
    spans: dict[str, Span] = field(default_factory=dict)

    @property
    def image_ext(self) -> str | None:
        return image_ext(self.files)

    @property
    def image(self) -> bytes | None:
        ext = self.image_ext
        return None if ext is None else self.files[ext]

    @cached_property
    def meta(self) -> dict[str, Any]:
        """The parsed `.json` member ({} when there is none); DataError when it is not an object."""
        if "json" not in self.files:
            return {}
        try:
            meta = json.loads(self.files["json"])
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(f"sample {self.key!r}: .json is not valid JSON ({err})") from err
        if not isinstance(meta, dict):
            raise DataError(f"sample {self.key!r}: .json is not an object")
        return meta

    @property
    def caption(self) -> str:
        """The `.txt` member, stripped ('' when there is none)."""
        return self.files["txt"].decode("utf-8", "replace").strip() if "txt" in self.files else ""


def tar_paths(shards: Path | str) -> list[Path]:
    """A .tar file itself, or every .tar below a folder (sorted, so the order is stable)."""
    shards = Path(shards)
    if shards.is_file():
        return [shards]
    found = sorted(shards.rglob("*.tar"))
    if not found:
        raise DataError(f"{shards}: no .tar shards found")
    return found


def check_complete(path: Path | str) -> None:
    """A tar cut between members still parses: only its end-of-archive blocks prove it whole."""
    with open(path, "rb") as handle:
        size = handle.seek(0, io.SEEK_END)
        if size < len(END_OF_ARCHIVE) or size % 512:
            raise DataError(f"{path}: truncated tar ({size} bytes, not whole 512-byte blocks)")
        handle.seek(size - len(END_OF_ARCHIVE))
        if handle.read() != END_OF_ARCHIVE:
            raise DataError(f"{path}: truncated tar (no end-of-archive marker)")


# The largest member read: far over any image, caption or json of a sample (the download stage
# resizes images to a few hundred KB), far under what would hurt a reader's memory.
MAX_MEMBER_BYTES = 64 << 20


_MEMBER_KINDS = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link",
                 tarfile.CHRTYPE: "a device", tarfile.BLKTYPE: "a device",
                 tarfile.FIFOTYPE: "a FIFO", tarfile.CONTTYPE: "a contiguous file",
                 tarfile.GNUTYPE_SPARSE: "a GNU sparse file"}


def check_member(path: Path | str, member: tarfile.TarInfo) -> bool:
    """True for a member to read (a plain regular file of at most MAX_MEMBER_BYTES), False for a
    directory entry (nothing to read); DataError for anything else."""
    if member.isdir():
        return False
    if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or member.issparse():
        kind = "a GNU sparse file" if member.issparse() else _MEMBER_KINDS.get(
            member.type, f"of tar type {member.type.decode(errors='replace')!r}")
        raise DataError(f"{path}: member {member.name!r} is {kind}, not a regular file; "
                        "shards hold regular files only")
    if member.size > MAX_MEMBER_BYTES:
        raise DataError(f"{path}: member {member.name!r} declares {member.size:,} bytes, over "
                        f"the limit of {MAX_MEMBER_BYTES:,} bytes per member")
    return True


def read_tar(path: Path | str) -> list[Sample]:
    """Every sample of one tar, all members read (so a cut inside a member surfaces), in the order
    their keys first appear. Members without an extension and directory entries are ignored;
    other members that are not regular files, or are too large, are refused (`check_member`)."""
    samples: dict[str, Sample] = {}
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                parts = split_name(member.name) if check_member(path, member) else None
                if parts is None:
                    continue
                handle = tar.extractfile(member)
                data = handle.read() if handle else b""
                if len(data) != member.size:
                    raise DataError(f"{path}: member {member.name} is cut short")
                sample = samples.setdefault(parts[0], Sample(parts[0]))
                sample.files[parts[1]] = data
                sample.spans[parts[1]] = Span(member.offset_data, member.size)
    except (tarfile.TarError, EOFError, OSError) as err:
        raise DataError(f"{path}: unreadable or truncated tar ({err})") from err
    return list(samples.values())


def iter_samples(shards: Path | str) -> Iterator[Sample]:
    """Every sample of a .tar or of every .tar below a folder, tar by tar."""
    for path in tar_paths(shards):
        yield from read_tar(path)


def index_tar(path: Path | str) -> dict[str, dict[str, Span]]:
    """{key: {ext: Span}} from the member headers alone (no data is read), in key order of first
    appearance: what random access needs."""
    index: dict[str, dict[str, Span]] = {}
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                parts = split_name(member.name) if check_member(path, member) else None
                if parts is not None:
                    index.setdefault(parts[0], {})[parts[1]] = Span(member.offset_data,
                                                                    member.size)
    except FileNotFoundError as err:
        raise DataError(f"{path}: shard listed in the manifest is missing") from err
    except (tarfile.TarError, EOFError, OSError) as err:
        raise DataError(f"{path}: unreadable or truncated tar ({err})") from err
    return index


def read_span(handle: BinaryIO, span: Span) -> bytes:
    handle.seek(span.offset)
    data = handle.read(span.size)
    if len(data) != span.size:
        raise OSError(f"short read at byte {span.offset} ({len(data)} of {span.size} bytes): "
                      "truncated?")
    return data


# ---------------------------------------------------------------- writing

SampleFiles = tuple[str, dict[str, bytes]]  # (key, {extension: bytes}), written in dict order


def write_tar(path: Path | str, samples: Iterable[SampleFiles]) -> dict[str, Any]:
    """Write samples to one tar, atomically and deterministically (fixed mtimes and owners);
    return {"samples", "bytes", "sha256"}. Keys and extensions are checked before anything is
    written, so a member name is always `<key>.<ext>` in the key format. The bytes are exactly
    those of `tarfile` in GNU format with these headers (tests/clipms/data/test_webds.py compares them);
    the headers are made here from one template because building each one with `tarfile` was
    most of the time a night's shard stage spent rewriting the shards (docs/data-pipeline.md,
    "Measurements behind the code")."""
    count = 0
    with atomic_write(path) as tmp, open(tmp, "wb") as handle:
        sink = _HashingWriter(handle)
        for key, files in samples:
            check_key(key, str(path))
            for ext, data in files.items():
                if not _EXT.fullmatch(ext):
                    raise DataError(f"{path}: sample {key!r}: extension {ext!r} is not "
                                    f"{_EXT.pattern}")
                sink.write(_member_header(f"{key}.{ext}", len(data)))
                sink.write(data)
                sink.write(b"\0" * (-len(data) % tarfile.BLOCKSIZE))
            count += 1
        sink.write(b"\0" * (2 * tarfile.BLOCKSIZE))  # end of archive, then whole records
        sink.write(b"\0" * (-sink.size % tarfile.RECORDSIZE))
    return {"samples": count, "bytes": sink.size, "sha256": sink.digest.hexdigest()}


class _HashingWriter:
    """Writes to a file, keeping the sha256 and the size of what was written."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.digest, self.size = handle, hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        self.handle.write(data)
        self.digest.update(data)
        self.size += len(data)


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    """The header every member gets: fixed time, mode and owner."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


_HEADER_TEMPLATE = _tarinfo("x", 0).tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
_CHECKSUM = slice(148, 156)  # ustar's checksum field; name: 0-100, size: 124-136


def _member_header(name: str, size: int) -> bytes:
    """`_tarinfo(name, size)`'s GNU header block(s), as tarfile writes it."""
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) > tarfile.LENGTH_NAME or size >= 8 ** 11:  # a long-name record; > 8 GiB
        return _tarinfo(name, size).tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
    block = bytearray(_HEADER_TEMPLATE)
    block[0:100] = raw.ljust(100, b"\0")
    block[124:136] = b"%011o\0" % size
    block[_CHECKSUM] = b" " * 8
    block[148:155] = b"%06o\0" % sum(block)  # the eighth byte stays a space, as tarfile's
    return bytes(block)


def size_and_sha256(path: Path) -> tuple[int, str]:
    """(bytes, sha256 hex) of a file, as the manifest records a shard."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def write_split(root: Path | str, split: str, samples: Iterable[SampleFiles],
                samples_per_shard: int) -> dict[str, Any]:
    """`root/<split>/000000.tar, ...` of `samples_per_shard` samples each (the last may hold
    fewer); return the split's manifest entry. `samples` is consumed lazily, shard by shard."""
    if samples_per_shard < 1:
        raise DataError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    root, shards, stream = Path(root), [], iter(samples)
    while chunk := list(islice(stream, samples_per_shard)):
        name = SHARD_NAME.format(split=split, index=len(shards))
        shards.append({"name": name, **write_tar(root / name, chunk)})
    return split_summary(shards)


def split_summary(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """A split's manifest entry from its shards' entries ({"name", "samples", "bytes", ...})."""
    return {"samples": sum(s["samples"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards), "shards": shards}


def write_manifest(root: Path | str, samples_per_shard: int,
                   splits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`root/manifest.json` from the entries `write_split` returned."""
    manifest = {"samples_per_shard": samples_per_shard, "splits": splits}
    write_json(Path(root) / MANIFEST, manifest)
    return manifest


# ---------------------------------------------------------------- the manifest


def read_manifest(root: Path | str) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path}: manifest not found (run the `shard` stage first)")
    try:
        manifest = read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON: {err}") from err
    if not isinstance(manifest, dict) or not isinstance(manifest.get("splits"), dict):
        raise DataError(f"{path}: expected {{'splits': {{split: {{'shards': [...]}}}}}}")
    return manifest


def split_entry(manifest: dict[str, Any], split: str, source: str) -> dict[str, Any]:
    """A split's entry of a manifest read by `read_manifest` (`source` names it in errors)."""
    entry = manifest["splits"].get(split)
    if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list):
        raise DataError(f"{source}: no split {split!r} with a 'shards' list "
                        f"(splits: {sorted(manifest['splits'])})")
    return entry
