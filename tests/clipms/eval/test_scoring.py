"""Per-attribute zero-shot and the CLIP_benchmark files, on hand-made embeddings (no model).

The per-attribute case is built so the answers are known by construction: colour is encoded
right for every image, shape for four of six, the count for none of one class. The
CLIP_benchmark files are checked against a re-implementation of CLIP_benchmark's own
definitions (its `recall_at_k` over a positive-pair matrix, `accuracy` over top-k, and
scikit-learn's balanced accuracy over the confusion matrix), not against clipms.eval.metrics.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from clipms.eval.clip_benchmark import BenchmarkFormatError, BenchmarkRun, output_name
from clipms.eval.embed import EvaluationError, ValEmbeddings
from clipms.eval.outputs import write_benchmark_files
from clipms.eval.scoring import ZeroShotSpec, score_embeddings
from clipms.eval.zeroshot import zeroshot_from_labels

# word -> direction; a class name's embedding is the sum of its words' directions
WORDS = {"red": [1, 0, 0, 0], "blue": [-1, 0, 0, 0], "circle": [0, 1, 0, 0],
         "star": [0, -1, 0, 0], "1": [0, 0, 1, 0], "2": [0, 0, -1, 0]}


def word_embedder(templates):
    del templates  # the hand-made "text tower" ignores the prompt around the class name
    return lambda names: np.array([np.sum([WORDS[w] for w in n.split()], axis=0) for n in names],
                                  dtype=np.float32)


def attribute_split() -> ValEmbeddings:
    """8 images: colour always encoded right; shape right for images 0, 1, 2, 5; every image
    looks like count 1; image 6 has no shape label, image 7 no labels at all."""
    rows = [  # (colour, shape, count, the shape the features show)
        ("red", "circle", 1, "circle"), ("red", "circle", 1, "circle"),
        ("blue", "circle", 1, "circle"), ("blue", "circle", 2, "star"),
        ("red", "star", 2, "circle"), ("blue", "star", 2, "star")]
    features, labels = [], []
    for colour, shape, count, shown in rows:
        features.append(np.add(WORDS[colour], WORDS[shown]) + [0, 0, 0.5, 0.1])
        labels.append({"colour": colour, "shape": shape, "count": count})
    features.append(np.add(WORDS["blue"], [0, 0.2, 0.5, 0.1]))
    labels.append({"colour": "blue", "count": 1})
    features.append([0.1, 0.2, 0.3, 0.4])
    labels.append(None)
    image_features = np.asarray(features, dtype=np.float32)
    return ValEmbeddings(image_features=image_features, text_features=image_features.copy(),
                         text_to_image=np.arange(8), keys=[f"{i:06d}" for i in range(8)],
                         labels=labels, captions=[f"caption {i}" for i in range(8)])


ATTRIBUTES = (("colour", ("a {} thing.",)), ("shape", ("a {}.",)), ("count", ("{} things.",)))


def test_per_attribute_zeroshot_has_the_known_answers():
    val = attribute_split()
    spec = ZeroShotSpec(label_fields=("colour", "shape"), attributes=ATTRIBUTES)
    zs = zeroshot_from_labels(val, spec.label_fields)
    m = score_embeddings(val, spec, zs, word_embedder).metrics
    # colour: 7 labelled images, all right; chance 1/2
    assert m["zeroshot_colour_top1"] == 1.0 and m["zeroshot_colour_images"] == 7
    assert m["zeroshot_colour_skipped"] == 1 and m["zeroshot_colour_classes"] == 2
    assert m["chance_zeroshot_colour_top1"] == 0.5
    # shape: circles 3 of 4 right, stars 1 of 2 -> top-1 4/6, mean per-class recall 0.625
    assert m["zeroshot_shape_top1"] == pytest.approx(4 / 6)
    assert m["zeroshot_shape_mean_per_class_recall"] == pytest.approx(0.625)
    assert m["zeroshot_shape_images"] == 6 and m["zeroshot_shape_skipped"] == 2
    # count (integer labels): everything looks like 1 -> top-1 4/7 (images 0-2 and 6), recalls 1, 0
    assert m["zeroshot_count_top1"] == pytest.approx(4 / 7)
    assert m["zeroshot_count_mean_per_class_recall"] == pytest.approx(0.5)
    assert "zeroshot_colour_top5" not in m  # 2 classes < 5
    # the joint "colour shape" classes: right exactly where the shape is right
    assert m["zeroshot_top1"] == pytest.approx(4 / 6) and m["zeroshot_classes"] == 4


def test_an_attribute_no_image_has_is_a_clear_error_and_no_labels_skip_attributes():
    val = attribute_split()
    spec = ZeroShotSpec(source="none", attributes=(("species", ("a {}.",)),))
    with pytest.raises(EvaluationError, match=r"'species'.*\['colour', 'count', 'shape'\]"):
        score_embeddings(val, spec, None, word_embedder)
    val.labels = [None] * 8  # real caption data: no labels at all
    report = score_embeddings(val, spec, None, word_embedder)
    assert not any(k.startswith("zeroshot") for k in report.metrics) and report.tasks == []


# ------------------------------------------------------------- CLIP_benchmark's definitions
def reference_retrieval(images, texts, text_to_image, k):
    """CLIP_benchmark's zeroshot_retrieval.evaluate: scores = texts @ images.T, a positive-pair
    matrix, recall_at_k = true positives in the top k / positives, then (> 0).mean()."""
    images = images / np.linalg.norm(images, axis=1, keepdims=True)
    texts = texts / np.linalg.norm(texts, axis=1, keepdims=True)
    scores = texts @ images.T
    positive = np.zeros_like(scores, dtype=bool)
    positive[np.arange(len(scores)), text_to_image] = True

    def recall(s, p):
        top = np.argsort(-s, axis=1)[:, :k]
        true_positive = np.take_along_axis(p, top, axis=1).sum(axis=1)
        return true_positive / p.sum(axis=1)

    return {f"image_retrieval_recall@{k}": float(np.mean(recall(scores, positive) > 0)),
            f"text_retrieval_recall@{k}": float(np.mean(recall(scores.T, positive.T) > 0))}


def reference_classification(images, classes, target):
    """CLIP_benchmark's zeroshot_classification: logits = images @ classifier, `accuracy` over
    top-k, mean_per_class_recall = balanced_accuracy_score(target, argmax)."""
    logits = (images / np.linalg.norm(images, axis=1, keepdims=True)) @ (
        classes / np.linalg.norm(classes, axis=1, keepdims=True)).T
    top = np.argsort(-logits, axis=1)
    out = {"acc1": float(np.mean(top[:, 0] == target))}
    out["acc5"] = float(np.mean((top[:, :5] == target[:, None]).any(axis=1))) \
        if classes.shape[0] >= 5 else math.nan
    pred = top[:, 0]
    n = classes.shape[0]
    matrix = np.zeros((n, n))
    np.add.at(matrix, (target, pred), 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_class = np.diag(matrix) / matrix.sum(axis=1)
    out["mean_per_class_recall"] = float(np.mean(per_class[~np.isnan(per_class)]))
    return out


def random_split(seed=0, n_images=40, dim=6, n_classes=7):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(n_images, dim)).astype(np.float32)
    owners = np.repeat(np.arange(n_images), rng.integers(1, 5, size=n_images))
    texts = (images[owners] + rng.normal(scale=1.2, size=(owners.size, dim))).astype(np.float32)
    shapes = [f"s{i}" for i in range(n_classes)]
    labels = [{"shape": shapes[rng.integers(n_classes - 1)], "colour": ["red", "blue"][i % 2]}
              for i in range(n_images)]
    class_vectors = {name: rng.normal(size=dim) for name in [*shapes, "red", "blue"]}
    val = ValEmbeddings(image_features=images, text_features=texts, text_to_image=owners,
                        keys=[str(i) for i in range(n_images)], labels=labels,
                        captions=[f"c{j}" for j in range(owners.size)])

    def embedder(templates):
        return lambda names: np.array([class_vectors[n] for n in names], dtype=np.float32)

    return val, embedder, class_vectors


def test_clip_benchmark_files_follow_its_layout_and_definitions(tmp_path):
    val, embedder, vectors = random_split()
    spec = ZeroShotSpec(label_fields=("shape",), templates=("a {}.",),
                        attributes=(("colour", ("a {} one.",)),))
    zs = zeroshot_from_labels(val, spec.label_fields)
    report = score_embeddings(val, spec, zs, embedder)
    (tmp_path / "ckpt").mkdir()
    checkpoint = tmp_path / "ckpt" / "clip.ckpt"
    checkpoint.write_bytes(b"weights")
    run = BenchmarkRun(model="clipms-tiny", pretrained=str(checkpoint))
    folder = tmp_path / "bench"
    (folder).mkdir()
    (folder / "old_clip.ckpt_x_en_zeroshot_retrieval.json").write_text("{}")  # a stale result
    names = write_benchmark_files(report, folder, "synthetic_val", None, run)
    files = {task: f"synthetic_val{part}_clip.ckpt_clipms-tiny_en_zeroshot_{kind}.json"
             for task, part, kind in [("retrieval", "", "retrieval"),
                                      ("shape", "_shape", "classification"),
                                      ("colour", "_colour", "classification")]}
    assert names == sorted(files.values())
    assert sorted(p.name for p in folder.iterdir()) == names  # the stale file is gone

    retrieval = json.loads((folder / files["retrieval"]).read_text())
    assert set(retrieval) == {"dataset", "model", "pretrained", "task", "metrics", "language"}
    assert retrieval["dataset"] == "synthetic_val" and retrieval["task"] == "zeroshot_retrieval"
    assert retrieval["pretrained"] == str(checkpoint) and retrieval["language"] == "en"
    want = {}
    for k in (1, 5, 10):
        want |= reference_retrieval(val.image_features, val.text_features, val.text_to_image, k)
    assert retrieval["metrics"].keys() == want.keys()
    for key, value in want.items():
        assert retrieval["metrics"][key] == pytest.approx(value, abs=1e-12), key

    shape = json.loads((folder / files["shape"]).read_text())
    assert shape["dataset"] == "synthetic_val/shape"
    assert shape["task"] == "zeroshot_classification" and shape["templates"] == ["a {}."]
    classes = np.array([vectors[n] for n in shape["classnames"]])
    target = np.array([shape["classnames"].index(lab["shape"]) for lab in val.labels])
    want = reference_classification(val.image_features, classes, target)
    assert shape["metrics"].keys() == want.keys() == {"acc1", "acc5", "mean_per_class_recall"}
    for key, value in want.items():
        assert shape["metrics"][key] == pytest.approx(value, abs=1e-12), key

    colour = json.loads((folder / files["colour"]).read_text())  # 2 classes: acc5 is NaN, as theirs
    assert colour["dataset"] == "synthetic_val/colour" and math.isnan(colour["metrics"]["acc5"])
    classes = np.array([vectors[n] for n in colour["classnames"]])
    target = np.array([colour["classnames"].index(lab["colour"]) for lab in val.labels])
    want = reference_classification(val.image_features, classes, target)
    assert colour["metrics"]["acc1"] == pytest.approx(want["acc1"], abs=1e-12)
    assert colour["metrics"]["mean_per_class_recall"] == pytest.approx(
        want["mean_per_class_recall"], abs=1e-12)


def test_clip_benchmark_hand_computed_case(tmp_path):
    """2 images, 3 captions (0 of image 0, 1 and 2 of image 1): captions 0 and 2 find their own
    image first, caption 1 the other one; each image finds one of its own captions first."""
    images = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    texts = np.array([[1.0, 0.1], [1.0, 0.5], [0.2, 1.0]], dtype=np.float32)
    val = ValEmbeddings(image_features=images, text_features=texts,
                        text_to_image=np.array([0, 1, 1]), keys=["a", "b"], labels=[None, None],
                        captions=["x", "y", "z"])
    report = score_embeddings(val, ZeroShotSpec(source="none"), None, word_embedder)
    run = BenchmarkRun(model="m", pretrained="tag")
    write_benchmark_files(report, tmp_path, "d", None, run)
    found = json.loads((tmp_path / "d_tag_m_en_zeroshot_retrieval.json").read_text())["metrics"]
    assert found["image_retrieval_recall@1"] == pytest.approx(2 / 3)
    assert found["text_retrieval_recall@1"] == 1.0
    assert found["image_retrieval_recall@5"] == 1.0


def test_clip_benchmark_names_are_checked():
    with pytest.raises(BenchmarkFormatError, match="letters, digits"):
        BenchmarkRun(model="../evil", pretrained="x")
    run = BenchmarkRun(model="clipms-tiny", pretrained="laion2b_s34b_b79k")
    assert output_name("wds/vtab/cifar10", run, "zeroshot_classification") == \
        "wds_vtab_cifar10_laion2b_s34b_b79k_clipms-tiny_en_zeroshot_classification.json"
