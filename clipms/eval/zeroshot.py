"""Labelled image sets for zero-shot classification: images as features, an integer class each.

- `labels`: the split's own `labels` (the synthetic generator writes e.g. {"shape": "circle",
  "colour": "red", ...}); a class name joins the chosen fields' values ("red circle"). The split's
  images are reused, not embedded again. One field alone gives a per-attribute set.
- `folder`: one sub-folder per class (`root/<class>/*.jpg`); the class name is the folder name
  with `_` as space, unless `class_names` lists them (in sorted folder order).
- `webdataset`: tar shards whose samples hold an image and a `cls` integer (as `<key>.cls` or in
  `<key>.json`), with `class_names[cls]` the names (as clip_benchmark's webdatasets).
Undecodable images and images without a usable class are counted as skipped, never fatal.
"""

# tested by: tests/clipms/eval/test_scoring.py

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clipms.data.preprocess import PreprocessConfig, PreprocessError, preprocess_image
from clipms.eval.embed import EvaluationError, Towers, ValEmbeddings

log = logging.getLogger(__name__)
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}


@dataclass
class ZeroShotSet:
    """Images (as features) with an integer class each, and the class names."""

    image_features: np.ndarray
    labels: np.ndarray
    class_names: list[str]
    skipped: int = 0  # images without a usable label or that did not decode


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


def label_fields_present(labels: Sequence[dict[str, Any] | None]) -> list[str]:
    """The label fields that at least one image has, sorted."""
    return sorted({f for label in labels if isinstance(label, dict) for f in label})


def zeroshot_from_labels(val: ValEmbeddings, fields: Sequence[str]) -> ZeroShotSet:
    """The split's images with their labels' `fields` as the class (images without them are
    skipped)."""
    names, class_names = class_names_from_labels(val.labels, fields)
    if not class_names:
        present = label_fields_present(val.labels)
        raise EvaluationError(
            f"no val image has label fields {list(fields)} (the labels have "
            f"{present or 'no fields: labels are null for real data'}): set "
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
    from clipms.data.webds import iter_samples

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


def embed_labelled_images(towers: Towers, preprocess: PreprocessConfig,
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
            features.append(towers.encode_preprocessed(np.stack(batch)))
            labels.extend(batch_labels)
            batch, batch_labels = [], []
    if batch:
        features.append(towers.encode_preprocessed(np.stack(batch)))
        labels.extend(batch_labels)
    if not features:
        raise EvaluationError(f"zero-shot set has no usable images ({skipped} skipped)")
    return ZeroShotSet(np.concatenate(features), np.asarray(labels, np.int64), [], skipped)


def zeroshot_from_folder(towers: Towers, preprocess: PreprocessConfig, root: Path | str,
                         batch_size: int, class_names: Sequence[str] | None) -> ZeroShotSet:
    items, folder_names = _folder_items(Path(root))
    names = _checked_names(class_names, folder_names, f"{root} (sorted sub-folders)")
    stream = ((str(path), path, label) for path, label in items)
    found = embed_labelled_images(towers, preprocess, stream, batch_size, len(names))
    found.class_names = names
    return found


def zeroshot_from_webdataset(towers: Towers, preprocess: PreprocessConfig, path: Path | str,
                             batch_size: int, class_names: Sequence[str] | None) -> ZeroShotSet:
    if not class_names:
        raise EvaluationError("zero-shot webdataset needs evaluate.zeroshot.class_names "
                              "(the name of each cls index)")
    found = embed_labelled_images(towers, preprocess, _webdataset_items(Path(path)), batch_size,
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
