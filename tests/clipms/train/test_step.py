"""The compiled train step on a real (micro) CLIP in GRAPH_MODE: accumulation equivalence,
clipping, the logit-scale clamp, the learning rate and bias correction computed in the graph, the
device-side record of a non-finite step, and uint8 pixels normalised on the device."""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from clipms.data.dataset import normalize_pixels
from clipms.data.preprocess import PreprocessConfig
from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig
from clipms.model.clip import CLIP
from clipms.train import optim, schedule
from clipms.train.feed import RandomBatches
from clipms.train.step import ClipWithLoss, PixelNormalize, TrainStep

MICRO = CLIPConfig(
    embed_dim=16,
    vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
    text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1),
)


class PerSampleLoss(nn.Cell):
    """A per-sample-mean surrogate: mean_i(scale * (1 - <img_i, txt_i>)) -- unlike the contrastive
    loss, the mean of k micro-batch losses is exactly the loss of their concatenation."""

    def construct(self, image_features, text_features, logit_scale):
        return ops.mean(logit_scale * (1.0 - ops.sum(image_features * text_features, -1)))


def _step_cell(accum_steps: int = 1, max_grad_norm: float = 0.0, lr: float = 1e-3,
               warmup: int = 0, total: int = 10):
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    model = CLIP(MICRO)
    opt = optim.build_adamw(list(model.parameters_and_names()))
    cell = TrainStep(ClipWithLoss(model, PerSampleLoss()), opt,
                     optim.Schedule(lr, warmup, total), accum_steps=accum_steps,
                     max_grad_norm=max_grad_norm, logit_scale=model.logit_scale)
    return model, cell


def _first_moments(cell) -> list[np.ndarray]:
    """After one AdamW step, adam_m = (1 - beta1) * grad: the gradient, recovered exactly."""
    return [m.asnumpy() / (1 - schedule.BETAS[0]) for m in cell.optimizer.exp_avg]


def _batch(n: int, seed: int):
    images, tokens = RandomBatches(MICRO, n, 1, seed=seed).global_batch(0, 0)
    return ms.Tensor(images.astype(np.float32) / 255), ms.Tensor(tokens)


@pytest.mark.slow  # compiles a training step
def test_accumulating_k_micro_batches_equals_one_batch_of_k_times_the_size():
    images, tokens = _batch(8, seed=3)
    _, whole = _step_cell(accum_steps=1)
    whole(images, tokens, True)
    _, accum = _step_cell(accum_steps=2)
    accum(images[:4], tokens[:4], False)
    accum(images[4:], tokens[4:], True)
    grads_whole, grads_accum = _first_moments(whole), _first_moments(accum)
    assert max(np.abs(g).max() for g in grads_whole) > 1e-4  # a real gradient, not zeros
    for a, b in zip(grads_whole, grads_accum, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    # the buffers are drained: a second accumulated step does not see the first one's gradients
    assert all(float(np.abs(buf.asnumpy()).max()) == 0.0 for buf in accum.accum)
    # one optimizer step, counted once on the device however many micro-batches it took
    assert int(accum.step.asnumpy()) == int(accum.adam_t.asnumpy()) == 1


@pytest.mark.slow  # compiles a training step
def test_clipping_scales_the_update_to_the_max_norm_and_reports_the_raw_norm():
    images, tokens = _batch(4, seed=4)
    _, free = _step_cell()
    _, raw_norm, _, _ = free(images, tokens, True)
    raw = _first_moments(free)
    norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in raw))
    assert float(raw_norm.asnumpy()) == pytest.approx(norm, rel=1e-4)
    _, clipped_cell = _step_cell(max_grad_norm=norm / 10)
    _, reported, _, _ = clipped_cell(images, tokens, True)
    assert float(reported.asnumpy()) == pytest.approx(norm, rel=1e-4)
    clipped = _first_moments(clipped_cell)
    clipped_norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in clipped))
    assert clipped_norm == pytest.approx(norm / 10, rel=1e-3)
    np.testing.assert_allclose(clipped[0], raw[0] / 10, rtol=1e-3, atol=1e-7)


@pytest.mark.slow  # compiles a training step
def test_logit_scale_is_clamped_to_ln_100_after_the_step_and_returned():
    model, cell = _step_cell(lr=0.0)
    model.logit_scale.set_data(ms.Tensor(np.float32(6.0)))  # exp(6) = 403 > 100
    *_, scale = cell(*_batch(4, seed=0), True)
    assert float(model.logit_scale.asnumpy()) == pytest.approx(math.log(100), abs=1e-6)
    assert float(scale.asnumpy()) == pytest.approx(100.0, rel=1e-5)


def test_the_graph_schedule_is_the_host_schedule_in_fp32():
    lr, warmup, total = 5e-4, 3, 12

    class Probe(nn.Cell):
        def __init__(self):
            super().__init__()
            self.schedule = optim.Schedule(lr, warmup, total)

        def construct(self, step, t):
            return self.schedule(step, t)

    ms.set_context(mode=ms.GRAPH_MODE)
    probe = Probe()
    for step in range(total + 2):  # past the end too: the cosine stays at 0
        t = step + 1
        got = [float(x.asnumpy()) for x in probe(ms.Tensor(np.int32(step)), ms.Tensor(np.int32(t)))]
        want = schedule.folded_hyper(schedule.cosine_lr(step, lr, warmup, total), t)
        np.testing.assert_allclose(got, [want.lr, want.eps, want.weight_decay], rtol=2e-6,
                                   atol=1e-12, err_msg=f"step {step}")


@pytest.mark.slow  # compiles a training step
def test_the_first_non_finite_step_is_recorded_on_the_device_and_kept():
    _, cell = _step_cell()
    images, tokens = _batch(4, seed=1)
    for _ in range(2):
        cell(images, tokens, True)
    assert int(cell.first_bad_step.asnumpy()) == 0
    poisoned = images.asnumpy().copy()
    poisoned[0, 0, 0, 0] = np.nan
    loss, *_ = cell(ms.Tensor(poisoned), tokens, True)  # step 3
    assert not math.isfinite(float(loss.asnumpy()))
    cell(images, tokens, True)  # step 4: the weights are NaN now; the record stays at 3
    assert int(cell.first_bad_step.asnumpy()) == 3 and int(cell.step.asnumpy()) == 4


def test_uint8_pixels_normalised_on_the_device_equal_the_host_preprocessing():
    cfg = PreprocessConfig(image_size=16)
    pixels = np.random.default_rng(7).integers(0, 256, (3, 3, 16, 16), dtype=np.uint8)
    ms.set_context(mode=ms.GRAPH_MODE)
    on_device = PixelNormalize(cfg.mean, cfg.std)(ms.Tensor(pixels)).asnumpy()
    # bit for bit what clipms.data.preprocess computes (the same fp32 operations in the same order)
    np.testing.assert_array_equal(on_device, normalize_pixels(pixels, cfg))
    already = ms.Tensor(normalize_pixels(pixels, cfg))  # normalised floats pass through
    np.testing.assert_array_equal(PixelNormalize(cfg.mean, cfg.std)(already).asnumpy(),
                                  already.asnumpy())
