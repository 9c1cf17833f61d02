"""Evaluate a trained CLIP: embed the val split once, then retrieval and zero-shot (clipms.metrics).

Retrieval uses every caption of every val image. Zero-shot classes come from one of:
- `labels`: the shards' own `labels` (the synthetic generator writes e.g. {"shape": "circle",
  "colour": "red", ...}); `label_fields` picks the fields and a class name joins their values
  ("red circle"). The val images are reused, not embedded again.
- `folder`: an image folder with one sub-folder per class (`root/<class>/*.jpg`); the class name is
  the folder name with `_` as space, unless `class_names` lists them (in sorted folder order).
- `webdataset`: tar shards whose samples hold an image and a `cls` integer (as `<key>.cls` or in
  `<key>.json`), with `class_names[cls]` the names (as clip_benchmark's webdatasets).
Class embeddings are the mean of the normalised prompt-template embeddings, renormalised.
Undecodable images of a zero-shot set are counted and reported, never fatal.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clipms import metrics
from clipms.atomic import atomic_write
from clipms.data import eval_sample_count, iter_eval_batches
from clipms.preprocess import PreprocessConfig, PreprocessError, preprocess_image
from clipms.tokenizer import Tokenizer

if TYPE_CHECKING:
    from clipms.model import CLIP

log = logging.getLogger(__name__)
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}
MAX_CURVE_K = 50  # recall@K curves go K = 1 .. min(this, candidates)


class EvaluationError(ValueError):
    """An evaluation set or setting that cannot be evaluated (no classes, unknown field, ...)."""


@dataclass
class ValEmbeddings:
    """Raw (not normalised) features of a split: image i has captions where text_to_image == i."""

    image_features: np.ndarray
    text_features: np.ndarray
    text_to_image: np.ndarray
    keys: list[str]
    labels: list[dict[str, Any] | None]


@dataclass
class ZeroShotSet:
    """Images (as features) with an integer class each, and the class names."""

    image_features: np.ndarray
    labels: np.ndarray
    class_names: list[str]
    skipped: int = 0  # images without a usable label or that did not decode


@dataclass
class EvalReport:
    metrics: dict[str, float]
    recall_curve: list[dict[str, float]]  # rows {k, i2t, t2i}
    predictions: list[dict[str, str]] = field(default_factory=list)  # rows {actual, predicted}
    confusion: np.ndarray | None = None
    class_names: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------ embedding
def encode_images(net: CLIP, images: np.ndarray) -> np.ndarray:
    import mindspore as ms

    return net.encode_image(ms.Tensor(images)).asnumpy()


def encode_texts(net: CLIP, tokenizer: Tokenizer, texts: Sequence[str],
                 batch_size: int) -> np.ndarray:
    import mindspore as ms

    chunks = [net.encode_text(ms.Tensor(tokenizer.encode(list(texts[i:i + batch_size]))))
              .asnumpy() for i in range(0, len(texts), batch_size)]
    return np.concatenate(chunks) if chunks else np.zeros((0, net.config.embed_dim), np.float32)


def _progress(total: int, unit: str, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, mininterval=2.0)


def embed_split(net: CLIP, tokenizer: Tokenizer, preprocess: PreprocessConfig,
                shards_dir: Path | str, batch_size: int, split: str = "val") -> ValEmbeddings:
    """Every image and every caption of `split`, embedded once in batches (with a progress bar)."""
    images, keys, labels, captions, owners = [], [], [], [], []
    with _progress(eval_sample_count(shards_dir, split), "img", f"embed {split} images") as bar:
        for batch in iter_eval_batches(shards_dir, preprocess, batch_size, split=split):
            for key, caption_list in zip(batch.keys, batch.captions, strict=True):
                owners.extend([len(keys)] * len(caption_list))  # this image's row
                captions.extend(caption_list)
                keys.append(key)
            labels.extend(batch.labels)
            images.append(encode_images(net, batch.images))
            bar.update(len(batch.keys))
    if not images:
        raise EvaluationError(f"{shards_dir}: split {split!r} has no samples")
    texts = []
    with _progress(len(captions), "caption", f"embed {split} captions") as bar:
        for start in range(0, len(captions), batch_size):
            texts.append(encode_texts(net, tokenizer, captions[start:start + batch_size],
                                      batch_size))
            bar.update(len(texts[-1]))
    return ValEmbeddings(image_features=np.concatenate(images), text_features=np.concatenate(texts),
                         text_to_image=np.asarray(owners, dtype=np.int64), keys=keys,
                         labels=labels)


# ----------------------------------------------------------------------------- zero-shot sets
def class_names_from_labels(labels: Sequence[dict[str, Any] | None],
                            fields: Sequence[str]) -> tuple[list[str | None], list[str]]:
    """Per image its class name (None when a field is missing) and the sorted class names."""
    names: list[str | None] = []
    for label in labels:
        if not isinstance(label, dict) or any(f not in label for f in fields):
            names.append(None)
            continue
        names.append(" ".join(str(label[f]) for f in fields))
    return names, sorted({n for n in names if n is not None})


def zeroshot_from_labels(val: ValEmbeddings, fields: Sequence[str]) -> ZeroShotSet:
    """The val images with their labels' `fields` as the class (images without them are skipped)."""
    names, class_names = class_names_from_labels(val.labels, fields)
    if not class_names:
        raise EvaluationError(
            f"no val image has label fields {list(fields)} (labels are null for real data): set "
            "evaluate.zeroshot.source to folder/webdataset/none, or pick fields the labels have"
        )
    keep = np.array([n is not None for n in names])
    index = {name: i for i, name in enumerate(class_names)}
    labels = np.array([index[n] for n in names if n is not None], dtype=np.int64)
    return ZeroShotSet(val.image_features[keep], labels, class_names, skipped=int((~keep).sum()))


def _folder_items(root: Path) -> tuple[list[tuple[Path, int]], list[str]]:
    if not root.is_dir():
        raise EvaluationError(f"{root}: zero-shot image folder not found")
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    if not folders:
        raise EvaluationError(f"{root}: no class sub-folders (expected {root}/<class>/<image>)")
    items = [(path, label) for label, folder in enumerate(folders)
             for path in sorted(folder.rglob("*")) if path.suffix.lower() in IMAGE_SUFFIXES]
    return items, [folder.name.replace("_", " ") for folder in folders]


def _webdataset_items(path: Path) -> Iterator[tuple[str, bytes, int | None]]:
    from clipms.webds import iter_samples

    for sample in iter_samples(path):
        if sample.image is None:
            continue
        cls = sample.meta.get("cls")
        if cls is None and "cls" in sample.files:
            cls = sample.files["cls"].decode().strip()
        try:
            label = None if cls is None else int(cls)
        except ValueError:
            label = None  # counted as skipped, with a warning naming the sample
        yield sample.key, sample.image, label


def embed_labelled_images(net: CLIP, preprocess: PreprocessConfig,
                          items: Iterator[tuple[str, bytes | Path, int | None]],
                          batch_size: int, num_classes: int) -> ZeroShotSet:
    """Embed (name, image, class) items; bad images and missing/out-of-range classes are skipped."""
    features, labels, batch, batch_labels, skipped = [], [], [], [], 0
    for name, image, label in items:
        if label is None or not 0 <= label < num_classes:
            skipped += 1
            log.warning("zero-shot: %s has no class in [0, %d): skipped", name, num_classes)
            continue
        try:
            data = image.read_bytes() if isinstance(image, Path) else image
            batch.append(preprocess_image(data, preprocess, name=name))
        except PreprocessError as err:
            skipped += 1
            log.warning("zero-shot: %s", err)
            continue
        batch_labels.append(label)
        if len(batch) == batch_size:
            features.append(encode_images(net, np.stack(batch)))
            labels.extend(batch_labels)
            batch, batch_labels = [], []
    if batch:
        features.append(encode_images(net, np.stack(batch)))
        labels.extend(batch_labels)
    if not features:
        raise EvaluationError(f"zero-shot set has no usable images ({skipped} skipped)")
    return ZeroShotSet(np.concatenate(features), np.asarray(labels, np.int64), [], skipped)


def zeroshot_from_folder(net: CLIP, preprocess: PreprocessConfig, root: Path | str,
                         batch_size: int, class_names: Sequence[str] | None) -> ZeroShotSet:
    items, folder_names = _folder_items(Path(root))
    names = _checked_names(class_names, folder_names, f"{root} (sorted sub-folders)")
    stream = ((str(path), path, label) for path, label in items)
    found = embed_labelled_images(net, preprocess, stream, batch_size, len(names))
    found.class_names = names
    return found


def zeroshot_from_webdataset(net: CLIP, preprocess: PreprocessConfig, path: Path | str,
                             batch_size: int, class_names: Sequence[str] | None) -> ZeroShotSet:
    if not class_names:
        raise EvaluationError("zero-shot webdataset needs evaluate.zeroshot.class_names "
                              "(the name of each cls index)")
    found = embed_labelled_images(net, preprocess, _webdataset_items(Path(path)), batch_size,
                                  len(class_names))
    found.class_names = list(class_names)
    return found


def _checked_names(given: Sequence[str] | None, found: list[str], where: str) -> list[str]:
    if not given:
        return found
    if len(given) != len(found):
        raise EvaluationError(f"class_names has {len(given)} names but {where} has {len(found)} "
                              f"classes: {found}")
    return list(given)


def class_features(net: CLIP, tokenizer: Tokenizer, class_names: Sequence[str],
                   templates: Sequence[str], batch_size: int) -> np.ndarray:
    """(classes, E): each class's prompts embedded, normalised, averaged and renormalised."""
    prompts = metrics.build_prompts(class_names, templates)
    embedded = encode_texts(net, tokenizer, prompts, batch_size)
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


# -------------------------------------------------------------------------------------- outputs
def write_recall_curve(path: Path, curve: list[dict[str, float]]) -> None:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(curve, columns=["k", "i2t", "t2i"]).to_csv(path, index=False)


def write_predictions(path: Path, rows: list[dict[str, str]]) -> None:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=["actual", "predicted"]).to_csv(path, index=False)


def plot_confusion(path: Path, matrix: np.ndarray | None, class_names: list[str],
                   title: str) -> None:
    """A PNG heat map of (true, predicted) counts (an empty note when zero-shot did not run)."""
    import matplotlib

    matplotlib.use("Agg")  # no display here; and never pop up a window from a pipeline stage
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    size = 3 + 0.25 * len(class_names)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    if matrix is None or matrix.size == 0:
        ax.text(0.5, 0.5, "zero-shot evaluation did not run", ha="center", va="center")
        ax.set_axis_off()
    else:
        image = ax.imshow(matrix, cmap="Blues")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="images")
        ticks = range(len(class_names))
        fontsize = 8 if len(class_names) <= 20 else 5
        ax.set_xticks(ticks, class_names, rotation=90, fontsize=fontsize)
        ax.set_yticks(ticks, class_names, fontsize=fontsize)
        ax.set_xlabel("predicted class")
        ax.set_ylabel("true class")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    with atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ the whole run
@dataclass(frozen=True)
class ZeroShotSpec:
    """Which labelled set zero-shot runs on (see the module docstring)."""

    source: str = "labels"  # labels | folder | webdataset | none
    templates: tuple[str, ...] = ("a picture of a {}.",)
    label_fields: tuple[str, ...] = ("colour", "shape")
    path: str | None = None  # folder / webdataset
    class_names: tuple[str, ...] | None = None


@dataclass(frozen=True)
class EvalOutputs:
    metrics: Path = Path("metrics/eval.json")
    recall_curve: Path = Path("plots/recall_at_k.csv")
    predictions: Path = Path("plots/confusion_matrix.csv")
    confusion_png: Path = Path("plots/confusion_matrix.png")


def evaluate(net: CLIP, tokenizer: Tokenizer, preprocess: PreprocessConfig, shards_dir: Path | str,
             batch_size: int, zeroshot: ZeroShotSpec, split: str = "val") -> EvalReport:
    """Embed `split` once; retrieval on all its captions; zero-shot on the chosen labelled set."""
    val = embed_split(net, tokenizer, preprocess, shards_dir, batch_size, split)
    found, curve = retrieval_report(val)
    report = EvalReport(metrics=found, recall_curve=curve)
    zs = _zeroshot_set(net, preprocess, val, batch_size, zeroshot)
    if zs is None:
        return report
    classes = class_features(net, tokenizer, zs.class_names, zeroshot.templates, batch_size)
    scores, rows, matrix = zeroshot_report(zs, classes)
    report.metrics.update(scores)
    report.predictions, report.confusion, report.class_names = rows, matrix, zs.class_names
    return report


def _zeroshot_set(net: CLIP, preprocess: PreprocessConfig, val: ValEmbeddings, batch_size: int,
                  spec: ZeroShotSpec) -> ZeroShotSet | None:
    if spec.source == "none":
        return None
    if spec.source == "labels":
        return zeroshot_from_labels(val, spec.label_fields)
    if not spec.path:
        raise EvaluationError(f"evaluate.zeroshot.source {spec.source!r} needs "
                              "evaluate.zeroshot.path")
    if spec.source == "folder":
        return zeroshot_from_folder(net, preprocess, spec.path, batch_size, spec.class_names)
    if spec.source == "webdataset":
        return zeroshot_from_webdataset(net, preprocess, spec.path, batch_size, spec.class_names)
    raise EvaluationError(f"unknown zero-shot source {spec.source!r} "
                          "(labels | folder | webdataset | none)")


def write_outputs(report: EvalReport, outputs: EvalOutputs | None = None) -> None:
    """metrics JSON (flat keys), recall@K CSV, per-image zero-shot CSV and the confusion PNG."""
    from clipms.jsonio import write_json

    outputs = outputs or EvalOutputs()

    write_json(outputs.metrics, report.metrics)
    write_recall_curve(outputs.recall_curve, report.recall_curve)
    write_predictions(outputs.predictions, report.predictions)
    top1 = report.metrics.get("zeroshot_top1")
    title = ("zero-shot confusion (rows: true class)" if top1 is None else
             f"zero-shot confusion: top-1 {top1:.3f}, chance "
             f"{report.metrics['chance_zeroshot_top1']:.3f}")
    plot_confusion(outputs.confusion_png, report.confusion, report.class_names, title)
