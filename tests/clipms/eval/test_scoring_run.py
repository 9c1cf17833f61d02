"""The evaluate library and stage on real shards and a real (tiny, random-init) MindSpore model.

The numbers of a random model are near chance; what these tests pin down is the plumbing: every
caption is kept with its own image through batching, the zero-shot sets read their classes right,
and the stage writes exactly its declared outputs. The trained model's skill is checked end to end
in test_export.py (dvc repro to export on the tiny synthetic config).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from clipms.data import webds
from clipms.data.preprocess import preprocess_image
from clipms.eval import metrics
from clipms.model.architecture import DEFAULT_PRESET
from clipms.text.clip_tokenizer import Tokenizer
from clipms.train.trained import RunConfig, load_clip
from harness.dvc_workspace import PROJECT_ROOT, run, tool_env
from harness.hostile_images import png_bomb
from harness.tiny_model import jpeg_bytes, make_val_shards, random_images, write_trained

# the module's model and its scoring graphs: about 14 CPU-s, past the fast tier's per-test budget
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder laid out as the pipeline's: models/ from 'train', data/shards from 'shard'."""
    root = tmp_path_factory.mktemp("eval_ws")
    paths = write_trained(root / "models", seed=0)
    samples = make_val_shards(root / "data" / "shards")
    run_cfg = RunConfig.read(paths["config"])
    return {"root": root, "samples": samples, "paths": paths, "run": run_cfg,
            "net": load_clip(paths["checkpoint"], run_cfg.model),
            "tokenizer": Tokenizer.load(paths["tokenizer"])}


def one_by_one(ws):
    """Features computed image by image and caption by caption: no batching to get wrong."""
    import mindspore as ms

    net, pre, tok = ws["net"], ws["run"].preprocess, ws["tokenizer"]
    images, texts, owners = [], [], []
    for i, (_, data, captions, _) in enumerate(ws["samples"]):
        x = preprocess_image(data, pre)[None]
        images.append(net.encode_image(ms.Tensor(x)).asnumpy()[0])
        for caption in captions:
            texts.append(net.encode_text(ms.Tensor(tok.encode([caption]))).asnumpy()[0])
            owners.append(i)
    return np.stack(images), np.stack(texts), np.array(owners)


def test_retrieval_and_zeroshot_match_an_unbatched_recomputation(workspace):
    """The batched embedding keeps every image with its own captions (features equal to the
    one-by-one ones up to fp32 rounding, owners exactly), and the report scores those features.
    The metrics are compared on the batched features: an untrained net's scores nearly tie, and a
    batch's other rounding may swap two of them on some CPUs."""
    from clipms.eval.embed import CellTowers, embed_split
    from clipms.eval.scoring import ZeroShotSpec, class_features, evaluate

    ws = workspace
    spec = ZeroShotSpec(templates=("a {}.", "a picture of a {}."))
    shards = ws["root"] / "data" / "shards"
    report = evaluate(ws["net"], ws["tokenizer"], ws["run"].preprocess, shards, batch_size=3,
                      zeroshot=spec, split="val")
    towers = CellTowers(ws["net"], ws["tokenizer"], 3)
    batched = embed_split(towers, ws["run"].preprocess, shards, 3, "val")
    single_images, single_texts, owners = one_by_one(ws)
    np.testing.assert_array_equal(batched.text_to_image, owners)
    np.testing.assert_allclose(batched.image_features, single_images, atol=1e-5)
    np.testing.assert_allclose(batched.text_features, single_texts, atol=1e-5)
    images, texts = batched.image_features, batched.text_features
    want = metrics.retrieval_metrics(images, texts, owners)
    for key, value in want.items():
        assert report.metrics[key] == pytest.approx(value, abs=1e-9), key
    assert report.metrics["num_images"] == 11
    assert report.metrics["num_captions"] == owners.size == sum(1 + i % 3 for i in range(11))
    # zero-shot: image 4 has no labels; classes are the "colour shape" values that occur.
    labelled = [(i, s[3]) for i, s in enumerate(ws["samples"]) if s[3]]
    names = sorted({f"{lab['colour']} {lab['shape']}" for _, lab in labelled})
    assert report.class_names == names
    labels = np.array([names.index(f"{lab['colour']} {lab['shape']}") for _, lab in labelled])
    classes = class_features(CellTowers(ws["net"], ws["tokenizer"], 64), names, spec.templates)
    want_zs = metrics.zeroshot_metrics(images[[i for i, _ in labelled]], classes, labels)
    for key, value in want_zs.items():
        assert report.metrics[key] == pytest.approx(value, abs=1e-9), key
    assert report.metrics["zeroshot_images"] == 10 and report.metrics["zeroshot_skipped"] == 1
    assert report.metrics["chance_zeroshot_top1"] == pytest.approx(1 / len(names))
    assert report.metrics["chance_t2i_R@1"] == pytest.approx(1 / 11)
    assert [row["k"] for row in report.recall_curve] == list(range(1, 12))
    assert report.recall_curve[-1]["t2i"] == 1.0  # K = all images
    assert len(report.predictions) == 10 and int(report.confusion.sum()) == 10


def test_label_fields_that_no_image_has_are_a_clear_error(workspace):
    from clipms.eval.scoring import EvaluationError, ZeroShotSpec, evaluate

    ws = workspace
    with pytest.raises(EvaluationError, match=r"no val image has label fields \['species'\]"):
        evaluate(ws["net"], ws["tokenizer"], ws["run"].preprocess,
                 ws["root"] / "data" / "shards", 8, ZeroShotSpec(label_fields=("species",)),
                 split="val")


def test_folder_per_class_zeroshot_counts_broken_images(workspace, tmp_path):
    from clipms.eval.embed import CellTowers
    from clipms.eval.zeroshot import zeroshot_from_folder

    for c, name in enumerate(["red_circle", "blue_square", "green_star"]):
        (tmp_path / name).mkdir()
        for j, image in enumerate(random_images(2 + c, seed=c)):
            image.save(tmp_path / name / f"{j}.png")
    (tmp_path / "blue_square" / "broken.jpg").write_bytes(b"not a jpeg")
    (tmp_path / "red_circle" / "bomb.png").write_bytes(png_bomb())  # 64 MP in 8 KB: skipped
    (tmp_path / "blue_square" / "notes.txt").write_text("ignored: not an image")
    towers = CellTowers(workspace["net"], workspace["tokenizer"], 2)
    zs = zeroshot_from_folder(towers, workspace["run"].preprocess, tmp_path, 2, None)
    assert zs.class_names == ["blue square", "green star", "red circle"]  # sorted folders
    assert zs.labels.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert zs.skipped == 2 and zs.image_features.shape == (9, 32)


def test_webdataset_cls_zeroshot(workspace, tmp_path):
    from clipms.eval.embed import CellTowers
    from clipms.eval.zeroshot import EvaluationError, zeroshot_from_webdataset

    images = random_images(4, seed=9)
    jpgs = [jpeg_bytes(image) for image in images]
    webds.write_tar(tmp_path / "000000.tar", [
        ("a", {"jpg": jpgs[0], "cls": b"1"}),
        ("b", {"jpg": jpgs[1], "json": json.dumps({"cls": 0}).encode()}),
        ("c", {"jpg": jpgs[2]}),                 # no class: skipped
        ("d", {"jpg": jpgs[3], "cls": b"7"}),    # out of range: skipped
    ])
    towers = CellTowers(workspace["net"], workspace["tokenizer"], 8)
    zs = zeroshot_from_webdataset(towers, workspace["run"].preprocess, tmp_path, 8,
                                  ["cat", "dog"])
    assert zs.labels.tolist() == [1, 0] and zs.skipped == 2 and zs.class_names == ["cat", "dog"]
    with pytest.raises(EvaluationError, match="class_names"):
        zeroshot_from_webdataset(towers, workspace["run"].preprocess, tmp_path, 8, None)


def frame_components(png, rgb, min_pixels=200):
    """Connected regions (4-neighbour) of pixels exactly `rgb` with at least `min_pixels`: the
    solid frames the gallery bakes around its tiles."""
    from PIL import Image

    pixels = np.asarray(Image.open(png).convert("RGB"))
    mask = (pixels == np.array(rgb, np.uint8)).all(axis=2)
    seen = np.zeros_like(mask)
    sizes = []
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        seen[y, x], stack, size = True, [(y, x)], 0
        while stack:
            cy, cx = stack.pop()
            size += 1
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] \
                        and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        sizes.append(size)
    return [size for size in sizes if size >= min_pixels]


@pytest.mark.slow  # renders or runs the stage on a trained model
def test_gallery_renders_every_tile_with_its_hits(workspace, tmp_path):
    from clipms.eval.gallery import HIT_RGB, MISS_RGB, QUERY_RGB
    from clipms.eval.outputs import GallerySpec, write_gallery
    from clipms.eval.scoring import ZeroShotSpec, evaluate

    ws = workspace
    shards = ws["root"] / "data" / "shards"
    report = evaluate(ws["net"], ws["tokenizer"], ws["run"].preprocess, shards, 4,
                      ZeroShotSpec(source="none"), split="val")
    png = tmp_path / "gallery.png"
    gallery = write_gallery(report, png, shards, "val", GallerySpec(4, 2, 3), ("colour",))
    assert gallery.tiles == 4 * 3 + 2
    # the results against a brute-force ranking of the unbatched features
    images, texts, owners = one_by_one(ws)
    images /= np.linalg.norm(images, axis=1, keepdims=True)
    texts /= np.linalg.norm(texts, axis=1, keepdims=True)
    colour = [s[3]["colour"] if s[3] else None for s in ws["samples"]]
    for query in gallery.text_queries:
        row = owners[query.index]
        assert query.index == int(np.flatnonzero(owners == row)[0])  # its first caption
        assert [r.index for r in query.results] == list(np.argsort(-(images @ texts[query.index]),
                                                                   kind="stable")[:3])
        for r in query.results:
            assert r.hit == (r.index == row or (colour[row] is not None
                                                and colour[r.index] == colour[row]))
    for query in gallery.image_queries:
        assert [r.index for r in query.results] == list(np.argsort(-(texts @ images[query.index]),
                                                                   kind="stable")[:3])
    assert len({q.index for q in gallery.image_queries}
               | {int(owners[q.index]) for q in gallery.text_queries}) == 6  # all different
    hits = sum(r.hit for q in gallery.text_queries for r in q.results)
    assert len(frame_components(png, HIT_RGB)) == hits
    assert len(frame_components(png, MISS_RGB)) == 4 * 3 - hits
    assert len(frame_components(png, QUERY_RGB)) == 2


@pytest.mark.slow  # renders or runs the stage on a trained model
def test_stage_writes_its_declared_outputs(workspace):
    root = workspace["root"]
    (root / "params.yaml").write_text(
        "evaluate:\n  batch_size: 4\n  zeroshot:\n    label_fields: [colour]\n"
        "    templates: ['a {} thing.']\n    attributes: {shape: ['a {}.']}\n"
        "  gallery: {text_queries: 2, image_queries: 1, top_k: 3}\n")
    env = {**tool_env(), "PYTHONPATH": str(PROJECT_ROOT)}  # the stage runs in this folder
    proc = run(["python", "-m", "stages.evaluate"], cwd=root, timeout=600, env=env)
    assert "i2t_R@1" in proc.stdout and "zeroshot_shape_top1" in proc.stdout
    found = json.loads((root / "metrics" / "eval.json").read_text())
    for key in ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "mAP@10",
                "zeroshot_top1", "zeroshot_mean_per_class_recall", "num_images", "num_captions",
                "chance_i2t_R@1", "chance_zeroshot_top1", "zeroshot_shape_top1",
                "chance_zeroshot_shape_top1", "zeroshot_shape_mean_per_class_recall"):
        assert key in found, key
    assert "zeroshot_top5" not in found  # 3 colours < 5 classes
    assert found["zeroshot_classes"] == 3 and found["zeroshot_shape_classes"] == 2
    table = sorted(p.name for p in (root / "metrics" / "quality").iterdir())
    assert table == ["i2t.json", "t2i.json", "zeroshot.json", "zeroshot_shape.json"]
    curve = (root / "plots" / "recall_at_k.csv").read_text().splitlines()
    assert curve[0] == "k,i2t,t2i" and len(curve) == 12
    rows = (root / "plots" / "confusion_matrix.csv").read_text().splitlines()
    assert rows[0] == "actual,predicted" and len(rows) == 11
    for png in ("confusion_matrix.png", "recall_at_k.png", "retrieval_gallery.png"):
        assert (root / "plots" / png).read_bytes()[:4] == b"\x89PNG", png
    benchmark = sorted(p.name for p in (root / "metrics" / "clip_benchmark").iterdir())
    preset = DEFAULT_PRESET  # this params.yaml names no train.preset
    assert benchmark == [f"synthetic_val{part}_clip.ckpt_clipms-{preset}_en_zeroshot_{task}.json"
                         for part, task in (("", "retrieval"), ("_colour", "classification"),
                                            ("_shape", "classification"))]

    (root / "params.yaml").write_text("evaluate:\n  zeroshot:\n    source: imagenet\n")
    bad = run(["python", "-m", "stages.evaluate"], cwd=root, timeout=600, check=False, env=env)
    assert bad.returncode == 1 and "evaluate.zeroshot.source" in bad.stderr


def test_an_undecodable_val_image_is_a_bad_sample_not_a_crash(workspace, tmp_path):
    """A decompression bomb among the val images is left out and named; retrieval
    and zero-shot on labels run on the other images."""
    from clipms.eval.scoring import ZeroShotSpec, evaluate

    ws = workspace
    files = [(key, {"jpg": data, "json": json.dumps({"captions": captions, "key": key,
                                                     "split": "val", "labels": labels}).encode()})
             for key, data, captions, labels in ws["samples"]]
    bomb_meta = {"captions": ["a bomb"], "key": "000099", "split": "val",
                 "labels": {"colour": "red", "shape": "circle"}}
    files.insert(2, ("000099", {"png": png_bomb(), "json": json.dumps(bomb_meta).encode()}))
    webds.write_manifest(tmp_path, 4, {"val": webds.write_split(tmp_path, "val", files, 4)})
    report = evaluate(ws["net"], ws["tokenizer"], ws["run"].preprocess, tmp_path, batch_size=3,
                      zeroshot=ZeroShotSpec(), split="val")
    assert report.embeddings.skipped == ["000099"]
    assert report.metrics["num_images"] == 11 and "000099" not in report.embeddings.keys
    assert report.metrics["zeroshot_images"] == 10
