"""clipms.train.loss: InfoNCE and SigLIP against numpy, SigLIP (and its gradients) against
open_clip's golden vectors; the rank-split (gathered) losses equal the global ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import clipms  # noqa: F401  (sets MindSpore's environment before mindspore is imported)

# isort: split
import mindspore as ms

from clipms.train.loss import ClipLoss, SigLipLoss, build_loss, contrastive_loss, sigmoid_loss


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


# ---- SigLIP -------------------------------------------------------------------------------------

GOLDEN = Path(__file__).parents[2] / "data" / "openclip" / "siglip.npz"


def _numpy_siglip_loss(image: np.ndarray, text: np.ndarray, scale: float, bias: float) -> float:
    """The SigLIP paper's pseudo-code (Algorithm 1), in float64."""
    logits = scale * image.astype(np.float64) @ text.astype(np.float64).T + bias
    labels = 2 * np.eye(len(image)) - 1
    return float(np.sum(np.logaddexp(0, -labels * logits)) / len(image))


@pytest.mark.parametrize(("scale", "bias"), [(10.0, -10.0), (1 / 0.07, -3.0), (100.0, 0.0)])
def test_siglip_loss_matches_numpy_reference(mode, scale, bias):
    image, text = _features(16, 32, seed=3)
    loss = SigLipLoss()(ms.Tensor(image), ms.Tensor(text), ms.Tensor(np.float32(scale)),
                        ms.Tensor(np.float32(bias)))
    assert loss.shape == () and loss.dtype == ms.float32
    np.testing.assert_allclose(float(loss.asnumpy()), _numpy_siglip_loss(image, text, scale, bias),
                               rtol=1e-5)


class _SigLipOfLogScale(ms.nn.Cell):
    """SigLipLoss of exp(log_scale), as the model hands the loss its scale."""

    def __init__(self) -> None:
        super().__init__()
        self.loss = SigLipLoss()

    def construct(self, image, text, log_scale, bias):
        return self.loss(image, text, ms.ops.exp(log_scale), bias)


@pytest.mark.parametrize("case", [0, 1, 2])
def test_siglip_loss_and_gradients_equal_open_clips(mode, case):
    """open_clip's SigLipLoss and its autograd gradients (tests/data/openclip/siglip.npz): the
    loss and the gradient of every input (features, log scale, bias) agree."""
    golden = np.load(GOLDEN)
    names = ("image", "text", "log_scale", "bias")
    inputs = [ms.Tensor(golden[f"case{case}_{name}"]) for name in names]
    net = _SigLipOfLogScale()
    loss = net(*inputs)
    np.testing.assert_allclose(float(loss.asnumpy()), float(golden[f"case{case}_loss"]),
                               rtol=2e-6)
    grads = ms.ops.GradOperation(get_all=True)(net)(*inputs)
    for name, grad in zip(names, grads, strict=True):
        want = golden[f"case{case}_grad_{name}"]  # fp32 rounding, scaled by up to logit scale 100
        np.testing.assert_allclose(grad.asnumpy(), want, rtol=1e-4,
                                   atol=1e-5 * max(1.0, float(np.abs(want).max())), err_msg=name)


@pytest.mark.parametrize("ranks", [2, 4])
def test_gathered_siglip_loss_equals_single_process_loss(mode, ranks):
    """Each simulated rank scores its images against the all-gathered texts; the mean over ranks
    is the single-process loss of the whole batch (what averaged gradients optimise)."""
    image, text = _features(16, 24, seed=4)
    scale, bias = ms.Tensor(np.float32(10.0)), ms.Tensor(np.float32(-10.0))
    all_text = ms.Tensor(text)
    single = float(SigLipLoss()(ms.Tensor(image), all_text, scale, bias).asnumpy())
    n = len(image) // ranks
    per_rank = [float(sigmoid_loss(ms.Tensor(image[r * n:(r + 1) * n]), all_text, scale, bias,
                                   r).asnumpy()) for r in range(ranks)]
    np.testing.assert_allclose(np.mean(per_rank), single, rtol=1e-6)
    wrong = float(sigmoid_loss(ms.Tensor(image[n:2 * n]), all_text, scale, bias, 0).asnumpy())
    assert abs(wrong - per_rank[1]) > 0.1  # another rank's offset scores other pairs


def test_siglip_gather_without_communication_is_a_clear_error():
    with pytest.raises(RuntimeError, match="SigLipLoss.*communication.init"):
        SigLipLoss(gather=True)
    with pytest.raises(ValueError, match="train.loss='focal' is not one of"):
        build_loss("focal")


def test_the_siglip_loss_does_not_depend_on_how_often_its_graph_has_run():
    """As for the softmax loss above: a resumed run logs bitwise the uninterrupted run's losses."""
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        batches = [(*map(ms.Tensor, _features(4, 16, seed=s)), ms.Tensor(np.float32(14.3)),
                    ms.Tensor(np.float32(-7.0))) for s in range(30)]
        forward, backward = SigLipLoss(), SigLipLoss()
        ahead = [forward(*batch).asnumpy() for batch in batches]
        behind = [backward(*batch).asnumpy() for batch in reversed(batches)][::-1]
    finally:
        ms.set_context(mode=previous)
    assert [i for i, (a, b) in enumerate(zip(ahead, behind, strict=True))
            if not np.array_equal(a, b)] == []
