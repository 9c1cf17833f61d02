"""The compiled train step and loop on a real (micro) CLIP in GRAPH_MODE: accumulation equivalence,
clipping, the logit-scale clamp, tower locking, NaN handling, and amp on CPU."""

from __future__ import annotations

import clipms  # noqa: F401  - sets MindSpore's environment before mindspore is imported

# isort: split
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from clipms import checkpoint, optim
from clipms.config import CLIPConfig, TextConfig, VisionConfig
from clipms.model import CLIP
from clipms.train_step import ClipWithLoss, TrainStep
from clipms.trainer import NonFiniteLossError, RandomBatches, TrainConfig, train

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


def _step_cell(accum_steps: int, max_grad_norm: float = 0.0):
    ms.set_seed(0)
    model = CLIP(MICRO)
    named = list(model.parameters_and_names())
    opt = optim.build_adamw(named)
    cell = TrainStep(ClipWithLoss(model, PerSampleLoss()), opt, accum_steps=accum_steps,
                     max_grad_norm=max_grad_norm, logit_scale=model.logit_scale)
    return model, cell


def _first_moments(cell) -> list[np.ndarray]:
    """After one AdamW step, adam_m = (1 - beta1) * grad: the gradient, recovered exactly."""
    return [m.asnumpy() / (1 - optim.BETAS[0]) for m in cell.optimizer.exp_avg]


def _scalars(lr: float = 1e-3) -> list[ms.Tensor]:
    return [ms.Tensor(x) for x in optim.folded_hyper(lr, 1).tensors()]


def test_accumulating_k_micro_batches_equals_one_batch_of_k_times_the_size():
    ms.set_context(mode=ms.GRAPH_MODE)
    images, tokens = RandomBatches(MICRO, 8, 1, seed=3).global_batch(0, 0)
    _, whole = _step_cell(accum_steps=1)
    whole(ms.Tensor(images), ms.Tensor(tokens), *_scalars(), True)
    _, accum = _step_cell(accum_steps=2)
    accum(ms.Tensor(images[:4]), ms.Tensor(tokens[:4]), *_scalars(), False)
    accum(ms.Tensor(images[4:]), ms.Tensor(tokens[4:]), *_scalars(), True)
    grads_whole, grads_accum = _first_moments(whole), _first_moments(accum)
    assert max(np.abs(g).max() for g in grads_whole) > 1e-4  # a real gradient, not zeros
    for a, b in zip(grads_whole, grads_accum, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    # the buffers are drained: a second accumulated step does not see the first one's gradients
    assert all(float(np.abs(buf.asnumpy()).max()) == 0.0 for buf in accum.accum)


def test_clipping_scales_the_update_to_the_max_norm_and_reports_the_raw_norm():
    ms.set_context(mode=ms.GRAPH_MODE)
    images, tokens = RandomBatches(MICRO, 4, 1, seed=4).global_batch(0, 0)
    _, free = _step_cell(accum_steps=1)
    _, raw_norm, _ = free(ms.Tensor(images), ms.Tensor(tokens), *_scalars(), True)
    raw = _first_moments(free)
    norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in raw))
    assert float(raw_norm.asnumpy()) == pytest.approx(norm, rel=1e-4)
    _, clipped_cell = _step_cell(accum_steps=1, max_grad_norm=norm / 10)
    _, reported, _ = clipped_cell(ms.Tensor(images), ms.Tensor(tokens), *_scalars(), True)
    assert float(reported.asnumpy()) == pytest.approx(norm, rel=1e-4)
    clipped = _first_moments(clipped_cell)
    clipped_norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in clipped))
    assert clipped_norm == pytest.approx(norm / 10, rel=1e-3)
    np.testing.assert_allclose(clipped[0], raw[0] / 10, rtol=1e-3, atol=1e-7)


def test_logit_scale_is_clamped_to_ln_100_after_the_step():
    ms.set_context(mode=ms.GRAPH_MODE)
    model, cell = _step_cell(accum_steps=1)
    model.logit_scale.set_data(ms.Tensor(np.float32(6.0)))  # exp(6) = 403 > 100
    images, tokens = RandomBatches(MICRO, 4, 1).global_batch(0, 0)
    cell(ms.Tensor(images), ms.Tensor(tokens), *_scalars(lr=0.0), True)
    assert float(model.logit_scale.asnumpy()) == pytest.approx(math.log(100), abs=1e-6)


class NaNAt(RandomBatches):
    """Random batches whose batch `bad` holds a NaN pixel."""

    def __init__(self, *args, bad: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bad = bad

    def global_batch(self, epoch: int, index: int):
        images, tokens = super().global_batch(epoch, index)
        if epoch * self.batches_per_epoch + index == self.bad:
            images[0, 0, 0, 0] = np.nan
        return images, tokens


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = TrainConfig(model=MICRO, batch_size=4, epochs=1, lr=1e-3, warmup_steps=1,
                      checkpoint_every=2, keep_checkpoints=5)
    with pytest.raises(NonFiniteLossError, match=r"at step 5 \(epoch 0\)"):
        train(cfg, NaNAt(MICRO, 4, 8, bad=4), tmp_path / "ckpt", resume=False)
    saved = checkpoint.list_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in saved] == ["step-00000002.ckpt", "step-00000004.ckpt"]
    last = checkpoint.load(saved[-1])
    assert last.meta["step"] == 4
    assert all(np.isfinite(v).all() for v in last.tensors.values())


def test_locked_image_tower_does_not_move_and_text_tower_does(tmp_path):
    cfg = TrainConfig(model=MICRO, batch_size=4, epochs=1, lr=1e-2, warmup_steps=1,
                      lock_image=True, checkpoint_every=100)
    ms.set_seed(cfg.seed)
    before = {n: p.asnumpy().copy() for n, p in CLIP(MICRO).parameters_and_names()}
    result = train(cfg, RandomBatches(MICRO, 4, 2), None)
    after = {n: p.asnumpy() for n, p in result.model.parameters_and_names()}
    moved = {n for n in before if not np.array_equal(before[n], after[n])}
    assert moved and not any(n.startswith("visual.") for n in moved)
    assert any(n.startswith("text.") for n in moved)


def test_amp_runs_on_cpu_with_a_dynamic_loss_scale():
    cfg = TrainConfig(model=MICRO, batch_size=4, epochs=1, lr=1e-3, warmup_steps=1,
                      precision="amp", loss_scale_window=2)
    result = train(cfg, RandomBatches(MICRO, 4, 3), None)
    losses = [row["loss"] for row in result.history]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert result.model.logit_scale.dtype == ms.float32  # master weights stay fp32
    names = [name for name, _ in result.model.parameters_and_names()]
    ms.set_seed(0)
    assert names == [name for name, _ in CLIP(MICRO).parameters_and_names()]  # CLIP's own names


def test_checkpoints_of_another_config_are_discarded_not_resumed(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    cfg = TrainConfig(model=MICRO, batch_size=4, epochs=1, lr=1e-3, warmup_steps=1,
                      checkpoint_every=1)
    train(cfg, RandomBatches(MICRO, 4, 2), folder)
    assert [p.name for p in checkpoint.list_checkpoints(folder)] == [
        "step-00000001.ckpt", "step-00000002.ckpt"]
    other = TrainConfig(**{**cfg.__dict__, "lr": 2e-3, "max_steps": 1})
    with caplog.at_level("WARNING", logger="clipms.trainer"):
        result = train(other, RandomBatches(MICRO, 4, 2), folder)
    assert "belong to another configuration" in caplog.text
    assert [row["step"] for row in result.history] == [1]  # trained from scratch
    saved = checkpoint.list_checkpoints(folder)
    assert [p.name for p in saved] == ["step-00000001.ckpt"]
    assert checkpoint.load(saved[0]).meta["fingerprint"] == other.fingerprint()
