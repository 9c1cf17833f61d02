"""Metrics against brute-force references (full matrix + stable sort) and hand-computed cases."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from clipms.eval.metrics import (
    MetricsInputError,
    build_prompts,
    class_embeddings,
    confusion_matrix,
    retrieval_chance_levels,
    retrieval_metrics,
    zeroshot_chance_levels,
    zeroshot_metrics,
    zeroshot_predictions,
)


# ---------------------------------------------------------------- brute-force references
def _normalise(x):
    x = np.asarray(x, dtype=np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float64)


def _order(scores_row):
    """Best first; a stable sort of -score keeps the lower index first among equal scores."""
    return np.argsort(-scores_row, kind="stable")


def reference_retrieval(images, texts, text_to_image, ks=(1, 5, 10)):
    scores = _normalise(images) @ _normalise(texts).T  # (n_images, n_texts), the whole matrix
    n_images, n_texts = scores.shape
    i2t_best, aps = [], []
    for i in range(n_images):
        order = _order(scores[i])
        relevant = text_to_image[order] == i
        i2t_best.append(int(np.flatnonzero(relevant)[0]))
        hits, ap = 0, 0.0
        for position in range(min(10, n_texts)):
            if relevant[position]:
                hits += 1
                ap += hits / (position + 1)
        aps.append(ap / min(int((text_to_image == i).sum()), 10))
    t2i_rank = []
    for j in range(n_texts):
        order = _order(scores[:, j])
        t2i_rank.append(int(np.flatnonzero(order == text_to_image[j])[0]))
    i2t_best, t2i_rank = np.array(i2t_best), np.array(t2i_rank)
    out = {}
    for k in ks:
        out[f"i2t_R@{k}"] = float(np.mean(i2t_best < k))
        out[f"t2i_R@{k}"] = float(np.mean(t2i_rank < k))
    out["mAP@10"] = float(np.mean(aps))
    out["i2t_mean_rank"] = float(np.mean(i2t_best + 1))
    out["i2t_median_rank"] = float(np.median(i2t_best + 1))
    out["t2i_mean_rank"] = float(np.mean(t2i_rank + 1))
    out["t2i_median_rank"] = float(np.median(t2i_rank + 1))
    return out


def reference_zeroshot(images, classes, labels):
    scores = _normalise(images) @ _normalise(classes).T
    pairs = zip(scores, labels, strict=True)
    ranks = np.array([int(np.flatnonzero(_order(row) == y)[0]) for row, y in pairs])
    out = {"zeroshot_top1": float(np.mean(ranks == 0))}
    if classes.shape[0] >= 5:
        out["zeroshot_top5"] = float(np.mean(ranks < 5))
    recalls = [np.mean(ranks[labels == c] == 0) for c in sorted(set(labels.tolist()))]
    out["zeroshot_mean_per_class_recall"] = float(np.mean(recalls))
    return out


def random_captions(rng, n_images, max_per_image=5):
    """Each image gets 1..max captions, shuffled so an image's captions are not adjacent."""
    counts = rng.integers(1, max_per_image + 1, size=n_images)
    text_to_image = rng.permutation(np.repeat(np.arange(n_images), counts))
    return text_to_image


def sign_vectors(rng, n, dim=4):
    """+-1 vectors: normalised entries are exactly +-1/2, so equal scores are bit-exact ties."""
    return rng.choice([-1.0, 1.0], size=(n, dim)).astype(np.float32)


def assert_same(got, expected):
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key


# ------------------------------------------------------------------ retrieval vs brute force
@pytest.mark.parametrize("chunk", [1, 3, 7, 512])
def test_retrieval_matches_brute_force_on_random_data(chunk):
    rng = np.random.default_rng(0)
    n_images, dim = 23, 8
    text_to_image = random_captions(rng, n_images)
    images = rng.normal(size=(n_images, dim)).astype(np.float32)
    # Texts near their image so the metrics are neither 0 nor 1.
    texts = images[text_to_image] + 1.5 * rng.normal(size=(text_to_image.size, dim))
    got = retrieval_metrics(images * 3.0, texts, text_to_image, chunk=chunk)  # unnormalised input
    assert_same(got, reference_retrieval(images, texts, text_to_image))
    assert 0.0 < got["i2t_R@1"] < 1.0 and 0.0 < got["t2i_R@1"] < 1.0


def test_retrieval_memory_is_bounded_by_the_chunk_not_the_similarity_matrix():
    """The stated bound (docs/evaluation-and-export.md): at most `chunk` rows of float32 scores
    and their masks at a time, besides the normalised features - never the images x captions
    matrix (the Karpathy test set's 5,000 x 25,000 would be 477 MB in float32, 954 in float64)."""
    import tracemalloc

    rng = np.random.default_rng(0)
    n_images, per, dim, chunk = 1000, 5, 32, 50
    text_to_image = np.repeat(np.arange(n_images), per)
    images = rng.normal(size=(n_images, dim)).astype(np.float32)
    texts = images[text_to_image] + rng.normal(size=(text_to_image.size, dim)).astype(np.float32)
    tracemalloc.start()
    try:
        retrieval_metrics(images, texts, text_to_image, chunk=chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    features = images.nbytes + texts.nbytes
    one_chunk = chunk * text_to_image.size * (4 + 1 + 1 + 8)  # scores, two masks, int64 counts
    assert peak < features + 2 * one_chunk < n_images * text_to_image.size * 4 / 2


@pytest.mark.parametrize("seed", range(4))
def test_retrieval_with_many_exact_ties_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n_images = 17
    text_to_image = random_captions(rng, n_images)
    images = sign_vectors(rng, n_images)
    texts = sign_vectors(rng, text_to_image.size)
    got = retrieval_metrics(images, texts, text_to_image, ks=(1, 2, 5, 10), chunk=4)
    assert_same(got, reference_retrieval(images, texts, text_to_image, ks=(1, 2, 5, 10)))


def test_ties_are_won_by_the_lower_index():
    # Three identical images: every caption scores them equally, so image 0 always ranks first.
    images = np.ones((3, 2), dtype=np.float32)
    texts = np.array([[1, 0], [0, 1], [1, 1]], dtype=np.float32)
    got = retrieval_metrics(images, texts, np.array([0, 1, 2]), ks=(1, 2, 3))
    assert got["t2i_R@1"] == pytest.approx(1 / 3)  # only the caption of image 0
    assert got["t2i_R@2"] == pytest.approx(2 / 3)
    assert got["t2i_median_rank"] == 2.0
    # Identical captions: each image ranks caption 0 first, caption 1 second, caption 2 third.
    same_texts = np.ones((3, 2), dtype=np.float32)
    got = retrieval_metrics(texts, same_texts, np.array([0, 1, 2]), ks=(1, 2, 3))
    assert (got["i2t_R@1"], got["i2t_R@2"], got["i2t_R@3"]) == pytest.approx((1 / 3, 2 / 3, 1.0))
    assert got["mAP@10"] == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)


def test_k_larger_than_the_candidates_counts_everything():
    rng = np.random.default_rng(1)
    images = rng.normal(size=(3, 4))
    texts = rng.normal(size=(4, 4))
    text_to_image = np.array([0, 1, 2, 2])
    got = retrieval_metrics(images, texts, text_to_image, ks=(1, 50))
    assert got["i2t_R@50"] == 1.0 and got["t2i_R@50"] == 1.0
    assert_same(got, reference_retrieval(images, texts, text_to_image, ks=(1, 50)))


def test_retrieval_hand_computed_case():
    # Scores (rows images, columns captions), exact in float32:
    #   image 0 = [1,0]: caption0 1.0, caption1 0.0, caption2 0.707    (captions 0,1 are image 0's)
    #   image 1 = [0,1]: caption0 0.0, caption1 1.0, caption2 0.707    (caption 2 is image 1's)
    images = np.array([[1, 0], [0, 1]], dtype=np.float32)
    texts = np.array([[1, 0], [0, 1], [1, 1]], dtype=np.float32)
    got = retrieval_metrics(images, texts, np.array([0, 0, 1]))
    # t2i ranks (1-based): caption0 -> 1; caption1 -> 2; caption2 ties (0.707 both), image 0 wins
    # so its image 1 ranks 2.
    # i2t best ranks: image 0 -> 1 (caption0); image 1 -> 2 (caption1 outranks caption2).
    # AP@10: image 0 hits at ranks 1 and 3: (1/1 + 2/3) / 2 = 5/6; image 1 at rank 2: (1/2) / 1.
    expected = {
        "i2t_R@1": 0.5, "i2t_R@5": 1.0, "i2t_R@10": 1.0,
        "t2i_R@1": 1 / 3, "t2i_R@5": 1.0, "t2i_R@10": 1.0,
        "mAP@10": (5 / 6 + 1 / 2) / 2,
        "i2t_mean_rank": 1.5, "i2t_median_rank": 1.5,
        "t2i_mean_rank": 5 / 3, "t2i_median_rank": 2.0,
    }
    assert_same(got, expected)


def test_map_at_10_counts_only_the_first_ten_and_caps_the_denominator():
    # One image with 12 identical captions that all tie: ranks 1..12, ten within the cut-off.
    images = np.array([[1.0, 0.0]])
    texts = np.tile([[1.0, 0.0]], (12, 1))
    got = retrieval_metrics(images, texts, np.zeros(12, dtype=np.int64))
    assert got["mAP@10"] == pytest.approx(1.0)  # 10 hits / min(12, 10)
    # Two images: each ranks all of its own captions before any other caption -> AP 1 each.
    images = np.array([[1.0, 0.0], [0.0, 1.0]])
    texts = np.vstack([np.tile([[0.0, 1.0]], (10, 1)), [[1.0, 0.0]]])  # 10 of image 1, 1 of image 0
    t2i = np.array([1] * 10 + [0])
    got = retrieval_metrics(images, texts, t2i)
    assert got["mAP@10"] == pytest.approx(1.0)


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("images", "texts", "t2i", "message"),
    [
        (np.zeros((0, 4)), np.ones((2, 4)), np.array([0, 0]), "image_features: empty"),
        (np.ones((2, 4)), np.zeros((0, 4)), np.array([], dtype=np.int64), "text_features: empty"),
        (np.ones((2, 4)), np.ones((2, 3)), np.array([0, 1]), "dim"),
        (np.ones((2, 4)), np.ones((2, 4)), np.array([0, 2]), "outside [0, 2)"),
        (np.ones((2, 4)), np.ones((2, 4)), np.array([0]), "text_to_image: expected shape (2,)"),
        (np.ones((2, 4)), np.ones((2, 4)), np.array([0, 0]), "images [1] have no caption"),
        (np.ones((2, 4)), np.ones((2, 4)), np.array([0.0, 1.0]), "integer"),
        (np.array([[1, 0], [0, 0]]), np.ones((2, 2)), np.array([0, 1]), "zero norm"),
        (np.array([[1, np.nan], [0, 1]]), np.ones((2, 2)), np.array([0, 1]), "NaN"),
    ],
)
def test_retrieval_bad_input_is_a_clear_error(images, texts, t2i, message):
    with pytest.raises(MetricsInputError, match=re.escape(message)):
        retrieval_metrics(images, texts, t2i)


def test_zeroshot_bad_input_is_a_clear_error():
    with pytest.raises(MetricsInputError, match="image_features: empty"):
        zeroshot_metrics(np.zeros((0, 3)), np.ones((2, 3)), np.array([], dtype=np.int64))
    with pytest.raises(MetricsInputError, match="class_features: empty"):
        zeroshot_metrics(np.ones((2, 3)), np.zeros((0, 3)), np.array([0, 0]))
    with pytest.raises(MetricsInputError, match="outside"):
        zeroshot_metrics(np.ones((2, 3)), np.ones((2, 3)), np.array([0, 5]))
    with pytest.raises(MetricsInputError, match="placeholder"):
        build_prompts(["cat"], ["a photo"])
    with pytest.raises(MetricsInputError, match="class_names: empty"):
        build_prompts([], ["a {}"])


# ------------------------------------------------------------------------------- zero-shot
@pytest.mark.parametrize(("n_classes", "dim"), [(3, 8), (7, 8), (12, 4)])
def test_zeroshot_matches_brute_force(n_classes, dim):
    rng = np.random.default_rng(n_classes)
    classes = rng.normal(size=(n_classes, dim)).astype(np.float32)
    labels = rng.integers(0, n_classes, size=40)
    images = classes[labels] + 1.2 * rng.normal(size=(40, dim))
    got = zeroshot_metrics(images, classes, labels)
    assert_same(got, reference_zeroshot(images, classes, labels))
    assert ("zeroshot_top5" in got) == (n_classes >= 5)


def test_zeroshot_ties_match_brute_force_and_favour_the_lower_class():
    rng = np.random.default_rng(3)
    classes = sign_vectors(rng, 9)  # only 16 distinct +-1 vectors in dim 4: duplicates and ties
    labels = rng.integers(0, 9, size=50)
    images = sign_vectors(rng, 50)
    expected = reference_zeroshot(images, classes, labels)
    assert_same(zeroshot_metrics(images, classes, labels), expected)
    duplicate = np.array([[1.0, 0.0], [1.0, 0.0]])
    assert zeroshot_predictions(np.array([[2.0, 0.0]]), duplicate).tolist() == [0]
    got = zeroshot_metrics(np.array([[2.0, 0.0]]), duplicate, np.array([1]))
    assert got["zeroshot_top1"] == 0.0  # the tie went to class 0


def test_zeroshot_single_class_is_always_right():
    rng = np.random.default_rng(4)
    got = zeroshot_metrics(rng.normal(size=(5, 3)), rng.normal(size=(1, 3)), np.zeros(5, np.int64))
    assert got == {"zeroshot_top1": 1.0, "zeroshot_mean_per_class_recall": 1.0}


def test_zeroshot_hand_computed_case():
    classes = np.array([[1, 0], [0, 1], [1, 1]], dtype=np.float32)
    images = np.array([[1, 0], [0, 1], [1, 1], [0, 3]], dtype=np.float32)
    labels = np.array([0, 2, 2, 1])
    # predictions: [1,0] -> 0 (right); [0,1] -> 1 (wrong, label 2); [1,1] -> 2 (right); [0,3] -> 1.
    assert zeroshot_predictions(images, classes).tolist() == [0, 1, 2, 1]
    got = zeroshot_metrics(images, classes, labels)
    # top-1 3/4; per class: class 0 1/1, class 1 1/1, class 2 1/2 -> mean 5/6. 3 classes: no top5.
    assert_same(got, {"zeroshot_top1": 0.75, "zeroshot_mean_per_class_recall": 5 / 6})
    matrix = confusion_matrix(labels, zeroshot_predictions(images, classes), 3)
    assert matrix.tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]


def test_zeroshot_top5_hand_computed_case():
    classes = np.eye(6, dtype=np.float32)
    # image scores against the one-hot classes are its own entries; the true class is 5.
    images = np.array([[6, 5, 4, 3, 2, 1], [1, 2, 3, 4, 5, 6]], dtype=np.float32)
    got = zeroshot_metrics(images, classes, np.array([5, 5]))
    # image 0 ranks class 5 sixth (miss at top5); image 1 ranks it first.
    assert_same(got, {"zeroshot_top1": 0.5, "zeroshot_top5": 0.5,
                      "zeroshot_mean_per_class_recall": 0.5})


def test_class_embeddings_normalise_average_and_renormalise():
    per_template = np.array([[[2.0, 0.0], [0.0, 3.0]], [[0.0, 5.0], [0.0, 0.5]]])
    got = class_embeddings(per_template)
    half = np.sqrt(0.5)
    np.testing.assert_allclose(got, [[half, half], [0.0, 1.0]], atol=1e-7)
    # Raw averaging would weight the longer template vector more: [1, 1.5] -> not the diagonal.
    assert not np.allclose(got[0], per_template[0].mean(axis=0) / np.linalg.norm([1.0, 1.5]))
    with pytest.raises(MetricsInputError, match="classes, templates, dim"):
        class_embeddings(np.ones((2, 3)))


def test_build_prompts_is_class_major():
    prompts = build_prompts(["circle", "square"], ["a {}.", "a photo of a {}."])
    assert prompts == ["a circle.", "a photo of a circle.", "a square.", "a photo of a square."]


# ---------------------------------------------------------------------------- chance levels
def test_retrieval_chance_levels_hand_computed():
    got = retrieval_chance_levels([1, 1], ks=(1,))
    # 1 relevant caption of 2: R@1 = 1/2; AP = 1 (rank 1, p=1/2) or 1/2 (rank 2) -> 3/4.
    assert got == pytest.approx({"i2t_R@1": 0.5, "t2i_R@1": 0.5, "mAP@10": 0.75})


def test_retrieval_chance_levels_match_exhaustive_enumeration():
    counts = [2, 1, 1]
    t2i = np.repeat(np.arange(3), counts)
    n_texts = t2i.size
    hits = {k: [] for k in (1, 2, 10)}
    aps = []
    # Every caption order is equally likely under a random model: enumerate them all, per image.
    for image in range(3):
        for order in itertools.permutations(range(n_texts)):
            relevant = t2i[list(order)] == image
            for k in hits:
                hits[k].append(relevant[:k].any())
            precision = np.cumsum(relevant) / np.arange(1, n_texts + 1)
            aps.append((precision * relevant).sum() / min(counts[image], 10))
    got = retrieval_chance_levels(counts, ks=(1, 2, 10))
    for k in hits:
        assert got[f"i2t_R@{k}"] == pytest.approx(np.mean(hits[k]))
        assert got[f"t2i_R@{k}"] == pytest.approx(min(k, 3) / 3)
    assert got["mAP@10"] == pytest.approx(np.mean(aps))


def test_zeroshot_chance_levels():
    assert zeroshot_chance_levels(4) == {"zeroshot_top1": 0.25,
                                         "zeroshot_mean_per_class_recall": 0.25}
    assert zeroshot_chance_levels(10)["zeroshot_top5"] == 0.5


# ---------------------------------------------------------------- metrics: zero-shot edges
# Edges `make mutation` (benchmarks/mutation.py) found untested; each docstring names the
# mutants (mutmut's names) the test kills.


def test_zero_shot_chance_levels_at_one_and_five_classes():
    """clipms.eval.metrics.x_zeroshot_chance_levels__mutmut_1/2 (one class refused), _13/_14 (five
    classes lose top-5, which evaluate reports at five), _3 (the message)."""
    from clipms.eval.metrics import MetricsInputError, zeroshot_chance_levels

    assert zeroshot_chance_levels(1) == {"zeroshot_top1": 1.0,
                                         "zeroshot_mean_per_class_recall": 1.0}
    assert zeroshot_chance_levels(5) == {"zeroshot_top1": 0.2, "zeroshot_top5": 1.0,
                                         "zeroshot_mean_per_class_recall": 0.2}
    assert "zeroshot_top5" not in zeroshot_chance_levels(4)
    with pytest.raises(MetricsInputError, match=r"^num_classes: expected >= 1, got 0$"):
        zeroshot_chance_levels(0)


def test_class_embeddings_take_one_template_and_name_the_bad_input():
    """x_class_embeddings__mutmut_9 (a single template or class refused: one template is the
    common case), _12/_17/_19/_27/_28/_30/_32/_35/_36 (which input an error names)."""
    import numpy as np

    from clipms.eval.metrics import MetricsInputError, class_embeddings

    single = class_embeddings(np.array([[[3.0, 4.0]], [[0.0, 2.0]]]))
    np.testing.assert_allclose(single, [[0.6, 0.8], [0.0, 1.0]], atol=1e-7)
    np.testing.assert_allclose(class_embeddings(np.array([[[1.0, 0.0], [0.0, 1.0]]])),
                               [[np.sqrt(0.5), np.sqrt(0.5)]], atol=1e-7)
    with pytest.raises(MetricsInputError) as err:
        class_embeddings(np.ones((2, 0, 3)))
    assert str(err.value) == ("template_features: expected a non-empty (classes, templates, dim) "
                              "array, got (2, 0, 3)")
    with pytest.raises(MetricsInputError, match=r"^template_features: rows \[1\] have zero"):
        class_embeddings(np.array([[[1.0, 0.0], [0.0, 0.0]]]))
    with pytest.raises(MetricsInputError, match=r"^class embeddings \(mean of templates\): rows "
                                                r"\[0\] have zero norm"):
        class_embeddings(np.array([[[1.0, 0.0], [-1.0, 0.0]]]))  # opposite templates cancel


def test_confusion_matrix_counts_are_integers_and_errors_name_their_input():
    """x_confusion_matrix__mutmut_33/35 (float counts), _5/_6/_12.._15/_20/_21/_27.._30 (which
    vector an error names, and of what)."""
    import numpy as np

    from clipms.eval.metrics import MetricsInputError, confusion_matrix

    matrix = confusion_matrix(np.array([0, 1, 1]), np.array([1, 1, 0]), 2)
    assert matrix.dtype == np.int64 and matrix.tolist() == [[0, 1], [1, 1]]
    with pytest.raises(MetricsInputError) as err:
        confusion_matrix(np.array([0, 2]), np.array([0, 0]), 2)
    assert str(err.value) == "labels: entries [1] are outside [0, 2) (the number of classes)"
    with pytest.raises(MetricsInputError) as err:
        confusion_matrix(np.array([0, 1]), np.array([3, 0]), 2)
    assert str(err.value) == "predictions: entries [0] are outside [0, 2) (the number of classes)"


def test_zero_shot_at_five_classes_has_top5_and_errors_name_their_input():
    """x_zeroshot_metrics__mutmut_34/35 (five classes: no top-5), _11.._21 (the labels' error),
    x_zeroshot_scores__mutmut_18..20 (a dimension mismatch: its message, not an IndexError)."""
    import numpy as np

    from clipms.eval.metrics import MetricsInputError, zeroshot_metrics

    classes = np.eye(5, dtype=np.float32)
    images = np.array([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]], dtype=np.float32)  # class 0: 5th, 1st
    assert zeroshot_metrics(images, classes, np.array([0, 0])) == {
        "zeroshot_top1": 0.5, "zeroshot_top5": 1.0, "zeroshot_mean_per_class_recall": 0.5}
    with pytest.raises(MetricsInputError) as err:
        zeroshot_metrics(images, classes, np.array([0, 5]))
    assert str(err.value) == "labels: entries [1] are outside [0, 5) (the number of classes)"
    with pytest.raises(MetricsInputError) as err:
        zeroshot_metrics(images, np.eye(3, 4, dtype=np.float32), np.array([0, 0]))
    assert str(err.value) == "image_features dim 5 != class_features dim 4"


def test_retrieval_chance_levels_of_one_image_and_bad_counts():
    """x_retrieval_chance_levels__mutmut_10 (one image refused), _8 (an empty list or a zero
    count let through: NaN metrics), _13.._15 (the message)."""
    from clipms.eval.metrics import MetricsInputError, retrieval_chance_levels

    assert retrieval_chance_levels([3], ks=(1,)) == {"i2t_R@1": 1.0, "t2i_R@1": 1.0,
                                                      "mAP@10": 1.0}
    for bad in ([], [2, 0]):
        with pytest.raises(MetricsInputError) as err:
            retrieval_chance_levels(bad, ks=(1,))
        assert str(err.value) == "captions_per_image: expected a non-empty list of counts >= 1"


def test_retrieval_refuses_non_positive_ks_and_names_each_bad_input():
    """x__check_ks__mutmut_4/9 (ks of 0 let through: an R@0 of 0), x_retrieval_metrics__mutmut_
    28/38/39 (the caption index error names images), _53 (a bad chunk's message),
    x_l2_normalize__mutmut_1/2/10 (the default name, the shape message)."""
    import numpy as np

    from clipms.eval.metrics import MetricsInputError, l2_normalize, retrieval_metrics

    images, texts = np.eye(2, dtype=np.float32), np.eye(2, dtype=np.float32)
    for ks in ((), (1, 0)):
        with pytest.raises(MetricsInputError) as err:
            retrieval_metrics(images, texts, np.array([0, 1]), ks=ks)
        assert str(err.value) == f"ks: expected positive integers, got {ks}"
    with pytest.raises(MetricsInputError) as err:
        retrieval_metrics(images, texts, np.array([0, 2]))
    assert str(err.value) == "text_to_image: entries [1] are outside [0, 2) (the number of images)"
    with pytest.raises(MetricsInputError) as err:
        retrieval_metrics(images, texts, np.array([0, 1]), chunk=0)
    assert str(err.value) == "chunk: expected a positive integer, got 0"
    with pytest.raises(MetricsInputError) as err:
        l2_normalize(np.ones(3))
    assert str(err.value) == "features: expected a 2-D array (rows, dim), got shape (3,)"


def test_l2_normalize_returns_float32_and_takes_one_dimension():
    """x_l2_normalize__mutmut_5/7 (float64 in, float64 out: the documented float32 lost), _17 (a
    one-dimensional embedding refused as empty)."""
    import numpy as np

    from clipms.eval.metrics import l2_normalize

    unit = l2_normalize(np.array([[3.0, 4.0]], dtype=np.float64))
    assert unit.dtype == np.float32 and unit.tolist() == [[0.6000000238418579, 0.800000011920929]]
    assert l2_normalize(np.array([[2.0], [-3.0]])).tolist() == [[1.0], [-1.0]]


def test_chance_map_of_one_image_with_two_captions_is_one():
    """x_retrieval_chance_levels__mutmut_72 (max(M - 1, 2): wrong whenever M = 2): two captions,
    both relevant, so every random order has AP 1."""
    from clipms.eval.metrics import retrieval_chance_levels

    assert retrieval_chance_levels([2], ks=(1,))["mAP@10"] == 1.0


def test_build_prompts_names_what_is_empty():
    """x_build_prompts__mutmut_3/6/7/8 (the messages of an empty class or template list)."""
    from clipms.eval.metrics import MetricsInputError, build_prompts

    with pytest.raises(MetricsInputError) as err:
        build_prompts([], ["a {}"])
    assert str(err.value) == "class_names: empty; zero-shot needs at least one class"
    with pytest.raises(MetricsInputError) as err:
        build_prompts(["cat"], [])
    assert str(err.value) == "templates: empty; zero-shot needs at least one prompt template"
