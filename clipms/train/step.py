"""The compiled training step: pixel normalisation, forward + backward, gradient accumulation
over the whole accumulated batch (feature caching), dynamic loss scaling, data-parallel gradient
averaging, global-norm clipping, the learning-rate schedule and AdamW, the logit-scale clamp, and
a record of the first non-finite step.

One Cell, compiled by GRAPH_MODE into one graph per phase it runs: a whole step (`STEP`), or,
with accumulation, `CACHE`, `LOSS`, `BACKPROP` and `APPLY` (`TrainStep.accumulate`). Every value
that changes from step to step lives on the device (the step counters below), so the host only
launches steps and reads results when it wants them: step N+1 is queued without waiting for N.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from clipms.model.clip import cast
from clipms.model.patch_dropout import PatchDropout
from clipms.train.optim import Schedule, clip_by_global_norm, global_norm


class PixelNormalize(nn.Cell):
    """uint8 (N, 3, H, W) pixels -> (x / 255 - mean) / std in fp32, the operations and order of
    `clipms.data.preprocess.to_normalized_array`, on the device (the batch travels at 1 byte a
    pixel). Images that are already floating point pass through: they were normalised on the
    host."""

    def __init__(self, mean: tuple[float, float, float], std: tuple[float, float, float]) -> None:
        super().__init__()
        self.mean = Tensor(np.asarray(mean, np.float32).reshape(1, 3, 1, 1))
        self.std = Tensor(np.asarray(std, np.float32).reshape(1, 3, 1, 1))

    def construct(self, images: Tensor) -> Tensor:
        if images.dtype != ms.uint8:
            return images
        return (ops.cast(images, ms.float32) / 255.0 - self.mean) / self.std


class ClipWithLoss(nn.Cell):
    """CLIP + loss as one Cell: (images, tokens) -> scalar loss, the loss always in fp32 (under
    amp CLIP already returns fp32 features and scale: `clipms.model.clip.to_mixed_precision`). A
    model with a `logit_bias` (SigLIP) hands it to the loss as its fourth argument."""

    def __init__(self, model: nn.Cell, loss: nn.Cell, normalize: nn.Cell | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.normalize = normalize  # PixelNormalize for uint8 batches
        self.with_bias = getattr(model, "logit_bias", None) is not None

    def construct(self, images: Tensor, tokens: Tensor) -> Tensor:
        return self.loss(*self.features(images, tokens))

    def features(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, ...]:
        """What the loss takes, in fp32: image and text features, exp(logit_scale), and the
        logit bias when the model has one."""
        if self.normalize is not None:
            images = self.normalize(images)
        image_features, text_features, logit_scale = self.model(images, tokens)
        features = (cast(image_features, ms.float32), cast(text_features, ms.float32),
                    cast(logit_scale, ms.float32))
        if self.with_bias:
            return (*features, cast(self.model.logit_bias, ms.float32))
        return features


class _Features(nn.Cell):
    """`ClipWithLoss.features` as a Cell of its own: what the feature cache differentiates."""

    def __init__(self, net: ClipWithLoss) -> None:
        super().__init__(auto_prefix=False)
        self.net = net

    def construct(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, ...]:
        return self.net.features(images, tokens)


class _LossOf(nn.Cell):
    """The loss as a function of the features (`bias` ignored without a logit bias)."""

    def __init__(self, loss: nn.Cell, with_bias: bool) -> None:
        super().__init__(auto_prefix=False)
        self.loss = loss
        self.with_bias = with_bias

    def construct(self, image_features, text_features, logit_scale, bias):  # noqa: ANN001, ANN201
        if self.with_bias:
            return self.loss(image_features, text_features, logit_scale, bias)
        return self.loss(image_features, text_features, logit_scale)


class AllGatherSumGrad(nn.Cell):
    """AllGather along axis 0 whose gradient is AllReduce(sum) + this rank's slice.

    That is exactly AllGather's own gradient (a ReduceScatter), which MindSpore has no CPU kernel
    for; AllReduce has one on every backend. `clipms.train.loss.ClipLoss(gather=True)` and
    `SigLipLoss(gather=True)` get this Cell as their `all_gather` in `use_cpu_safe_gather`.
    """

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.all_gather = ops.AllGather()
        self.all_reduce = ops.AllReduce()

    def construct(self, x: Tensor) -> Tensor:
        return self.all_gather(x)

    def bprop(self, x: Tensor, out: Tensor, dout: Tensor) -> tuple[Tensor]:
        n = x.shape[0]
        total = self.all_reduce(dout)  # sum over ranks of d(loss_r)/d(all features)
        return (total[self.rank * n:(self.rank + 1) * n],)


def use_cpu_safe_gather(loss: nn.Cell) -> nn.Cell:
    """Swap the gather of a `ClipLoss(gather=True)` or `SigLipLoss(gather=True)` for
    `AllGatherSumGrad` (same forward, same gradient, runs on CPU too)."""
    if getattr(loss, "gather", False):
        loss.all_gather = AllGatherSumGrad(loss.rank)
    return loss


_add_into = ops.MultitypeFuncGraph("clipms_add_into")
_times = ops.MultitypeFuncGraph("clipms_times")


@_times.register("Tensor", "Tensor")
def _times_one(factor: Tensor, grad: Tensor) -> Tensor:
    return grad * ops.cast(factor, grad.dtype)


@_add_into.register("Tensor", "Tensor")
def _add_into_one(buffer: Parameter, grad: Tensor) -> Tensor:
    return ops.assign_add(buffer, grad)


_move_draws = ops.MultitypeFuncGraph("clipms_move_draws")


@_move_draws.register("Tensor", "Tensor")
def _move_draws_one(by: Tensor, counter: Parameter) -> Tensor:
    return ops.assign_add(counter, ops.cast(by, counter.dtype))


# What one TrainStep call does (Python constants: each compiles a graph of its own). STEP is a
# whole optimizer step on one batch; with accum_steps k > 1 an optimizer step is CACHE x k,
# LOSS, BACKPROP x k, APPLY (`TrainStep.accumulate`).
STEP, CACHE, LOSS, BACKPROP, APPLY = 0, 1, 2, 3, 4


class TrainStep(nn.Cell):
    """`construct(images, tokens) -> (loss, grad_norm, finite, logit_scale, loss_scale)`, all
    tensors on the device: the batch's loss (averaged over ranks when data-parallel), the global
    gradient norm, whether the update was applied, exp(logit_scale) after the clamp and the loss
    scale the next step uses (1 in fp32).

    With `accum_steps` k > 1, `accumulate` takes k micro-batches and computes the contrastive
    loss over all of them (x ranks), as open_clip's `--accum-freq` does, by caching features:
    a forward of each micro-batch without gradients caches its features; the loss of the whole
    cache and its gradient with respect to every feature (and to the logit scale and bias) is
    computed once; each micro-batch's forward is then run again and back-propagated from its
    slice of that gradient, summing into the accumulation buffers. The sum is the gradient of the
    loss of the k-times larger batch (open_clip recomputes the loss per micro-batch and so counts
    the logit scale's own gradient k times; here it is counted once). Memory stays one
    micro-batch's activations plus k x micro-batch features.

    Under amp a step whose gradients or loss are not finite is skipped (the weights and AdamW's
    moments keep their values, as torch's GradScaler does) and the scale halves; the host counts
    the skipped steps and stops a run that skips too many (`clipms.train.loop`). In fp32 such a
    step would write NaN into the weights, so the first one is recorded (`first_bad_step`) and
    stops the run.

    State (Parameters, so checkpoints hold it): `train_step` optimizer steps done, `adam_t` AdamW
    updates applied (amp skips do not count), `first_bad_step` 0 or the 1-based fp32 step whose
    loss or gradient norm was first NaN/inf, and the dynamic loss scale.
    """

    def __init__(self, net_with_loss: nn.Cell, optimizer: nn.Cell, schedule: Schedule,
                 accum_steps: int = 1, max_grad_norm: float = 0.0,
                 loss_scale: float | None = None, loss_scale_window: int = 1000,
                 logit_scale: Parameter | None = None,
                 max_logit_scale: float = float(np.log(100.0)), group_size: int = 1,
                 micro_batch: int = 0) -> None:
        super().__init__(auto_prefix=False)
        if accum_steps < 1:
            raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
        self.net = net_with_loss
        self.optimizer = optimizer
        self.schedule = schedule
        self.weights = optimizer.params
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.hyper_map = ops.HyperMap()
        self.accum_steps = accum_steps
        self.max_grad_norm = float(max_grad_norm)
        self.amp = loss_scale is not None
        self.scale = _counter("loss_scale", np.float32(loss_scale or 1.0))
        self.good_steps = _counter("loss_scale_good_steps")
        self.scale_window = int(loss_scale_window)
        self.step = _counter("train_step")
        self.adam_t = _counter("adam_t")
        self.first_bad_step = _counter("first_bad_step")
        self.clamp_logit_scale = logit_scale is not None
        self.logit_scale = logit_scale
        self.max_logit_scale = float(max_logit_scale)
        self.distributed = group_size > 1
        if self.distributed:
            self.reducer = nn.DistributedGradReducer(self.weights, mean=True, degree=group_size)
            self.all_reduce = ops.AllReduce()
            self.group_size = float(group_size)
        if accum_steps > 1:
            self._build_cache(accum_steps, micro_batch)

    def _build_cache(self, k: int, micro_batch: int) -> None:
        """The accumulation state: gradient buffers, and k micro-batches' features, the loss's
        gradient with respect to them, the loss (`accumulate`)."""
        if micro_batch < 1:
            raise ValueError(f"accum_steps={k} needs micro_batch, the rows of one micro-batch")
        self.accum = self.weights.clone(prefix="accum_grad", init="zeros")
        self.features_of = _Features(self.net)
        self.loss_of = _LossOf(self.net.loss, self.net.with_bias)
        self.input_grad = ops.GradOperation(get_all=True, sens_param=True)
        dim = self.net.model.config.embed_dim
        shape = (k, micro_batch, dim)
        names = ("image_cache", "text_cache", "image_sens", "text_sens")
        self.image_cache, self.text_cache, self.image_sens, self.text_sens = (
            _buffer(name, np.zeros(shape, np.float32)) for name in names)
        self.scale_cache, self.bias_cache, self.scale_sens, self.bias_sens, self.cached_loss = (
            _buffer(name, np.float32(0.0))
            for name in ("scale_cache", "bias_cache", "scale_sens", "bias_sens", "cached_loss"))
        # Patch dropout draws anew at every forward (clipms.model.patch_dropout): the second
        # forward of a micro-batch must drop the patches its cached features were made with.
        draws = [cell.draws for _, cell in self.net.model.cells_and_names()
                 if isinstance(cell, PatchDropout) and cell.drawing and cell.prob > 0]
        self.rewind_draws = bool(draws)
        if draws:
            self.draws = ParameterTuple(draws)

    def accumulate(self, batches: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, ...]:
        """One optimizer step on k micro-batches (host side: launches 2k + 2 graphs' runs and
        waits for none); returns what `construct` returns."""
        if len(batches) != self.accum_steps:
            raise ValueError(f"accumulate takes {self.accum_steps} micro-batches, got "
                             f"{len(batches)}")
        slots = [Tensor(np.int32(j)) for j in range(self.accum_steps)]
        for (images, tokens), slot in zip(batches, slots, strict=True):
            self(images, tokens, CACHE, slot)
        images, tokens = batches[-1]
        self(images, tokens, LOSS, slots[0])
        for (images, tokens), slot in zip(batches, slots, strict=True):
            self(images, tokens, BACKPROP, slot)
        return self(images, tokens, APPLY, slots[0])

    def construct(self, images, tokens, phase: int = STEP, slot=None):  # noqa: ANN001, ANN201
        if phase == CACHE:
            return self._cache(images, tokens, slot)
        if phase == LOSS:
            return self._cached_loss_and_sens()
        if phase == BACKPROP:
            return self._backprop(images, tokens, slot)
        if phase == APPLY:
            return self._update(self._drain_accumulated(), self.cached_loss)
        loss = self.net(images, tokens)
        sens = ops.cast(self.scale, loss.dtype) if self.amp else ops.ones_like(loss)
        grads = self.grad(self.net, self.weights)(images, tokens, sens)
        if self.distributed:
            loss = self.all_reduce(loss) / self.group_size  # the loss of the global batch
        return self._update(grads, loss)

    def _cache(self, images: Tensor, tokens: Tensor, slot: Tensor) -> Tensor:
        """Forward only: this micro-batch's features into slot `slot` of the cache."""
        features = self.features_of(images, tokens)
        here = (ops.arange(self.accum_steps, dtype=ms.int32) == slot).reshape(-1, 1, 1)
        ops.assign(self.image_cache, ops.select(here.broadcast_to(self.image_cache.shape),
                                                features[0].expand_dims(0).broadcast_to(
                                                    self.image_cache.shape), self.image_cache))
        ops.assign(self.text_cache, ops.select(here.broadcast_to(self.text_cache.shape),
                                               features[1].expand_dims(0).broadcast_to(
                                                   self.text_cache.shape), self.text_cache))
        ops.assign(self.scale_cache, features[2])
        if self.net.with_bias:
            ops.assign(self.bias_cache, features[3])
        return features[2]

    def _cached_loss_and_sens(self) -> Tensor:
        """The loss of the whole cache (x ranks) and its gradient with respect to the cached
        features, the logit scale and bias, times the loss scale under amp."""
        k, n, dim = self.image_cache.shape
        images = self.image_cache.reshape(k * n, dim)
        texts = self.text_cache.reshape(k * n, dim)
        loss = self.loss_of(images, texts, self.scale_cache, self.bias_cache)
        sens = ops.cast(self.scale, loss.dtype) if self.amp else ops.ones_like(loss)
        d_images, d_texts, d_scale, d_bias = self.input_grad(self.loss_of)(
            images, texts, self.scale_cache, self.bias_cache, sens)
        ops.assign(self.image_sens, d_images.reshape(k, n, dim))
        ops.assign(self.text_sens, d_texts.reshape(k, n, dim))
        ops.assign(self.scale_sens, d_scale)
        ops.assign(self.bias_sens, d_bias)
        if self.distributed:
            loss = self.all_reduce(loss) / self.group_size  # the loss of the global batch
        ops.assign(self.cached_loss, loss)
        return loss

    def _backprop(self, images: Tensor, tokens: Tensor, slot: Tensor) -> Tensor:
        """This micro-batch's forward again, back-propagated from its slice of the loss's
        gradient; the parameters' gradients are added to the buffers. The logit scale and bias
        get theirs once, with slot 0. Patch dropout's counters go back to the draw this slot's
        cached forward made (k - slot draws ago), and on to where the k forwards left them."""
        back = self.accum_steps - slot
        if self.rewind_draws and self.training:  # patch dropout draws in training only
            self.hyper_map(ops.partial(_move_draws, -back), self.draws)
        first = ops.cast(slot == 0, ms.float32)
        sens = (ops.gather(self.image_sens, slot, 0), ops.gather(self.text_sens, slot, 0),
                self.scale_sens * first)
        if self.net.with_bias:
            sens = (*sens, self.bias_sens * first)
        grads = self.grad(self.features_of, self.weights)(images, tokens, sens)
        self.hyper_map(_add_into, self.accum, grads)
        if self.rewind_draws and self.training:
            self.hyper_map(ops.partial(_move_draws, back - 1), self.draws)
        return first

    def _update(self, grads: tuple, loss: Tensor) -> tuple[Tensor, ...]:
        """Unscale (amp), average over ranks, clip, and apply AdamW unless amp skips the step."""
        if self.amp:
            grads = self.hyper_map(ops.partial(_times, 1.0 / self.scale), grads)
        if self.distributed:
            grads = self.reducer(grads)
        finite = ops.ones((), ms.bool_)
        if self.amp:  # an overflow, or a forward that overflowed (a NaN loss): skip the step
            finite = ops.logical_and(ms.amp.all_finite(grads), ops.isfinite(loss))
        if self.max_grad_norm > 0:
            grads, norm = clip_by_global_norm(grads, self.max_grad_norm)
        else:
            norm = global_norm(grads)
        if not self.amp:
            self._record_if_bad(ops.logical_not(
                ops.logical_and(ops.isfinite(loss), ops.isfinite(norm))))
        lr, eps, weight_decay = self.schedule(self.step, self.adam_t + 1)
        if self.amp:
            if finite:
                self.optimizer(grads, lr, eps, weight_decay)
            new_scale = self._adjust_loss_scale(finite)
        else:
            self.optimizer(grads, lr, eps, weight_decay)
            new_scale = ops.ones((), ms.float32)
        ops.assign_add(self.adam_t, ops.cast(finite, ms.int32))
        ops.assign_add(self.step, ops.ones((), ms.int32))
        if self.clamp_logit_scale:
            ops.assign(self.logit_scale, ops.clamp(self.logit_scale, 0.0, self.max_logit_scale))
        return loss, norm, finite, self._scale_now(), ops.cast(new_scale, ms.float32)

    def _scale_now(self) -> Tensor:
        if self.clamp_logit_scale:
            return ops.exp(self.logit_scale)
        return ops.zeros((), ms.float32)

    def _record_if_bad(self, bad: Tensor) -> None:
        """first_bad_step = this step (1-based) if it is the first with a bad value."""
        first = ops.logical_and(bad, self.first_bad_step == 0)
        ops.assign(self.first_bad_step, ops.select(first, self.step + 1, self.first_bad_step))

    def _drain_accumulated(self) -> tuple:
        """The summed micro-batch gradients (of the whole batch's loss), and zero the buffers."""
        total = self.hyper_map(ops.add, self.accum, self.hyper_map(ops.zeros_like, self.accum))
        self.hyper_map(ops.assign, self.accum, self.hyper_map(ops.zeros_like, self.accum))
        return total

    def _adjust_loss_scale(self, finite: Tensor) -> Tensor:
        """DynamicLossScaleManager's rule: halve on overflow, double after `window` good steps;
        returns the new scale."""
        good = ops.select(finite, self.good_steps + 1, ops.zeros_like(self.good_steps))
        grow = good >= self.scale_window
        new_scale = ops.select(finite, ops.select(grow, self.scale * 2.0, self.scale),
                               ops.maximum(self.scale * 0.5, 1.0))
        ops.assign(self.scale, new_scale)
        ops.assign(self.good_steps, ops.select(grow, ops.zeros_like(good), good))
        return new_scale

    def state(self) -> dict[str, Parameter]:
        """The step's own state, by checkpoint name."""
        return {p.name: p for p in (self.step, self.adam_t, self.first_bad_step, self.scale,
                                    self.good_steps)}


def _buffer(name: str, value: np.ndarray | np.generic) -> Parameter:
    """Device state of the feature cache (never trained, never checkpointed: a step's own)."""
    return Parameter(Tensor(value), name=name, requires_grad=False)


def _counter(name: str, value: np.generic | None = None) -> Parameter:
    """A scalar state Parameter (int32 0 unless `value` says otherwise), never trained."""
    return Parameter(Tensor(np.int32(0) if value is None else value), name=name,
                     requires_grad=False)
