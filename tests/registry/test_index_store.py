"""The search index stored once by content (registry.index_store) in a real MLflow store (SQLite
and a local artifact folder here; the register stage against a real server in the slow test):
an unchanged index adds nothing the second time, a grown one only its new chunks, and what is
written back is byte for byte what was stored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from harness import mlflow_server as server_fixtures
from harness import register_workspace
from registry import index_store

mlflow_server = server_fixtures.mlflow_server  # the real MLflow server, the tiny bundle
server = server_fixtures.server
workspace = register_workspace.workspace
bundle = register_workspace.bundle


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from tracking.settings import client

    return client(f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}")


@pytest.fixture
def store(database, tmp_path: Path):  # noqa: ANN201
    """An experiment of its own (so its own store run and artifact folder) per test."""
    experiment = database.create_experiment(tmp_path.name, (tmp_path / "artifacts").as_uri())
    return database, experiment, tmp_path / "artifacts"


def an_index(folder: Path, rows: int, seed: int = 0) -> Path:
    """Files shaped like an index's (the store does not read them): vectors and thumbnails."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    np.save(folder / "embeddings.npy", rng.standard_normal((rows, 8)).astype(np.float32))
    thumbs = np.random.default_rng(99).integers(0, 256, rows * 300, dtype=np.uint8)
    (folder / "thumbnails.bin").write_bytes(thumbs.tobytes())
    (folder / "index.json").write_text(json.dumps({"rows": rows}))
    return folder


@pytest.mark.slow  # a SQLite MLflow store made: over the fast tier's CPU budget
def test_an_unchanged_index_is_stored_once_and_comes_back_byte_for_byte(store, tmp_path):
    mlflow_client, experiment, artifacts = store
    index = an_index(tmp_path / "index", rows=50)
    size = store_bytes(index)
    first = index_store.store_index(mlflow_client, experiment, index, chunk_bytes=4096)
    after_first = store_bytes(artifacts)
    second = index_store.store_index(mlflow_client, experiment, index, chunk_bytes=4096)

    assert first["added_bytes"] == first["total_bytes"] == size
    assert second["added_bytes"] == 0 and store_bytes(artifacts) == after_first
    assert size <= after_first < size + 4096  # the index's bytes once (+ nothing per version)
    assert second["store_run_id"] == first["store_run_id"]

    served = tmp_path / "served"
    served.mkdir()
    index_store.write_ref(second, served)
    assert index_store.materialize(served, mlflow_client.tracking_uri)
    assert sorted(p.name for p in served.iterdir()) == sorted(p.name for p in index.iterdir())
    for path in index.iterdir():
        assert (served / path.name).read_bytes() == path.read_bytes()


@pytest.mark.slow
def test_a_grown_index_adds_its_new_chunks_and_a_lost_chunk_is_named(store, tmp_path):
    mlflow_client, experiment, artifacts = store
    index_store.store_index(mlflow_client, experiment, an_index(tmp_path / "a", rows=50),
                            chunk_bytes=4096)
    grown = an_index(tmp_path / "b", rows=55, seed=1)  # a new model over 10% more images
    thumbs = (tmp_path / "a/thumbnails.bin").read_bytes()
    assert (grown / "thumbnails.bin").read_bytes()[:len(thumbs)] == thumbs  # appended
    before = store_bytes(artifacts)
    ref = index_store.store_index(mlflow_client, experiment, grown, chunk_bytes=4096)
    new_thumbs = (grown / "thumbnails.bin").stat().st_size - len(thumbs)
    changed = (grown / "embeddings.npy").stat().st_size + (grown / "index.json").stat().st_size
    assert ref["added_bytes"] <= changed + new_thumbs + 4096  # + one partly filled chunk
    assert ref["added_bytes"] < ref["total_bytes"] / 2
    assert store_bytes(artifacts) - before == ref["added_bytes"]

    served = tmp_path / "served"
    served.mkdir()
    index_store.write_ref(ref, served)
    lost = ref["files"]["embeddings.npy"]["chunks"][0]
    next(artifacts.rglob(lost)).unlink()
    with pytest.raises(index_store.IndexStoreError, match=f"chunk {lost[:16]}"):
        index_store.materialize(served, mlflow_client.tracking_uri)


class SweptBeforeTheReference:
    """The MLflow client, except that a retention sweep removes a chunk of the store just before
    the version's reference is logged: the sweep read the references a moment earlier and found
    the chunk named by none (the version that named it was removed), while this `register`
    re-used it."""

    def __init__(self, client, artifacts: Path, chunk: str) -> None:
        self._client, self._artifacts, self._chunk = client, artifacts, chunk

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._client, name)

    def log_model_artifacts(self, *args, **kwargs) -> None:
        next(self._artifacts.rglob(self._chunk)).unlink()
        self._client.log_model_artifacts(*args, **kwargs)


@pytest.mark.slow  # a SQLite MLflow store made: over the fast tier's CPU budget
def test_a_chunk_swept_while_register_re_used_it_is_stored_again(store, tmp_path):
    from registry.registration import log_index

    mlflow_client, experiment, artifacts = store
    index = an_index(tmp_path / "index", rows=50)
    ref = index_store.store_index(mlflow_client, experiment, index)  # an earlier version's
    run_id = mlflow_client.create_run(experiment).info.run_id
    model_id = mlflow_client.create_logged_model(experiment, source_run_id=run_id).model_id
    lost = ref["files"]["thumbnails.bin"]["chunks"][0]
    swept = SweptBeforeTheReference(mlflow_client, artifacts, lost)

    cost = log_index(swept, run_id, model_id, index)
    assert cost["index_added_bytes"] == (index / "thumbnails.bin").stat().st_size  # one chunk

    import mlflow

    location = mlflow_client.get_logged_model(model_id).artifact_location
    served = Path(mlflow.artifacts.download_artifacts(
        artifact_uri=f"{location}/{index_store.INDEX_ARTIFACT}", dst_path=str(tmp_path / "got")))
    assert index_store.materialize(served, mlflow_client.tracking_uri)
    assert (served / "thumbnails.bin").read_bytes() == (index / "thumbnails.bin").read_bytes()


def test_a_folder_without_a_reference_is_served_as_it_is(tmp_path):
    whole = an_index(tmp_path / "whole", rows=3)
    copy = shutil.copytree(whole, tmp_path / "copy")
    assert index_store.materialize(copy) is False
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in whole.iterdir())


@pytest.mark.parametrize("name, chunk", [
    ("../outside.bin", "0" * 64), ("/abs.bin", "0" * 64), ("sub/x.bin", "0" * 64),
    ("embeddings.npy", "../../other-run/artifact")])
def test_a_reference_that_names_a_path_or_a_non_digest_writes_nothing(tmp_path, name, chunk):
    # The reference comes from the registry: a name must not reach outside the index folder.
    folder = tmp_path / "index"
    folder.mkdir()
    ref = {"format": index_store.REF_FORMAT, "store_run_id": "r",
           "files": {name: {"chunks": [chunk], "sha256": "0" * 64}}}
    (folder / index_store.REF_FILE).write_text(json.dumps(ref))
    with pytest.raises(index_store.IndexStoreError, match="plain file name|sha256 digests"):
        index_store.materialize(folder)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["index", index_store.REF_FILE]


@pytest.mark.slow
def test_two_versions_with_the_same_index_add_its_bytes_once(workspace: Path, bundle: Path,
                                                             server) -> None:
    """The register stage against a real MLflow server (proxied artifacts), twice with the same
    bundle and index, from two pipeline runs: the index's bytes enter the artifact store once,
    and each version is served with its index from MLflow alone."""
    from clipms.deploy.searchindex import EMBEDDINGS, ImageIndex, bundle_digest
    from harness.register_workspace import prepare_workspace, register_in
    from harness.tiny_model import make_index
    from serving.source import RegistrySource
    from tracking import settings

    index = make_index(bundle, workspace / "index")
    embeddings = (index / EMBEDDINGS).read_bytes()
    earlier = {p for p in server.artifacts.rglob("*") if p.is_file()}  # other tests' too
    records = []
    for name in ("night-1", "night-2"):
        root = prepare_workspace(workspace / name, bundle, {"i2t_R@5": 0.5}, model="clip-cas")
        shutil.copytree(index, root / "models" / "index")
        code, record = register_in(root)
        assert code == 0 and record is not None
        records.append(record)

    size = sum(p.stat().st_size for p in index.iterdir())
    assert records[0]["index_bytes"] == records[1]["index_bytes"] == size
    assert (records[0]["index_added_bytes"], records[1]["index_added_bytes"]) == (size, 0)
    stored = [p for p in server.artifacts.rglob("*")
              if p.is_file() and p not in earlier and p.stat().st_size == len(embeddings)
              and p.read_bytes() == embeddings]
    assert len(stored) == 1  # not once per version
    for version in ("1", "2"):
        source = RegistrySource(f"models:/clip-cas/{version}", settings.tracking_uri())
        fetched = source.fetch(*source.current())
        try:
            loaded = ImageIndex.load(fetched.index_dir, bundle_digest(bundle))
            assert len(loaded) == 12
        finally:
            fetched.cleanup()
