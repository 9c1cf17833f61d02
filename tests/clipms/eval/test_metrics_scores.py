"""clipms.eval.metrics.zeroshot_scores' values, not only the ranks they give: cosine similarities,
the same whatever the length of either side's rows, within [-1, 1]. A version that skipped one
side's normalisation kept every rank of a test whose rows all have one length; it changes the
scores of rows of different lengths."""

from __future__ import annotations

import numpy as np
import pytest

from clipms.eval.metrics import MetricsInputError, zeroshot_scores


def features(rows: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, dim)).astype(np.float32)


def cosine(images: np.ndarray, classes: np.ndarray) -> np.ndarray:
    a = images.astype(np.float64)
    b = classes.astype(np.float64)
    return (a / np.linalg.norm(a, axis=1, keepdims=True)) @ (
        b / np.linalg.norm(b, axis=1, keepdims=True)).T


def test_scores_are_the_cosine_of_each_image_and_class() -> None:
    images, classes = features(7, seed=1), features(5, seed=2)
    scores = zeroshot_scores(images, classes)
    assert scores.shape == (7, 5) and scores.dtype == np.float32
    np.testing.assert_allclose(scores, cosine(images, classes), atol=1e-6)


def test_scores_do_not_change_when_either_side_is_scaled_row_by_row() -> None:
    images, classes = features(6, seed=3), features(4, seed=4)
    base = zeroshot_scores(images, classes)
    image_scale = np.array([[0.01], [1.0], [3.0], [250.0], [0.5], [7.0]], np.float32)
    class_scale = np.array([[40.0], [0.02], [1.0], [9.0]], np.float32)
    np.testing.assert_allclose(zeroshot_scores(images * image_scale, classes), base, atol=1e-6)
    np.testing.assert_allclose(zeroshot_scores(images, classes * class_scale), base, atol=1e-6)
    np.testing.assert_allclose(zeroshot_scores(images * image_scale, classes * class_scale),
                               base, atol=1e-6)


def test_scores_stay_within_minus_one_and_one_and_reach_both() -> None:
    classes = features(3, seed=5) * 100.0
    images = np.concatenate([classes[:1] * 0.001, -classes[1:2] * 50.0, features(20, seed=6)])
    scores = zeroshot_scores(images, classes)
    assert scores.min() >= -1.0 - 1e-6 and scores.max() <= 1.0 + 1e-6
    assert scores[0, 0] == pytest.approx(1.0, abs=1e-6)  # the same direction, any length
    assert scores[1, 1] == pytest.approx(-1.0, abs=1e-6)  # the opposite one


def test_a_zero_or_empty_side_is_a_clear_error_on_either_side() -> None:
    images, classes = features(2), features(3)
    with pytest.raises(MetricsInputError, match="image_features: rows \\[1\\] have zero norm"):
        zeroshot_scores(np.stack([images[0], np.zeros(16, np.float32)]), classes)
    with pytest.raises(MetricsInputError, match="class_features: rows \\[0\\] have zero norm"):
        zeroshot_scores(images, np.zeros((1, 16), np.float32))
