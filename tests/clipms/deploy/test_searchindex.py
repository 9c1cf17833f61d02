"""The search index (clipms.deploy.searchindex, clipms.deploy.search) and the `index` stage, on a
real tiny bundle."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clipms.deploy.search import ExactSearch, FaissSearch, SearchOptions
from clipms.deploy.searchindex import (
    EMBEDDINGS,
    ImageIndex,
    ImageIndexError,
    Item,
    build_index,
    bundle_digest,
)
from harness.dvc_workspace import run, tool_env
from harness.hostile_images import encoded, png_bomb
from harness.tiny_model import jpeg_bytes, make_val_shards, random_images


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness.tiny_model import export_tiny_bundle

    return export_tiny_bundle(tmp_path_factory.mktemp("index-bundle"))


@pytest.fixture(scope="module")
def encoder(bundle: Path):
    from clipms.deploy.infer import Encoder

    return Encoder(bundle, batch_size=4, kernel_fusion=False)


def collection(n: int = 9) -> list[Item]:
    images = random_images(n, seed=3, size=(48, 40))
    return [Item(f"k{i:03d}", jpeg_bytes(im), f"caption {i}", "val" if i % 3 else "train")
            for i, im in enumerate(images)]


def unit_rows(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


class MeanColourEncoder:
    """Stands in for the exported model, which only the slow tier exports: a thumbnail does not
    depend on the embeddings, so each image is embedded as its mean colour (unit length). The
    decoding, preprocessing, thumbnails, files and loading are the index's own."""

    def __init__(self, image_size: int = 16) -> None:
        from clipms.data.preprocess import PreprocessConfig

        self.preprocess = PreprocessConfig(image_size=image_size)

    def encode_preprocessed(self, images: np.ndarray) -> np.ndarray:
        vectors = images.reshape(len(images), 3, -1).mean(axis=2) + 4.0
        return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def test_every_key_serves_its_own_thumbnail(tmp_path) -> None:
    """Each key's thumbnail is that image's own (its colour and shape, not a neighbour's), the
    thumbnails lie back to back from offset 0 and their sizes add up to the file, across
    batches and skipped items."""
    import pyarrow.parquet as pq

    colours = [(220, 30, 30), (30, 200, 40), (40, 50, 210), (230, 220, 40), (20, 20, 20),
               (240, 240, 240), (160, 40, 170)]
    sizes = [(48, 40), (30, 60), (64, 64), (20, 50), (70, 35), (40, 40), (56, 24)]
    items = [Item(f"k{i}", jpeg_bytes(Image.new("RGB", size, colour)), f"c{i}", "val")
             for i, (colour, size) in enumerate(zip(colours, sizes, strict=True))]
    items.insert(3, Item("broken", b"not an image", "", "val"))  # skipped, between batches
    report = build_index(MeanColourEncoder(), items, tmp_path / "index", "digest",
                         SearchOptions(), thumbnail_size=16, batch_size=3)
    assert report["rows"] == len(colours) and report["skipped"]["undecodable_image"] == 1
    index = ImageIndex.load(tmp_path / "index", bundle_digest="digest")
    for i, (colour, (width, height)) in enumerate(zip(colours, sizes, strict=True)):
        thumb = Image.open(io.BytesIO(index.thumbnail(f"k{i}")))
        scale = 16 / max(width, height)  # its own shape, shrunk to fit 16 x 16
        assert thumb.format == "JPEG" and thumb.size == (round(width * scale),
                                                         round(height * scale))
        mean = np.asarray(thumb.convert("RGB"), np.float64).reshape(-1, 3).mean(axis=0)
        np.testing.assert_allclose(mean, colour, atol=12, err_msg=f"k{i}")
    items_table = pq.read_table(tmp_path / "index" / "items.parquet").to_pydict()
    offsets, lengths = items_table["thumb_offset"], items_table["thumb_size"]
    assert offsets == [sum(lengths[:i]) for i in range(len(lengths))] and min(lengths) > 0
    assert sum(lengths) == (tmp_path / "index" / "thumbnails.bin").stat().st_size


@pytest.mark.slow  # exports a bundle (the module fixture)
def test_build_and_load_round_trip(encoder, bundle, tmp_path) -> None:
    items = collection()
    hostile = [Item("bomb", png_bomb(), "a bomb", "val"), Item("gif", encoded("GIF"), "", "val"),
               Item("k001", items[0].image, "a repeated key", "val")]
    digest = bundle_digest(bundle)
    report = build_index(encoder, [*items[:5], *hostile, *items[5:]], tmp_path / "index", digest,
                         SearchOptions(), thumbnail_size=16, batch_size=4)
    assert report == {"rows": 9, "dim": 32, "skipped": {"undecodable_image": 2,
                                                        "duplicate_key": 1}, "search": "exact"}
    index = ImageIndex.load(tmp_path / "index", bundle_digest=digest)
    assert index.keys == [item.key for item in items] and index.captions[4] == "caption 4"
    want = encoder.encode_images([item.image for item in items])
    np.testing.assert_allclose(index.embeddings, want, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(index.embeddings, axis=1), 1.0, atol=1e-5)
    thumb = Image.open(io.BytesIO(index.thumbnail("k002")))
    assert thumb.format == "JPEG" and thumb.size == (16, 13)  # 48x40 shrunk to fit 16x16
    assert index.thumbnail("nope") is None
    # The planted neighbour: an item's own embedding finds it first, with cosine 1.
    row, score = index.search(want[6], 3)[0]
    assert index.keys[row] == "k006" and score == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow  # exports a bundle (the module fixture)
def test_an_index_of_another_bundle_or_with_a_changed_file_is_refused(encoder, bundle,
                                                                       tmp_path) -> None:
    folder = tmp_path / "index"
    build_index(encoder, collection(4), folder, bundle_digest(bundle), SearchOptions())
    with pytest.raises(ImageIndexError, match="made by bundle .* not by the bundle being served"):
        ImageIndex.load(folder, bundle_digest="0" * 64)
    other = tmp_path / "other-bundle"
    shutil.copytree(bundle, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["padding"] = None  # any byte of any bundle file changes the digest
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert bundle_digest(other) != bundle_digest(bundle)
    with pytest.raises(ImageIndexError, match="made by bundle"):
        ImageIndex.load(folder, bundle_digest=bundle_digest(other))
    np.save(folder / EMBEDDINGS, -np.load(folder / EMBEDDINGS))
    with pytest.raises(ImageIndexError, match="embeddings.npy is missing or does not match"):
        ImageIndex.load(folder, bundle_digest=bundle_digest(bundle))
    (folder / "index.json").unlink()
    with pytest.raises(ImageIndexError, match="no readable index.json"):
        ImageIndex.load(folder)


def test_exact_search_is_the_brute_force_answer_in_chunks() -> None:
    vectors, queries = unit_rows(1000, 16, 0), unit_rows(5, 16, 1)
    scores, ids = ExactSearch(vectors, chunk_rows=64).search(queries, 10)
    brute = queries @ vectors.T
    want = np.argsort(-brute, axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_allclose(scores, np.take_along_axis(brute, want, axis=1), atol=1e-6)
    assert ExactSearch(vectors[:3]).search(queries, 10)[1].shape == (5, 3)  # k cut to N


@pytest.mark.parametrize(("kind", "min_recall"), [("hnsw", 0.9), ("ivf", 0.999)])
def test_faiss_indexes_agree_with_exact_search(kind, min_recall, tmp_path) -> None:
    # Random vectors are the hard case for approximate search (benchmarks/bench_index.py
    # measures it at scale); here: HNSW close to exact, IVF scanning every cell exactly equal.
    pytest.importorskip("faiss")
    vectors, queries = unit_rows(2000, 32, 2), unit_rows(50, 32, 3)
    _, exact = ExactSearch(vectors).search(queries, 10)
    options = SearchOptions(kind=kind, ivf_nlist=20, ivf_nprobe=20)
    approx = FaissSearch.build(vectors, options)
    approx.save(tmp_path / "faiss.index")
    _, found = FaissSearch.load(tmp_path / "faiss.index", options).search(queries, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, exact, strict=True)])
    assert recall >= min_recall, recall
    _, own = approx.search(vectors[:20], 1)
    assert (own[:, 0] == np.arange(20)).mean() >= 0.95  # each vector finds itself


@pytest.mark.slow
def test_index_stage_writes_its_declared_outputs(bundle, tmp_path) -> None:
    from clipms.utils.jsonio import read_json

    ws = tmp_path / "ws"
    make_val_shards(ws / "data" / "shards", n_images=11, per_shard=4)
    shutil.copytree(bundle, ws / "models" / "export")
    (ws / "params.yaml").write_text("index:\n  splits: [val]\n  thumbnail_size: 32\n"
                                    "  batch_size: 4\n")
    out = run([sys.executable, "-m", "stages.index"], ws, env=tool_env(), timeout=600)
    assert "index: 11 images of ['val']" in out.stdout
    index = ImageIndex.load(ws / "models" / "index", bundle_digest(ws / "models" / "export"))
    assert index.keys[:3] == ["000000", "000001", "000002"] and len(index) == 11
    assert read_json(ws / "metrics" / "index.json")["rows"] == 11
    (ws / "params.yaml").write_text("index:\n  search: annoy\n")
    bad = run([sys.executable, "-m", "stages.index"], ws, env=tool_env(), check=False)
    assert bad.returncode == 1 and "index.search = 'annoy'" in bad.stderr
    (ws / "params.yaml").write_text("runtime:\n  device_target: TPU\n")  # it reads `runtime`
    bad = run([sys.executable, "-m", "stages.index"], ws, env=tool_env(), check=False)
    assert bad.returncode == 1 and "runtime.device_target = 'TPU'" in bad.stderr


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_with_search_serves_the_same_collection_with_another_search(encoder, bundle, kind,
                                                                    tmp_path) -> None:
    pytest.importorskip("faiss")
    from clipms.deploy.searchindex import with_search

    digest = bundle_digest(bundle)
    build_index(encoder, collection(), tmp_path / "exact", digest, SearchOptions())
    exact = ImageIndex.load(tmp_path / "exact", bundle_digest=digest)
    options = SearchOptions(kind=kind, ivf_nlist=1, ivf_nprobe=1)
    meta = with_search(tmp_path / "exact", tmp_path / kind, options)
    again = ImageIndex.load(tmp_path / kind, bundle_digest=digest)  # files match index.json
    assert meta["search"]["kind"] == kind and isinstance(again.searcher, FaissSearch)
    assert again.keys == exact.keys and again.thumbnail("k003") == exact.thumbnail("k003")
    query = exact.embeddings[4]
    found, want = again.search(query, 9), exact.search(query, 9)  # 9 rows: HNSW/1 cell see all
    assert [row for row, _ in found] == [row for row, _ in want]
    np.testing.assert_allclose([s for _, s in found], [s for _, s in want], atol=1e-5)
    with_search(tmp_path / kind, tmp_path / "back", SearchOptions())
    assert not (tmp_path / "back" / "faiss.index").exists()
    with pytest.raises(ImageIndexError, match="a folder of its own"):
        with_search(tmp_path / kind, tmp_path / kind, options)


@pytest.mark.parametrize(("rows", "dim", "kind"), [(2_000, 128, "exact"), (15_625, 128, "exact"),
                                                  (15_626, 128, "hnsw"), (123_287, 128, "hnsw"),
                                                  (3_906, 512, "exact"), (3_907, 512, "hnsw")])
def test_auto_search_scans_small_collections_and_uses_hnsw_beyond(rows, dim, kind) -> None:
    options = SearchOptions(kind="auto", hnsw_ef_search=77)
    assert options.resolved(rows, dim) == SearchOptions(kind=kind, hnsw_ef_search=77)
    assert SearchOptions(kind="ivf").resolved(rows, dim).kind == "ivf"  # only auto is resolved


def test_an_auto_index_records_the_kind_it_chose(encoder, bundle, tmp_path, monkeypatch) -> None:
    from clipms.deploy import search

    digest = bundle_digest(bundle)
    report = build_index(encoder, collection(), tmp_path / "small", digest, SearchOptions("auto"))
    assert report["search"] == "exact" and not (tmp_path / "small" / "faiss.index").exists()
    assert ImageIndex.load(tmp_path / "small").meta["search"]["kind"] == "exact"
    pytest.importorskip("faiss")
    monkeypatch.setattr(search, "AUTO_EXACT_MAX_CELLS", 8 * 32)  # 9 rows of 32 dims: beyond
    report = build_index(encoder, collection(), tmp_path / "big", digest, SearchOptions("auto"))
    loaded = ImageIndex.load(tmp_path / "big")
    assert report["search"] == "hnsw" and isinstance(loaded.searcher, FaissSearch)
    assert loaded.meta["search"]["kind"] == "hnsw"


def test_the_index_stage_defaults_to_auto_as_params_yaml_says() -> None:
    import yaml

    from pipeline.params import validate_section
    from stages.index import IndexParams

    section = yaml.safe_load((Path(__file__).parents[3] / "params.yaml").read_text())["index"]
    assert validate_section("index", IndexParams, section) == IndexParams()
    assert IndexParams().search == "auto"
