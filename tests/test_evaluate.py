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

from clipms import metrics, webds
from clipms.preprocess import preprocess_image
from clipms.tokenizer import Tokenizer
from clipms.trained import RunConfig, load_clip
from tests.hostile_images import png_bomb
from tests.tiny_model import jpeg_bytes, make_val_shards, random_images, write_trained
from tests.workspace import PROJECT_ROOT, run, tool_env


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
    from clipms.evaluation import ZeroShotSpec, class_features, evaluate

    ws = workspace
    spec = ZeroShotSpec(templates=("a {}.", "a picture of a {}."))
    report = evaluate(ws["net"], ws["tokenizer"], ws["run"].preprocess,
                      ws["root"] / "data" / "shards", batch_size=3, zeroshot=spec)
    images, texts, owners = one_by_one(ws)
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
    classes = class_features(ws["net"], ws["tokenizer"], names, spec.templates, 64)
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
    from clipms.evaluation import EvaluationError, ZeroShotSpec, evaluate

    ws = workspace
    with pytest.raises(EvaluationError, match=r"no val image has label fields \['species'\]"):
        evaluate(ws["net"], ws["tokenizer"], ws["run"].preprocess,
                 ws["root"] / "data" / "shards", 8, ZeroShotSpec(label_fields=("species",)))


def test_folder_per_class_zeroshot_counts_broken_images(workspace, tmp_path):
    from clipms.evaluation import zeroshot_from_folder

    for c, name in enumerate(["red_circle", "blue_square", "green_star"]):
        (tmp_path / name).mkdir()
        for j, image in enumerate(random_images(2 + c, seed=c)):
            image.save(tmp_path / name / f"{j}.png")
    (tmp_path / "blue_square" / "broken.jpg").write_bytes(b"not a jpeg")
    (tmp_path / "red_circle" / "bomb.png").write_bytes(png_bomb())  # 64 MP in 8 KB: skipped
    (tmp_path / "blue_square" / "notes.txt").write_text("ignored: not an image")
    zs = zeroshot_from_folder(workspace["net"], workspace["run"].preprocess, tmp_path, 2, None)
    assert zs.class_names == ["blue square", "green star", "red circle"]  # sorted folders
    assert zs.labels.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert zs.skipped == 2 and zs.image_features.shape == (9, 32)


def test_webdataset_cls_zeroshot(workspace, tmp_path):
    from clipms.evaluation import EvaluationError, zeroshot_from_webdataset

    images = random_images(4, seed=9)
    jpgs = [jpeg_bytes(image) for image in images]
    webds.write_tar(tmp_path / "000000.tar", [
        ("a", {"jpg": jpgs[0], "cls": b"1"}),
        ("b", {"jpg": jpgs[1], "json": json.dumps({"cls": 0}).encode()}),
        ("c", {"jpg": jpgs[2]}),                 # no class: skipped
        ("d", {"jpg": jpgs[3], "cls": b"7"}),    # out of range: skipped
    ])
    zs = zeroshot_from_webdataset(workspace["net"], workspace["run"].preprocess, tmp_path, 8,
                                  ["cat", "dog"])
    assert zs.labels.tolist() == [1, 0] and zs.skipped == 2 and zs.class_names == ["cat", "dog"]
    with pytest.raises(EvaluationError, match="class_names"):
        zeroshot_from_webdataset(workspace["net"], workspace["run"].preprocess, tmp_path, 8, None)


def test_stage_writes_its_declared_outputs(workspace):
    root = workspace["root"]
    (root / "params.yaml").write_text(
        "evaluate:\n  batch_size: 4\n  zeroshot:\n    label_fields: [colour]\n"
        "    templates: ['a {} thing.']\n")
    env = {**tool_env(), "PYTHONPATH": str(PROJECT_ROOT)}  # the stage runs in this folder
    proc = run(["python", "-m", "stages.evaluate"], cwd=root, timeout=600, env=env)
    assert "i2t_R@1" in proc.stdout
    found = json.loads((root / "metrics" / "eval.json").read_text())
    for key in ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "mAP@10",
                "zeroshot_top1", "zeroshot_mean_per_class_recall", "num_images", "num_captions",
                "chance_i2t_R@1", "chance_zeroshot_top1"):
        assert key in found, key
    assert "zeroshot_top5" not in found  # 3 colours < 5 classes
    assert found["zeroshot_classes"] == 3
    curve = (root / "plots" / "recall_at_k.csv").read_text().splitlines()
    assert curve[0] == "k,i2t,t2i" and len(curve) == 12
    rows = (root / "plots" / "confusion_matrix.csv").read_text().splitlines()
    assert rows[0] == "actual,predicted" and len(rows) == 11
    assert (root / "plots" / "confusion_matrix.png").read_bytes()[:4] == b"\x89PNG"

    (root / "params.yaml").write_text("evaluate:\n  zeroshot:\n    source: imagenet\n")
    bad = run(["python", "-m", "stages.evaluate"], cwd=root, timeout=600, check=False, env=env)
    assert bad.returncode == 1 and "evaluate.zeroshot.source" in bad.stderr
