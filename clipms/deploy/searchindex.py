"""A searchable image collection, embedded by one export bundle: what the `index` stage writes and
the search service loads (so the service needs no shards).

    <index>/index.json      format, version, rows, dim, search options, the digest of the bundle
                            that embedded it, and the sha256 of every other file
    <index>/embeddings.npy  (N, E) float32, unit-length rows (the bundle's image tower)
    <index>/items.parquet   key, caption, split, thumb_offset, thumb_size (row i = embedding i)
    <index>/thumbnails.bin  small JPEG thumbnails, concatenated (offsets in items.parquet)
    <index>/faiss.index     only when the search kind is `hnsw` or `ivf` (clipms.deploy.search)

`ImageIndex.load(folder, bundle_digest=...)` refuses an index that another bundle made, or whose
files do not match index.json (a partial copy, a download cut short): an index is served only with
the model that embedded it.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from clipms.data.preprocess import PreprocessError, decode_image, preprocess_image
from clipms.deploy.search import ExactSearch, FaissSearch, Searcher, SearchOptions
from clipms.utils.atomic import atomic_write, write_bytes
from clipms.utils.jsonio import write_json

INDEX_FORMAT = "clipms-image-index"
INDEX_VERSION = 1
INDEX_JSON, EMBEDDINGS, ITEMS, THUMBNAILS, FAISS = (
    "index.json", "embeddings.npy", "items.parquet", "thumbnails.bin", "faiss.index")
BUNDLE_FILES = ("bundle.json", "image_encoder.mindir", "text_encoder.mindir", "tokenizer.json",
                "preprocess.json")


class ImageIndexError(ValueError):
    """An index folder that is incomplete, corrupt, or made by another bundle."""


@dataclass(frozen=True)
class Item:
    """One image of the collection as the index stage reads it."""

    key: str
    image: bytes
    caption: str
    split: str


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def bundle_digest(bundle_dir: Path | str) -> str:
    """sha256 over the bundle's files (names and contents): the identity of an exported model,
    the same wherever the bundle was copied or downloaded to."""
    digest = hashlib.sha256()
    for name in BUNDLE_FILES:
        path = Path(bundle_dir) / name
        if not path.is_file():
            raise ImageIndexError(f"{bundle_dir}: not an export bundle (no {name})")
        digest.update(f"{name}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def thumbnail_jpeg(image: Image.Image, size: int) -> bytes:
    """The image shrunk to fit size x size (aspect kept), as JPEG."""
    small = image.copy()
    small.thumbnail((size, size), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    small.save(out, format="JPEG", quality=85)
    return out.getvalue()


def build_index(encoder: Any, items: Iterable[Item], out_dir: Path | str, digest: str,
                options: SearchOptions, thumbnail_size: int = 128,
                batch_size: int = 64) -> dict[str, Any]:
    """Embed `items` with `encoder` (clipms.deploy.infer.Encoder) and write the index to `out_dir`
with the search of `options` (`auto` resolved by the number of rows: clipms.deploy.search).

    Undecodable images (another format, a decompression bomb, broken data) and repeated keys are
    skipped and counted, never fatal; returns the counts and the search options used."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    vectors: list[np.ndarray] = []
    skipped = {"undecodable_image": 0, "duplicate_key": 0}
    seen: set[str] = set()
    with atomic_write(out_dir / THUMBNAILS) as tmp, open(tmp, "wb") as thumbs:
        for batch in _batches(items, batch_size):
            arrays = []
            for item in batch:
                if item.key in seen:
                    skipped["duplicate_key"] += 1
                    continue
                try:
                    rgb = decode_image(item.image, item.key, encoder.preprocess.max_pixels)
                    arrays.append(preprocess_image(rgb, encoder.preprocess, item.key))
                except PreprocessError:
                    skipped["undecodable_image"] += 1
                    continue
                seen.add(item.key)
                thumb = thumbnail_jpeg(rgb, thumbnail_size)
                rows.append({"key": item.key, "caption": item.caption, "split": item.split,
                             "thumb_offset": thumbs.tell(), "thumb_size": len(thumb)})
                thumbs.write(thumb)
            if arrays:
                vectors.append(encoder.encode_preprocessed(np.stack(arrays)))
    if not rows:
        raise ImageIndexError(f"no decodable image to index ({skipped})")
    embeddings = np.concatenate(vectors).astype(np.float32)
    options = options.resolved(*embeddings.shape)  # `auto`: the kind for this many rows
    _write_arrays(out_dir, embeddings, rows, options)
    meta = _write_meta(out_dir, len(rows), int(embeddings.shape[1]), digest, options,
                       thumbnail_size)
    return {"rows": len(rows), "dim": meta["dim"], "skipped": skipped, "search": options.kind}


def _write_meta(out_dir: Path, rows: int, dim: int, digest: str, options: SearchOptions,
                thumbnail_size: int) -> dict[str, Any]:
    meta = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "rows": rows, "dim": dim,
            "bundle_digest": digest, "search": asdict(options), "thumbnail_size": thumbnail_size,
            "files": {p.name: file_sha256(p) for p in sorted(out_dir.iterdir())
                      if p.name in (EMBEDDINGS, ITEMS, THUMBNAILS, FAISS)}}
    write_json(out_dir / INDEX_JSON, meta)  # last: a folder without it is no index
    return meta


def with_search(index_dir: Path | str, out_dir: Path | str,
                options: SearchOptions) -> dict[str, Any]:
    """A copy of a checked index with another search kind or settings, built from its stored
    embeddings: no image is embedded again (a 123k-image collection takes seconds, not an
    `index` stage run). The items and thumbnails are hard links where the filesystem allows."""
    source = ImageIndex.load(index_dir)
    options = options.resolved(*source.embeddings.shape)
    out_dir = Path(out_dir)
    if out_dir.resolve() == source.folder.resolve():
        raise ImageIndexError(f"{out_dir}: the copy needs a folder of its own")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / INDEX_JSON).unlink(missing_ok=True)  # no index until the new index.json is written
    for name in (EMBEDDINGS, ITEMS, THUMBNAILS):
        _link_or_copy(source.folder / name, out_dir / name)
    faiss_path = out_dir / FAISS
    faiss_path.unlink(missing_ok=True)
    if options.kind != "exact":
        with atomic_write(faiss_path) as tmp:
            FaissSearch.build(source.embeddings, options).save(tmp)
    return _write_meta(out_dir, len(source), int(source.meta["dim"]), source.bundle_digest,
                       options, int(source.meta["thumbnail_size"]))


def _link_or_copy(src: Path, dst: Path) -> None:
    import shutil

    dst.unlink(missing_ok=True)
    try:
        dst.hardlink_to(src)
    except OSError:  # another filesystem, or links not allowed
        shutil.copyfile(src, dst)


def _batches(items: Iterable[Item], size: int) -> Iterator[list[Item]]:
    batch: list[Item] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_arrays(out_dir: Path, embeddings: np.ndarray, rows: list[dict[str, Any]],
                  options: SearchOptions) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    np.save(buffer, embeddings)
    write_bytes(out_dir / EMBEDDINGS, buffer.getvalue())
    with atomic_write(out_dir / ITEMS) as tmp:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
    faiss_path = out_dir / FAISS
    if options.kind == "exact":
        faiss_path.unlink(missing_ok=True)  # a stale approximate index must not ride along
    else:
        with atomic_write(faiss_path) as tmp:
            FaissSearch.build(embeddings, options).save(tmp)


class ImageIndex:
    """A loaded index: embeddings, items, thumbnails and its searcher."""

    def __init__(self, folder: Path, meta: dict[str, Any], embeddings: np.ndarray,
                 items: dict[str, list[Any]], searcher: Searcher) -> None:
        self.folder = folder
        self.meta = meta
        self.embeddings = embeddings
        self.keys: list[str] = items["key"]
        self.captions: list[str] = items["caption"]
        self._thumbs = list(zip(items["thumb_offset"], items["thumb_size"], strict=True))
        # Mapped, not read: a large collection's thumbnails stay on disk until asked for.
        self._thumb_data = np.memmap(folder / THUMBNAILS, dtype=np.uint8, mode="r")
        self.position = {key: i for i, key in enumerate(self.keys)}
        self.searcher = searcher

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def bundle_digest(self) -> str:
        return str(self.meta["bundle_digest"])

    @classmethod
    def load(cls, folder: Path | str, bundle_digest: str | None = None) -> ImageIndex:
        """Load and check an index; `bundle_digest`: the bundle it must have been made by."""
        import pyarrow.parquet as pq

        folder = Path(folder)
        meta = _read_meta(folder)
        if bundle_digest is not None and meta.get("bundle_digest") != bundle_digest:
            made_by = str(meta.get("bundle_digest"))[:12]
            raise ImageIndexError(f"{folder}: made by bundle {made_by}, not by the bundle "
                                  f"being served ({bundle_digest[:12]})")
        for name, want in meta["files"].items():
            if not (folder / name).is_file() or file_sha256(folder / name) != want:
                raise ImageIndexError(f"{folder}: {name} is missing or does not match index.json")
        embeddings = np.load(folder / EMBEDDINGS, allow_pickle=False)
        items = pq.read_table(folder / ITEMS).to_pydict()
        rows = meta["rows"]
        if embeddings.shape != (rows, meta["dim"]) or len(items.get("key", [])) != rows:
            raise ImageIndexError(f"{folder}: {embeddings.shape} embeddings and "
                              f"{len(items.get('key', []))} items, index.json says {rows} rows")
        options = SearchOptions(**meta["search"])
        searcher: Searcher = (ExactSearch(embeddings) if options.kind == "exact"
                              else FaissSearch.load(folder / FAISS, options))
        return cls(folder, meta, embeddings, items, searcher)

    def search(self, query: np.ndarray, k: int) -> list[tuple[int, float]]:
        """(row, score) of the k best rows for one unit-length query vector, best first."""
        scores, ids = self.searcher.search(np.asarray(query, np.float32)[None], k)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]

    def thumbnail(self, key: str) -> bytes | None:
        row = self.position.get(key)
        if row is None:
            return None
        offset, size = self._thumbs[row]
        return self._thumb_data[offset:offset + size].tobytes()


def _read_meta(folder: Path) -> dict[str, Any]:
    path = folder / INDEX_JSON
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ImageIndexError(f"{folder}: no readable {INDEX_JSON} "
                              f"({type(err).__name__})") from None
    if meta.get("format") != INDEX_FORMAT or meta.get("version") != INDEX_VERSION:
        raise ImageIndexError(f"{path}: not a {INDEX_FORMAT} v{INDEX_VERSION} index")
    return meta
