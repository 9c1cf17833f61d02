"""The search index of every version, stored once by content in the MLflow artifact store.

A version's index (`clipms.deploy.searchindex`: index.json, embeddings.npy, items.parquet,
thumbnails.bin, faiss.index) used to be copied whole into each version's logged model. Here each
file is cut into fixed-size chunks, each chunk stored once, by its sha256, in one run of the
experiment (the "search-index store" run, tag `clipms.index_store`); the version's logged model
holds only `index/index.ref.json`, which names every file's size, sha256 and chunks. So:

- an unchanged index (the same bundle over the same images, e.g. a version registered again)
  adds the reference file alone (about a kilobyte);
- a new model over the same images adds its embeddings (rows x embed_dim x 4 bytes), its
  items and index.json; the thumbnails, the bulk of an index, are the same chunks;
- a night that appended images (append-only shards keep the earlier samples first, in the same
  order) changes the thumbnails file from the old end on: its earlier full chunks are stored
  already, so it adds the new thumbnails and one partly filled chunk.

`materialize` (serving's fetch) writes the files back from their chunks and checks each sha256,
so what is served is byte for byte what the index stage wrote. A version logged before this
store (its index files in the model itself) is served as it was.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

REF_FILE = "index.ref.json"
# The search index's folder inside the logged model's own artifacts (serving/ reads it), beside
# the bundle: the version points at one folder that holds both, and every log_model makes a new
# model id, so nothing logged later (export/index/register rerun in the same pipeline run, which
# continues the same MLflow run) can overwrite an earlier version's index. A folder in the run
# would be shared by every version registered from that run. The folder holds a reference
# (this module): the index files are stored once, by content, in the experiment's store
# run, so an index that did not change is not copied again; serving writes them back on fetch.
INDEX_ARTIFACT = "index"
REF_FORMAT = "clipms-index-ref"
STORE_TAG = "clipms.index_store"
STORE_RUN_NAME = "search-index store"
CHUNKS = "chunks"  # the store run's artifact folder: chunks/<sha256>
CHUNK_BYTES = 4 << 20


class IndexStoreError(RuntimeError):
    """A reference that cannot be resolved: a chunk missing or not what the reference says."""


def chunks_of(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        while block := handle.read(chunk_bytes):
            yield block


def find_store_run(mlflow_client: Any, experiment_id: str) -> str | None:
    """The experiment's store run, None when none was made yet."""
    found = mlflow_client.search_runs([experiment_id], f"tags.`{STORE_TAG}` = 'true'",
                                      max_results=1, order_by=["attributes.start_time ASC"])
    return found[0].info.run_id if found else None


def store_run(mlflow_client: Any, experiment_id: str) -> str:
    """The experiment's store run (made on first use); its id."""
    found = find_store_run(mlflow_client, experiment_id)
    if found:
        return found
    run = mlflow_client.create_run(experiment_id, run_name=STORE_RUN_NAME,
                                   tags={STORE_TAG: "true", "mlflow.note.content":
                                         "Search-index chunks by sha256, shared by every "
                                         "version's index (registry.index_store)."})
    mlflow_client.set_terminated(run.info.run_id)
    return run.info.run_id


def store_index(mlflow_client: Any, experiment_id: str, index_dir: Path | str,
                chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """Upload the chunks of `index_dir`'s files the store does not hold; the reference, with
    `added_bytes` (what this call uploaded) and `total_bytes`."""
    run_id = store_run(mlflow_client, experiment_id)
    held = {Path(a.path).name for a in mlflow_client.list_artifacts(run_id, CHUNKS)}
    files: dict[str, Any] = {}
    added = 0
    with tempfile.TemporaryDirectory(prefix="clipms-index-chunks-") as tmp:
        for path in sorted(p for p in Path(index_dir).iterdir() if p.is_file()):
            whole, digests, size = hashlib.sha256(), [], 0
            for block in chunks_of(path, chunk_bytes):
                whole.update(block)
                size += len(block)
                digest = hashlib.sha256(block).hexdigest()
                digests.append(digest)
                if digest not in held:
                    chunk = Path(tmp) / digest
                    chunk.write_bytes(block)
                    mlflow_client.log_artifact(run_id, str(chunk), CHUNKS)
                    chunk.unlink()
                    held.add(digest)
                    added += len(block)
            files[path.name] = {"bytes": size, "sha256": whole.hexdigest(), "chunks": digests}
    total = sum(f["bytes"] for f in files.values())
    return {"format": REF_FORMAT, "version": 1, "store_run_id": run_id,
            "chunk_bytes": chunk_bytes, "files": files, "added_bytes": added,
            "total_bytes": total}


def write_ref(ref: dict[str, Any], folder: Path) -> Path:
    """The reference as the file logged in the version's model (without the upload counts)."""
    kept = {k: v for k, v in ref.items() if k not in ("added_bytes", "total_bytes")}
    path = folder / REF_FILE
    path.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    return path


def materialize(index_dir: Path, tracking_uri: str | None = None) -> bool:
    """Write the files `index_dir/index.ref.json` names into `index_dir` from the store's
    chunks (each file's sha256 checked); False when the folder holds no reference (an index
    logged whole). IndexStoreError when a chunk is missing or the bytes do not match."""
    import mlflow

    ref_path = index_dir / REF_FILE
    if not ref_path.is_file():
        return False
    ref = json.loads(ref_path.read_text())
    if ref.get("format") != REF_FORMAT:
        raise IndexStoreError(f"{ref_path}: not a search-index reference")
    check_ref_names(ref, ref_path)
    run_id = ref["store_run_id"]
    with tempfile.TemporaryDirectory(prefix="clipms-index-chunks-", dir=index_dir) as tmp:
        for name, entry in sorted(ref["files"].items()):
            whole = hashlib.sha256()
            with open(index_dir / name, "wb") as out:
                for digest in entry["chunks"]:
                    block = _chunk(run_id, digest, Path(tmp), tracking_uri, mlflow)
                    whole.update(block)
                    out.write(block)
            if whole.hexdigest() != entry["sha256"]:
                raise IndexStoreError(f"index file {name}: its chunks do not make the file the "
                                      f"reference names (sha256 {entry['sha256'][:16]}...)")
    ref_path.unlink()
    return True


FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
DIGEST = re.compile(r"[0-9a-f]{64}")


def check_ref_names(ref: dict[str, Any], where: Path) -> None:
    """A reference comes from the registry: its file names must be plain names inside the index
    folder and its chunks sha256 digests, or nothing is written (IndexStoreError)."""
    for name, entry in ref["files"].items():
        if not FILE_NAME.fullmatch(name) or ".." in name:
            raise IndexStoreError(f"{where}: file name {name!r} is not a plain file name "
                                  "(letters, digits, '_', '.', '-')")
        if not all(isinstance(d, str) and DIGEST.fullmatch(d) for d in entry["chunks"]):
            raise IndexStoreError(f"{where}: chunks of {name!r} are not sha256 digests")


def _chunk(run_id: str, digest: str, tmp: Path, tracking_uri: str | None, mlflow: Any) -> bytes:
    try:
        local = mlflow.artifacts.download_artifacts(run_id=run_id,
                                                    artifact_path=f"{CHUNKS}/{digest}",
                                                    dst_path=str(tmp), tracking_uri=tracking_uri)
    except Exception as err:  # a chunk removed from the store, or the store run deleted
        raise IndexStoreError(f"search-index chunk {digest[:16]}... of store run {run_id} "
                              f"cannot be read ({type(err).__name__})") from err
    data = Path(local).read_bytes()
    Path(local).unlink()
    if hashlib.sha256(data).hexdigest() != digest:
        raise IndexStoreError(f"search-index chunk {digest[:16]}... is not what its name says")
    return data


def referenced_chunks(ref: dict[str, Any]) -> set[str]:
    """The chunks a reference needs (what a clean-up of the store must keep)."""
    return {digest for entry in ref["files"].values() for digest in entry["chunks"]}


def held_chunks(mlflow_client: Any, run_id: str) -> dict[str, int]:
    """{sha256: bytes} of every chunk the store run holds."""
    return {Path(a.path).name: int(a.file_size or 0)
            for a in mlflow_client.list_artifacts(run_id, CHUNKS) if not a.is_dir}


def collectable(held: Mapping[str, int], referenced: Iterable[str],
                marked: Iterable[str]) -> dict[str, int]:
    """The chunks a clean-up of the store may remove, {sha256: bytes}: held, named by no
    remaining reference now (`referenced`, read just before the removal), and marked: named by
    none already when an earlier clean-up, long enough ago, marked the store (`marked`).

    Mark and sweep across clean-ups, because a `store_index` (a `register`) may be running
    meanwhile: it uploads only the chunks the store lacks and re-uses the others, and its
    reference is logged after them. A chunk no reference names yet may be one a reference is
    about to name, old or new: being listed long ago is not enough (a `register` re-using an old
    chunk while the version that named it is removed). The one assumption: a `register` logs its
    reference within the wait between mark and sweep of reading the store
    (`registry.retention.LISTING_MIN_AGE_S`). Then a chunk it uploads after the mark is not
    marked, and one it re-uses or uploads before the mark is named by the time of the sweep.

    What the rule leaves, `register` closes: one that reads the store after the mark and is still
    running at the sweep can re-use a chunk already named by no reference at the mark (an index
    the same as one removed earlier, registered again), and that chunk can go before its
    reference is logged. So `registry.registration.log_index` stores the index again once its
    reference is logged, uploading whatever the store no longer holds; a sweep that reads the
    references after that sees the chunk named.
    """
    keep, before = set(referenced), set(marked)
    return {digest: size for digest, size in sorted(held.items())
            if digest not in keep and digest in before}
