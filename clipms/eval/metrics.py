"""Retrieval and zero-shot metrics for CLIP embeddings, in numpy only (no MindSpore import).

Definitions (the field's: CLIP_benchmark's and open_clip's; docs/evaluation-and-export.md):

- Scores are cosine similarities: every feature row is L2-normalised here, so callers may pass
  raw embeddings. Scores are computed in float32, chunk by chunk, so 5,000 images x 25,000
  captions never need the whole similarity matrix at once.
- Ties are broken by index: among candidates with exactly the same score, the one with the LOWER
  index ranks first (the order `np.argmax` and a stable sort give), so ranks are deterministic.
- text->image R@K: a caption is a hit when its own image ranks in the top K images.
- image->text R@K: an image is a hit when ANY of its captions ranks in the top K captions.
- mAP@10 (image->text): AP@10 of an image = sum over ranks k <= 10 of precision@k x relevant(k),
  divided by min(number of the image's captions, 10); mAP@10 is the mean over images.
- Mean / median rank: 1-based rank of the best-ranked correct item (image->text: the best of the
  image's captions; text->image: the caption's image), averaged / medianed over queries.
- Zero-shot: a class embedding is the mean of its L2-normalised prompt-template embeddings,
  renormalised; top-1 and top-5 accuracy (top-5 only when there are at least 5 classes) and mean
  per-class recall (top-1 recall of each class that has images, averaged over those classes).

Every recall/accuracy value is a fraction in [0, 1], not a percentage.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from math import comb

import numpy as np

DEFAULT_KS = (1, 5, 10)
MAP_DEPTH = 10
DEFAULT_CHUNK = 512


class MetricsInputError(ValueError):
    """Features or labels no metric can be computed on (empty, wrong shape, non-finite, ...)."""


# --------------------------------------------------------------------------------------- helpers
def l2_normalize(features: np.ndarray, name: str = "features") -> np.ndarray:
    """Rows scaled to unit L2 norm, as float32; a clear error for empty, non-finite or zero rows."""
    x = np.asarray(features, dtype=np.float32)
    if x.ndim != 2:
        raise MetricsInputError(f"{name}: expected a 2-D array (rows, dim), got shape {x.shape}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise MetricsInputError(f"{name}: empty (shape {x.shape}); nothing to evaluate")
    if not np.isfinite(x).all():
        raise MetricsInputError(f"{name}: contains NaN or infinite values")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    zero = np.flatnonzero(norms[:, 0] == 0)
    if zero.size:
        raise MetricsInputError(f"{name}: rows {zero[:5].tolist()} have zero norm (cannot compare)")
    return x / norms


def _check_index_vector(
    values: np.ndarray, length: int, upper: int, name: str, of: str
) -> np.ndarray:
    """An int64 vector of `length` entries, each in [0, upper)."""
    idx = np.asarray(values)
    if idx.ndim != 1 or idx.shape[0] != length:
        raise MetricsInputError(f"{name}: expected shape ({length},), got {idx.shape}")
    if not np.issubdtype(idx.dtype, np.integer):
        raise MetricsInputError(f"{name}: expected integer indices, got dtype {idx.dtype}")
    idx = idx.astype(np.int64)
    bad = np.flatnonzero((idx < 0) | (idx >= upper))
    if bad.size:
        raise MetricsInputError(
            f"{name}: entries {bad[:5].tolist()} are outside [0, {upper}) (the number of {of})"
        )
    return idx


def _ranks_of_targets(scores: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """0-based rank of column targets[r] in each row r of `scores`, lower index winning ties."""
    target_scores = scores[np.arange(scores.shape[0]), targets]
    return _ranks_of_values(scores, target_scores, targets)


def _ranks_of_values(scores: np.ndarray, values: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """Rank of the entry `values[r]` (found at column `columns[r]`) within row r of `scores`:
    the entries above it, plus the equal entries at a lower column (the tie-break)."""
    ranks = np.count_nonzero(scores > values[:, None], axis=1)
    equal = np.count_nonzero(scores == values[:, None], axis=1)
    # An exact tie is rare with real embeddings: only those rows pay for the per-row slice.
    for row in np.flatnonzero(equal > 1):
        ranks[row] += np.count_nonzero(scores[row, :columns[row]] == values[row])
    return ranks


def _captions_by_image(text_to_image: np.ndarray, n_images: int) -> np.ndarray:
    """(n_images, max captions) caption indices in ascending order, padded with -1."""
    counts = np.bincount(text_to_image, minlength=n_images)
    order = np.argsort(text_to_image, kind="stable")  # by image, then caption index
    slot = np.arange(order.size) - np.repeat(np.cumsum(counts) - counts, counts)
    table = np.full((n_images, max(int(counts.max()), 1)), -1, dtype=np.int64)
    table[text_to_image[order], slot] = order
    return table


def _rank_summary(prefix: str, ranks: np.ndarray, ks: Sequence[int]) -> dict[str, float]:
    """R@K, mean and median (1-based) rank from 0-based best ranks."""
    out = {f"{prefix}_R@{k}": float(np.mean(ranks < k)) for k in ks}
    out[f"{prefix}_mean_rank"] = float(np.mean(ranks + 1))
    out[f"{prefix}_median_rank"] = float(np.median(ranks + 1))
    return out


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    ks = tuple(int(k) for k in ks)
    if not ks or any(k < 1 for k in ks):
        raise MetricsInputError(f"ks: expected positive integers, got {ks}")
    return ks


# ------------------------------------------------------------------------------------- retrieval
def text_to_image_ranks(
    images: np.ndarray, texts: np.ndarray, text_to_image: np.ndarray, chunk: int = DEFAULT_CHUNK
) -> np.ndarray:
    """0-based rank of each caption's own image among all images (normalised inputs)."""
    ranks = np.empty(texts.shape[0], dtype=np.int64)
    for start in range(0, texts.shape[0], chunk):
        stop = min(start + chunk, texts.shape[0])
        scores = texts[start:stop] @ images.T  # (chunk, n_images)
        ranks[start:stop] = _ranks_of_targets(scores, text_to_image[start:stop])
    return ranks


def image_to_text_ranks(
    images: np.ndarray, texts: np.ndarray, text_to_image: np.ndarray, chunk: int = DEFAULT_CHUNK
) -> tuple[np.ndarray, np.ndarray]:
    """Per image: 0-based rank of its best caption and AP@10 of its captions (normalised input).

    Only the ranks of an image's own captions are needed: the best is the minimum, and AP@10
    sums h / (rank_h + 1) over the h-th best own caption while its rank is below 10 (ranks are
    distinct thanks to the tie-break, so h own captions fill the first rank_h + 1 places).
    """
    n_images = images.shape[0]
    own = _captions_by_image(text_to_image, n_images)
    denominator = np.minimum(np.count_nonzero(own >= 0, axis=1), MAP_DEPTH)
    best_ranks = np.empty(n_images, dtype=np.int64)
    average_precision = np.empty(n_images, dtype=np.float64)
    beyond = max(texts.shape[0], MAP_DEPTH)  # the rank of padding slots: never a hit
    for start in range(0, n_images, chunk):
        stop = min(start + chunk, n_images)
        scores = images[start:stop] @ texts.T  # (chunk, n_texts)
        rows = np.arange(stop - start)
        ranks = np.full(own[start:stop].shape, beyond, dtype=np.int64)
        for slot, columns in enumerate(own[start:stop].T):
            present = columns >= 0
            safe = np.where(present, columns, 0)
            found = _ranks_of_values(scores, scores[rows, safe], safe)
            ranks[present, slot] = found[present]
        ranks.sort(axis=1)
        best_ranks[start:stop] = ranks[:, 0]
        hits = np.arange(1, ranks.shape[1] + 1)
        precision = np.where(ranks < MAP_DEPTH, hits / (ranks + 1), 0.0)
        average_precision[start:stop] = precision.sum(axis=1) / denominator[start:stop]
    return best_ranks, average_precision


def retrieval_metrics(
    image_features: np.ndarray,
    text_features: np.ndarray,
    text_to_image: np.ndarray,
    ks: Sequence[int] = DEFAULT_KS,
    chunk: int = DEFAULT_CHUNK,
) -> dict[str, float]:
    """COCO-style retrieval with every caption: i2t/t2i R@K, mAP@10 (i2t), mean/median ranks.

    `text_to_image[j]` is the row of `image_features` that caption j describes; every image must
    have at least one caption. Returns keys `i2t_R@K`, `t2i_R@K` (K in ks), `mAP@10`,
    `i2t_mean_rank`, `i2t_median_rank`, `t2i_mean_rank`, `t2i_median_rank`.
    """
    ks = _check_ks(ks)
    images = l2_normalize(image_features, "image_features")
    texts = l2_normalize(text_features, "text_features")
    if images.shape[1] != texts.shape[1]:
        raise MetricsInputError(
            f"image_features dim {images.shape[1]} != text_features dim {texts.shape[1]}"
        )
    targets = _check_index_vector(text_to_image, texts.shape[0], images.shape[0],
                                  "text_to_image", "images")
    uncaptioned = np.flatnonzero(np.bincount(targets, minlength=images.shape[0]) == 0)
    if uncaptioned.size:
        raise MetricsInputError(
            f"images {uncaptioned[:5].tolist()} have no caption in text_to_image "
            f"({uncaptioned.size} in all); every image needs at least one"
        )
    if chunk < 1:
        raise MetricsInputError(f"chunk: expected a positive integer, got {chunk}")
    i2t_ranks, average_precision = image_to_text_ranks(images, texts, targets, chunk)
    t2i_ranks = text_to_image_ranks(images, texts, targets, chunk)
    out = _rank_summary("i2t", i2t_ranks, ks)
    out.update(_rank_summary("t2i", t2i_ranks, ks))
    out[f"mAP@{MAP_DEPTH}"] = float(np.mean(average_precision))
    return out


def retrieval_chance_levels(
    captions_per_image: Sequence[int] | np.ndarray, ks: Sequence[int] = DEFAULT_KS
) -> dict[str, float]:
    """Expected retrieval metrics of a model that ranks at random (exact, not simulated).

    t2i R@K = min(K, N)/N; i2t R@K = mean over images of 1 - C(M-n, K)/C(M, K) (n = the image's
    captions, M all captions); mAP@10 = mean over images of
    sum_k (n/M) (1 + (k-1)(n-1)/(M-1)) / k / min(n, 10).
    """
    ks = _check_ks(ks)
    counts = np.asarray(captions_per_image, dtype=np.int64)
    if counts.size == 0 or (counts < 1).any():
        raise MetricsInputError("captions_per_image: expected a non-empty list of counts >= 1")
    n_images, n_texts = counts.size, int(counts.sum())
    out: dict[str, float] = {}
    for k in ks:
        depth = min(k, n_texts)
        miss = [comb(n_texts - n, depth) / comb(n_texts, depth) for n in counts.tolist()]
        out[f"i2t_R@{k}"] = float(1.0 - np.mean(miss))
        out[f"t2i_R@{k}"] = min(k, n_images) / n_images
    ap = np.zeros(n_images)
    for k in range(1, min(MAP_DEPTH, n_texts) + 1):
        together = (k - 1) * (counts - 1) / max(n_texts - 1, 1)
        ap += counts / n_texts * (1 + together) / k
    out[f"mAP@{MAP_DEPTH}"] = float(np.mean(ap / np.minimum(counts, MAP_DEPTH)))
    return out


# ------------------------------------------------------------------------------------- zero-shot
def build_prompts(class_names: Sequence[str], templates: Sequence[str]) -> list[str]:
    """Class-major prompts: for each class, every template with `{}` replaced by the class name."""
    if not class_names:
        raise MetricsInputError("class_names: empty; zero-shot needs at least one class")
    if not templates:
        raise MetricsInputError("templates: empty; zero-shot needs at least one prompt template")
    missing = [t for t in templates if "{}" not in t]
    if missing:
        raise MetricsInputError(f"templates without a '{{}}' placeholder: {missing}")
    return [template.replace("{}", name) for name in class_names for template in templates]


def class_embeddings(template_features: np.ndarray) -> np.ndarray:
    """(classes, templates, dim) prompt embeddings -> (classes, dim): normalise, mean, renormalise.
    """
    x = np.asarray(template_features, dtype=np.float32)
    if x.ndim != 3 or 0 in x.shape:
        raise MetricsInputError(
            "template_features: expected a non-empty (classes, templates, dim) array, "
            f"got {x.shape}"
        )
    per_prompt = l2_normalize(x.reshape(-1, x.shape[2]), "template_features").reshape(x.shape)
    return l2_normalize(per_prompt.mean(axis=1), "class embeddings (mean of templates)")


def zeroshot_scores(image_features: np.ndarray, class_features: np.ndarray) -> np.ndarray:
    """(images, classes) cosine scores."""
    images = l2_normalize(image_features, "image_features")
    classes = l2_normalize(class_features, "class_features")
    if images.shape[1] != classes.shape[1]:
        raise MetricsInputError(
            f"image_features dim {images.shape[1]} != class_features dim {classes.shape[1]}"
        )
    return images @ classes.T


def zeroshot_predictions(image_features: np.ndarray, class_features: np.ndarray) -> np.ndarray:
    """Predicted class per image (the lowest class index wins a tie, as np.argmax)."""
    return np.argmax(zeroshot_scores(image_features, class_features), axis=1)


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """(true, predicted) counts, int64, shape (num_classes, num_classes)."""
    labels = _check_index_vector(labels, len(labels), num_classes, "labels", "classes")
    predictions = _check_index_vector(predictions, labels.size, num_classes, "predictions",
                                      "classes")
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (labels, predictions), 1)
    return matrix


def zeroshot_metrics(
    image_features: np.ndarray, class_features: np.ndarray, labels: np.ndarray
) -> dict[str, float]:
    """`zeroshot_top1`, `zeroshot_top5` (only with >= 5 classes), `zeroshot_mean_per_class_recall`.

    `labels[i]` is the class row of `class_features` that image i belongs to. Mean per-class recall
    averages top-1 recall over the classes that have at least one image.
    """
    scores = zeroshot_scores(image_features, class_features)
    n_images, n_classes = scores.shape
    targets = _check_index_vector(labels, n_images, n_classes, "labels", "classes")
    ranks = _ranks_of_targets(scores, targets)
    out = {"zeroshot_top1": float(np.mean(ranks < 1))}
    if n_classes >= 5:
        out["zeroshot_top5"] = float(np.mean(ranks < 5))
    present = np.unique(targets)
    per_class = [np.mean(ranks[targets == c] < 1) for c in present]
    out["zeroshot_mean_per_class_recall"] = float(np.mean(per_class))
    return out


def zeroshot_chance_levels(num_classes: int) -> dict[str, float]:
    """Expected zero-shot metrics of a classifier that guesses uniformly at random."""
    if num_classes < 1:
        raise MetricsInputError(f"num_classes: expected >= 1, got {num_classes}")
    out = {"zeroshot_top1": 1.0 / num_classes, "zeroshot_mean_per_class_recall": 1.0 / num_classes}
    if num_classes >= 5:
        out["zeroshot_top5"] = 5.0 / num_classes
    return out


# ------------------------------------------------------------------------------- directions
# Which way each metric of `metrics/eval.json` improves, for anything that compares models (the
# registry's promotion gate). Decided by the metric's name, so metrics added later (per-attribute
# zero-shot accuracies, other K) get a direction without a list to keep in step.
HIGHER, LOWER = "higher", "lower"
_LOWER_IS_BETTER = re.compile(r"(^|_)(mean|median)_rank$")
_HIGHER_IS_BETTER = re.compile(r"(_R@\d+|^mAP@\d+|^zeroshot_(top\d+|mean_per_class_recall))"
                               r"($|_)")


def metric_direction(name: str) -> str | None:
    """HIGHER or LOWER for a model-quality metric, None for anything else: counts
    (`num_images`, `zeroshot_classes`, ...) and chance levels (`chance_*`) do not rank models."""
    if name.startswith("chance_"):
        return None
    if _LOWER_IS_BETTER.search(name):
        return LOWER
    if _HIGHER_IS_BETTER.search(name):
        return HIGHER
    return None
