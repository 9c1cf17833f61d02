"""The compiled training step: pixel normalisation, forward + backward, gradient accumulation,
dynamic loss scaling, data-parallel gradient averaging, global-norm clipping, the learning-rate
schedule and AdamW, the logit-scale clamp, and a record of the first non-finite step.

One Cell, compiled by GRAPH_MODE into (at most) two graphs: `apply=False` (a micro-batch that only
accumulates its gradients) and `apply=True` (the last micro-batch, then the update). Every value
that changes from step to step lives on the device (the step counters below), so the host only
launches steps and reads results when it wants them: step N+1 is queued without waiting for N.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from clipms.model.clip import cast
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
        if self.normalize is not None:
            images = self.normalize(images)
        image_features, text_features, logit_scale = self.model(images, tokens)
        features = (cast(image_features, ms.float32), cast(text_features, ms.float32),
                    cast(logit_scale, ms.float32))
        if self.with_bias:
            return self.loss(*features, cast(self.model.logit_bias, ms.float32))
        return self.loss(*features)


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


class TrainStep(nn.Cell):
    """`construct(images, tokens, apply) -> (loss, grad_norm, finite, logit_scale, loss_scale)`,
    all tensors on the device: the micro-batch loss (averaged over ranks when data-parallel), the
    global gradient norm, whether the update was applied, exp(logit_scale) after the clamp and
    the loss scale the next step uses (1 in fp32).

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
                 max_logit_scale: float = float(np.log(100.0)), group_size: int = 1) -> None:
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
        if accum_steps > 1:
            self.accum = self.weights.clone(prefix="accum_grad", init="zeros")
            self.accum_factor = Tensor(np.float32(1.0 / accum_steps))
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

    def construct(self, images, tokens, apply: bool):  # noqa: ANN001, ANN201
        loss = self.net(images, tokens)
        sens = ops.cast(self.scale, loss.dtype) if self.amp else ops.ones_like(loss)
        grads = self.grad(self.net, self.weights)(images, tokens, sens)
        if self.amp:
            grads = self.hyper_map(ops.partial(_times, 1.0 / self.scale), grads)
        if self.distributed:
            loss = self.all_reduce(loss) / self.group_size  # the loss of the global batch
        if not apply:
            self.hyper_map(_add_into, self.accum, grads)
            if not self.amp:
                self._record_if_bad(ops.logical_not(ops.isfinite(loss)))
            return (loss, ops.zeros((), ms.float32), ops.ones((), ms.bool_), self._scale_now(),
                    ops.cast(self.scale, ms.float32))
        if self.accum_steps > 1:
            grads = self._drain_accumulated(grads)
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

    def _drain_accumulated(self, grads: tuple) -> tuple:
        """(sum of earlier micro-batch grads + this one) / k, and zero the buffers."""
        total = self.hyper_map(ops.add, self.accum, grads)
        mean = self.hyper_map(ops.partial(_times, self.accum_factor), total)
        self.hyper_map(ops.assign, self.accum, self.hyper_map(ops.zeros_like, self.accum))
        return mean

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


def _counter(name: str, value: np.generic | None = None) -> Parameter:
    """A scalar state Parameter (int32 0 unless `value` says otherwise), never trained."""
    return Parameter(Tensor(np.int32(0) if value is None else value), name=name,
                     requires_grad=False)
