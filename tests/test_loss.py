"""clipms.train.loss: InfoNCE against numpy; the rank-split (gathered) loss equals the global
one."""

from __future__ import annotations

import numpy as np
import pytest

import clipms  # noqa: F401  (sets MindSpore's environment before mindspore is imported)

# isort: split
import mindspore as ms

from clipms.train.loss import ClipLoss, contrastive_loss


def _features(n: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    image, text = rng.normal(size=(2, n, d)).astype(np.float32)
    return (image / np.linalg.norm(image, axis=1, keepdims=True),
            text / np.linalg.norm(text, axis=1, keepdims=True))


def _numpy_clip_loss(image: np.ndarray, text: np.ndarray, scale: float) -> float:
    """The CLIP paper's pseudo-code, in float64."""
    logits = scale * image.astype(np.float64) @ text.astype(np.float64).T  # (n, n)

    def cross_entropy(x: np.ndarray) -> float:  # labels are the diagonal
        x = x - x.max(axis=1, keepdims=True)
        log_probs = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
        return float(-np.mean(np.diag(log_probs)))

    return (cross_entropy(logits) + cross_entropy(logits.T)) / 2


@pytest.mark.parametrize("scale", [1.0, 1 / 0.07, 100.0])
def test_loss_matches_numpy_reference(mode, scale):
    image, text = _features(16, 32, seed=0)
    loss = ClipLoss()(ms.Tensor(image), ms.Tensor(text), ms.Tensor(np.float32(scale)))
    assert loss.shape == () and loss.dtype == ms.float32
    np.testing.assert_allclose(float(loss.asnumpy()), _numpy_clip_loss(image, text, scale),
                               rtol=1e-5)


def test_matching_pairs_give_lower_loss(mode):
    image, _ = _features(8, 16, seed=1)
    scale = ms.Tensor(np.float32(1 / 0.07))
    aligned = ClipLoss()(ms.Tensor(image), ms.Tensor(image), scale)
    shuffled = ClipLoss()(ms.Tensor(image), ms.Tensor(image[::-1].copy()), scale)
    assert float(aligned.asnumpy()) < 0.01 < float(shuffled.asnumpy())


@pytest.mark.parametrize("ranks", [2, 4])
def test_gathered_loss_equals_single_process_loss(mode, ranks):
    """Each simulated rank scores its slice against the all-gathered batch (what AllGather hands
    it); the mean over ranks must equal the single-process loss of the whole batch."""
    image, text = _features(16, 24, seed=2)
    scale = ms.Tensor(np.float32(1 / 0.07))
    all_image, all_text = ms.Tensor(image), ms.Tensor(text)
    single = float(ClipLoss()(all_image, all_text, scale).asnumpy())
    n = len(image) // ranks
    per_rank = [
        float(contrastive_loss(ms.Tensor(image[r * n:(r + 1) * n]),
                               ms.Tensor(text[r * n:(r + 1) * n]),
                               all_image, all_text, scale, r).asnumpy())
        for r in range(ranks)
    ]
    np.testing.assert_allclose(np.mean(per_rank), single, rtol=1e-6)
    # A rank that mislabels its global offset scores other ranks' pairs: clearly different.
    wrong = float(contrastive_loss(ms.Tensor(image[n:2 * n]), ms.Tensor(text[n:2 * n]),
                                   all_image, all_text, scale, 0).asnumpy())
    assert abs(wrong - per_rank[1]) > 0.1


def test_gather_without_communication_is_a_clear_error():
    with pytest.raises(RuntimeError, match="communication.init"):
        ClipLoss(gather=True)


def test_the_loss_does_not_depend_on_how_often_its_graph_has_run():
    """MindSpore's CPU kernels re-split their work across threads over their first launches
    (clipms/train/loss.py says which one mattered): two compiled losses fed the same 30 batches in
    opposite orders see each batch at different launch counts and must agree bit for bit. This
    is what keeps a resumed run's logged losses bitwise those of an uninterrupted run."""
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        batches = [(*map(ms.Tensor, _features(4, 16, seed=s)), ms.Tensor(np.float32(14.3)))
                   for s in range(30)]
        forward, backward = ClipLoss(), ClipLoss()
        ahead = [forward(*batch).asnumpy() for batch in batches]
        behind = [backward(*batch).asnumpy() for batch in reversed(batches)][::-1]
    finally:
        ms.set_context(mode=previous)
    assert [i for i, (a, b) in enumerate(zip(ahead, behind, strict=True))
            if not np.array_equal(a, b)] == []


# ---------------------------------------------------------------- loss
# Edges `make mutation` (benchmarks/mutation.py) found untested; each docstring names the
# mutants (mutmut's names) the test kills.


def test_contrastive_loss_left_at_rank_zero_is_the_single_process_loss():
    """clipms.train.loss.x_contrastive_loss__mutmut_1 (a default rank of 1): called as its docstring
    says, without `rank` and with the local features as the global ones, it is ClipLoss's loss."""
    rng = np.random.default_rng(3)
    image, text = rng.normal(size=(2, 4, 8)).astype(np.float32)
    image, text = (ms.Tensor(x / np.linalg.norm(x, axis=1, keepdims=True)) for x in (image, text))
    scale = ms.Tensor(np.float32(10.0))
    assert float(contrastive_loss(image, text, image, text, scale).asnumpy()) == \
        pytest.approx(float(ClipLoss()(image, text, scale).asnumpy()), rel=1e-6)


def test_gather_without_communication_says_what_to_do():
    """clipms.train.loss.xǁClipLossǁ__init____mutmut_7/8/10/11: the whole message (test_loss matches
    only its middle)."""
    with pytest.raises(RuntimeError) as err:
        ClipLoss(gather=True)
    assert str(err.value) == ("ClipLoss(gather=True) needs mindspore.communication.init() first "
                              "(launch the script with msrun)")
