"""Evaluate a trained CLIP: embed a split once (clipms.eval.embed), then retrieval and zero-shot
(clipms.eval.metrics).

Retrieval uses every caption of every image of the split. Zero-shot runs on one labelled set
(clipms.eval.zeroshot: the split's own labels, an image folder or a webdataset) and, wherever the
split's images carry labels, once more per attribute: each field of `ZeroShotSpec.attributes` is a
classification of its own among the values that field takes (colour, shape, size, ...), with its
own prompt templates, so that a model that learnt one attribute and not another shows it.
Class embeddings are the mean of the normalised prompt-template embeddings, renormalised.
The scoring functions take the class embeddings through a callable, so they also run on
hand-made embeddings without a model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from clipms.data.preprocess import PreprocessConfig
from clipms.eval import metrics
from clipms.eval.embed import CellTowers, EvaluationError, Towers, ValEmbeddings, embed_split
from clipms.eval.zeroshot import (
    ZeroShotSet,
    label_fields_present,
    zeroshot_from_folder,
    zeroshot_from_labels,
    zeroshot_from_webdataset,
)
from clipms.text.clip_tokenizer import Tokenizer

if TYPE_CHECKING:
    from clipms.model.clip import CLIP

log = logging.getLogger(__name__)
MAX_CURVE_K = 50  # recall@K curves go K = 1 .. min(this, candidates)
ClassEmbedder = Callable[[Sequence[str]], np.ndarray]  # class names -> (classes, E) features

__all__ = ["EvaluationError", "ClassificationTask", "EvalReport", "ZeroShotSpec", "evaluate",
           "evaluate_towers", "class_features", "retrieval_report", "zeroshot_report",
           "attribute_report", "score_embeddings"]


@dataclass(frozen=True)
class ZeroShotSpec:
    """Which labelled set zero-shot runs on (clipms.eval.zeroshot), and the per-attribute tasks."""

    source: str = "labels"  # labels | folder | webdataset | none
    templates: tuple[str, ...] = ("a picture of a {}.",)
    label_fields: tuple[str, ...] = ("colour", "shape")
    path: str | None = None  # folder / webdataset
    class_names: tuple[str, ...] | None = None
    attributes: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (label field, its templates)


@dataclass(frozen=True)
class ClassificationTask:
    """One zero-shot classification that ran: its metrics are `metrics[prefix + name]` with the
    names of `metrics.zeroshot_metrics` minus their `zeroshot_`."""

    name: str  # "" for the main zero-shot set, else the label field (an attribute)
    prefix: str  # "zeroshot_" or "zeroshot_<field>_"
    fields: tuple[str, ...]  # the label fields a class name joins (empty: folder/webdataset)
    class_names: tuple[str, ...]
    templates: tuple[str, ...]


@dataclass
class EvalReport:
    metrics: dict[str, float]  # the flat metrics/eval.json
    recall_curve: list[dict[str, float]]  # rows {k, i2t, t2i}
    predictions: list[dict[str, str]] = field(default_factory=list)  # rows {actual, predicted}
    confusion: np.ndarray | None = None
    class_names: list[str] = field(default_factory=list)
    tasks: list[ClassificationTask] = field(default_factory=list)
    embeddings: ValEmbeddings | None = None  # the split itself, for the gallery


def class_features(towers: Towers, class_names: Sequence[str],
                   templates: Sequence[str]) -> np.ndarray:
    """(classes, E): each class's prompts embedded, normalised, averaged and renormalised."""
    prompts = metrics.build_prompts(class_names, templates)
    embedded = towers.encode_texts(prompts)
    return metrics.class_embeddings(embedded.reshape(len(class_names), len(templates), -1))


# ------------------------------------------------------------------------------------- metrics
def retrieval_report(val: ValEmbeddings) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Retrieval metrics + chance levels + counts, and the recall@K curve of both directions."""
    n_images = val.image_features.shape[0]
    curve_ks = tuple(range(1, min(MAX_CURVE_K, n_images) + 1))
    ks = tuple(sorted(set(metrics.DEFAULT_KS) | set(curve_ks)))
    found = metrics.retrieval_metrics(val.image_features, val.text_features, val.text_to_image,
                                      ks=ks)
    reported = {f"{d}_R@{k}" for d in ("i2t", "t2i") for k in metrics.DEFAULT_KS}
    out = {k: v for k, v in found.items() if "_R@" not in k or k in reported}
    counts = np.bincount(val.text_to_image, minlength=n_images)
    chance = metrics.retrieval_chance_levels(counts, ks=metrics.DEFAULT_KS)
    out.update({f"chance_{k}": v for k, v in chance.items()})
    out.update(num_images=n_images, num_captions=int(counts.sum()))
    curve = [{"k": k, "i2t": found[f"i2t_R@{k}"], "t2i": found[f"t2i_R@{k}"]} for k in curve_ks]
    return out, curve


def zeroshot_report(zs: ZeroShotSet, classes: np.ndarray) -> tuple[dict[str, float],
                                                                    list[dict[str, str]],
                                                                    np.ndarray]:
    """Zero-shot metrics + chance + counts, per-image (actual, predicted) rows, confusion matrix."""
    out = metrics.zeroshot_metrics(zs.image_features, classes, zs.labels)
    out.update({f"chance_{k}": v
                for k, v in metrics.zeroshot_chance_levels(len(zs.class_names)).items()})
    out.update(zeroshot_images=int(zs.labels.size), zeroshot_classes=len(zs.class_names),
               zeroshot_skipped=zs.skipped)
    predicted = metrics.zeroshot_predictions(zs.image_features, classes)
    rows = [{"actual": zs.class_names[a], "predicted": zs.class_names[p]}
            for a, p in zip(zs.labels.tolist(), predicted.tolist(), strict=True)]
    matrix = metrics.confusion_matrix(zs.labels, predicted, len(zs.class_names))
    return out, rows, matrix


def attribute_report(val: ValEmbeddings, label_field: str,
                     embed_classes: ClassEmbedder) -> tuple[dict[str, float], list[str]]:
    """Zero-shot among the values of one label field: `zeroshot_<field>_top1` etc. (the keys of
    `zeroshot_report` with the field after `zeroshot_`), and the field's class names."""
    try:
        zs = zeroshot_from_labels(val, [label_field])
    except EvaluationError:
        raise EvaluationError(
            f"evaluate.zeroshot.attributes: no image has label field {label_field!r} (the labels "
            f"have {label_fields_present(val.labels)})") from None
    found, _, _ = zeroshot_report(zs, embed_classes(zs.class_names))
    prefix = f"zeroshot_{label_field}_"
    renamed = {key.replace("zeroshot_", prefix, 1): value for key, value in found.items()}
    return renamed, zs.class_names


# ------------------------------------------------------------------------------ the whole run
def evaluate(net: CLIP, tokenizer: Tokenizer, preprocess: PreprocessConfig, shards_dir: Path | str,
             batch_size: int, zeroshot: ZeroShotSpec, split: str) -> EvalReport:
    """Evaluate a trained CLIP Cell (the `evaluate` stage's model): `evaluate_towers`."""
    return evaluate_towers(CellTowers(net, tokenizer, batch_size), preprocess, shards_dir,
                           batch_size, zeroshot, split)


def evaluate_towers(towers: Towers, preprocess: PreprocessConfig, shards_dir: Path | str,
                    batch_size: int, zeroshot: ZeroShotSpec, split: str) -> EvalReport:
    """Embed `split` once; retrieval on all its captions; zero-shot on the chosen labelled set
    and per attribute. `preprocess` is the model's own (its image size and normalisation)."""
    val = embed_split(towers, preprocess, shards_dir, batch_size, split)
    zs = _zeroshot_set(towers, preprocess, val, batch_size, zeroshot)

    def embedder(templates: Sequence[str]) -> ClassEmbedder:
        return lambda names: class_features(towers, names, templates)

    return score_embeddings(val, zeroshot, zs, embedder)


def score_embeddings(val: ValEmbeddings, spec: ZeroShotSpec, zs: ZeroShotSet | None,
                     embedder: Callable[[Sequence[str]], ClassEmbedder]) -> EvalReport:
    """Every metric of an embedded split: retrieval, the zero-shot set `zs` (None: skipped) and
    the attributes of `spec` (`embedder(templates)` gives the class embedder of those
    templates)."""
    found, curve = retrieval_report(val)
    report = EvalReport(metrics=found, recall_curve=curve, embeddings=val)
    if zs is not None:
        scores, rows, matrix = zeroshot_report(zs, embedder(spec.templates)(zs.class_names))
        report.metrics.update(scores)
        report.predictions, report.confusion, report.class_names = rows, matrix, zs.class_names
        fields = spec.label_fields if spec.source == "labels" else ()
        report.tasks.append(ClassificationTask("", "zeroshot_", tuple(fields),
                                               tuple(zs.class_names), spec.templates))
    if spec.attributes and not label_fields_present(val.labels):
        log.warning("evaluate: the %d images have no labels: per-attribute zero-shot skipped",
                    len(val.keys))
        return report
    for label_field, templates in spec.attributes:
        scores, names = attribute_report(val, label_field, embedder(templates))
        report.metrics.update(scores)
        report.tasks.append(ClassificationTask(label_field, f"zeroshot_{label_field}_",
                                               (label_field,), tuple(names), templates))
    return report


def _zeroshot_set(towers: Towers, preprocess: PreprocessConfig, val: ValEmbeddings,
                  batch_size: int, spec: ZeroShotSpec) -> ZeroShotSet | None:
    if spec.source == "none":
        return None
    if spec.source == "labels":
        return zeroshot_from_labels(val, spec.label_fields)
    if not spec.path:
        raise EvaluationError(f"evaluate.zeroshot.source {spec.source!r} needs "
                              "evaluate.zeroshot.path")
    if spec.source == "folder":
        return zeroshot_from_folder(towers, preprocess, spec.path, batch_size, spec.class_names)
    if spec.source == "webdataset":
        return zeroshot_from_webdataset(towers, preprocess, spec.path, batch_size,
                                        spec.class_names)
    raise EvaluationError(f"unknown zero-shot source {spec.source!r} "
                          "(labels | folder | webdataset | none)")
