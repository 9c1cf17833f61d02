"""AdamW as open_clip trains CLIP, the warmup + cosine schedule, and which parameters are decayed.

Why a small AdamW of our own: MindSpore's `nn.AdamWeightDecay` runs a fast fused CPU/Ascend kernel
but has no bias correction, so each step differs from torch's AdamW (and from the open_clip
recipes tuned for it) by the factor c1 / sqrt(c2) below (CLIP's betas 0.9/0.98: 0.71 at step 1,
1.07 at step 100, within 0.2% of 1 from step 300); `mindspore.experimental.optim.AdamW` is exact
but slower here (docs/training.md, "Optimizer note"). This module keeps the fused kernel and folds
the bias correction into the three scalars the kernel takes, for each step t:

    torch:  p <- p - lr*wd*p - lr * (m / c1) / (sqrt(v / c2) + eps),   c1 = 1-b1^t, c2 = 1-b2^t
    kernel: p <- p - lr_t * (m / (sqrt(v) + eps_t) + wd_t * p)
    with    lr_t = lr * sqrt(c2) / c1,  eps_t = eps * sqrt(c2),  wd_t = lr * wd / lr_t

which is the same update, algebraically exact (tests/clipms/train/test_optim.py checks it against a
numpy AdamW). `Schedule` computes the learning rate and these scalars inside the compiled step from
the step counters, so the host never feeds (or waits for) them; `clipms.train.schedule` has the
same formulas on the host (`cosine_lr`, `folded_hyper`: for logs, tests and the reference).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from clipms.train.schedule import BETAS, EPS, WEIGHT_DECAY

# open_clip's rule (open_clip_train/main.py, `exclude`): no weight decay for tensors with fewer than
# 2 dimensions (gains, biases, the class embedding, logit_scale) or whose name says norm, bias or
# logit_scale; every other tensor is decayed, the token and positional embedding tables included.
_NO_DECAY_NAMES = ("bn", "ln", "bias", "logit_scale")


def is_decayed(name: str, ndim: int, decay_embeddings: bool = True) -> bool:
    """True for parameters that get weight decay, by open_clip's rule.

    `decay_embeddings=False` also spares the 2-D embedding tables (token and positional), the
    common choice outside open_clip (`train.decay_embeddings`).
    """
    if ndim < 2 or any(part in name for part in _NO_DECAY_NAMES):
        return False
    return decay_embeddings or "embedding" not in name


def split_decay(named_shapes: Iterable[tuple[str, Sequence[int]]],
                decay_embeddings: bool = True) -> tuple[list[str], list[str]]:
    """(decayed names, not-decayed names) for (name, shape) pairs."""
    decay, no_decay = [], []
    for name, shape in named_shapes:
        (decay if is_decayed(name, len(shape), decay_embeddings) else no_decay).append(name)
    return decay, no_decay


class Schedule(nn.Cell):
    """`construct(step, t) -> (lr_t, eps_t, wd_t)`: `cosine_lr(step)` folded with AdamW's bias
    correction for update t (`folded_hyper`), in fp32, inside the graph. `step` (0-based optimizer
    step) and `t` (1-based AdamW update) are int32 scalar tensors."""

    def __init__(self, base_lr: float, warmup_steps: int, total_steps: int,
                 betas: tuple[float, float] = BETAS, eps: float = EPS,
                 weight_decay: float = WEIGHT_DECAY) -> None:
        super().__init__()
        self.base_lr, self.warmup = float(base_lr), int(warmup_steps)
        self.decay_steps = int(total_steps) - int(warmup_steps)
        self.beta1 = ms.Tensor(np.float32(betas[0]))
        self.beta2 = ms.Tensor(np.float32(betas[1]))
        self.eps, self.weight_decay = float(eps), float(weight_decay)

    def learning_rate(self, step: ms.Tensor) -> ms.Tensor:
        s = ops.cast(step, ms.float32)
        if self.decay_steps <= 0:
            after = ops.fill(ms.float32, (), self.base_lr)
        else:
            progress = ops.minimum(s - self.warmup, float(self.decay_steps)) / self.decay_steps
            after = 0.5 * (1.0 + ops.cos(np.pi * progress)) * self.base_lr
        if self.warmup <= 0:
            return after
        return ops.select(s < self.warmup, self.base_lr * (s + 1.0) / self.warmup, after)

    def construct(self, step, t):  # noqa: ANN001, ANN201
        lr = self.learning_rate(step)
        t = ops.cast(t, ms.float32)
        c1 = 1.0 - ops.pow(self.beta1, t)
        root_c2 = ops.sqrt(1.0 - ops.pow(self.beta2, t))
        wd_t = ops.select(lr > 0.0, self.weight_decay * c1 / root_c2, ops.zeros_like(lr))
        return lr * root_c2 / c1, self.eps * root_c2, wd_t


def build_adamw(named_params: Sequence[tuple[str, ms.Parameter]],
                betas: tuple[float, float] = BETAS, decay_embeddings: bool = True) -> AdamW:
    """AdamW over (name, Parameter) pairs, decay flags from the names (relative to the model, since
    MindSpore prefixes Parameter.name once a Cell is wrapped) and shapes."""
    flags = [is_decayed(name, len(p.shape), decay_embeddings) for name, p in named_params]
    return AdamW([p for _, p in named_params], flags, betas)


_update = ops.MultitypeFuncGraph("clipms_adamw_update")


@_update.register("Function", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                  "Tensor", "Tensor", "Bool")
def _update_one(kernel, beta1, beta2, lr, eps, decay, param, m, v, grad, decayed):  # noqa: ANN001, ANN202
    weight_decay = decay if decayed else ops.zeros_like(decay)
    kernel(param, m, v, lr, beta1, beta2, eps, weight_decay, ops.cast(grad, param.dtype))
    return True


class AdamW(nn.Cell):
    """Torch-equivalent AdamW on the fused `AdamWeightDecay` kernel (host-folded bias correction).

    `construct(grads, lr, eps, weight_decay)` takes the three scalars from `folded_hyper`; moments
    are Parameters named `adam_m.<param>` / `adam_v.<param>` so they checkpoint by name.
    """

    def __init__(self, params: list[ms.Parameter], decay_flags: Sequence[bool],
                 betas: tuple[float, float] = BETAS) -> None:
        super().__init__()
        if len(params) != len(decay_flags):
            raise ValueError(f"{len(params)} parameters but {len(decay_flags)} decay flags")
        self.params = ms.ParameterTuple(params)
        self.exp_avg = self.params.clone(prefix="adam_m", init="zeros")
        self.exp_avg_sq = self.params.clone(prefix="adam_v", init="zeros")
        self.decay_flags = tuple(bool(f) for f in decay_flags)
        self.beta1 = ms.Tensor(np.array(betas[0], np.float32))
        self.beta2 = ms.Tensor(np.array(betas[1], np.float32))
        self.kernel = ops.AdamWeightDecay()
        self.hyper_map = ops.HyperMap()

    def construct(self, grads, lr, eps, weight_decay):  # noqa: ANN001, ANN201
        return self.hyper_map(
            ops.partial(_update, self.kernel, self.beta1, self.beta2, lr, eps, weight_decay),
            self.params, self.exp_avg, self.exp_avg_sq, grads, self.decay_flags)

    def state_parameters(self) -> list[ms.Parameter]:
        """The optimizer state to checkpoint (both moments of every parameter)."""
        return [*self.exp_avg, *self.exp_avg_sq]


def clip_by_global_norm(grads: tuple, max_norm: float) -> tuple[tuple, ms.Tensor]:
    """Scale all gradients by min(1, max_norm / global_norm), as torch's clip_grad_norm_.

    Returns (clipped grads, the global norm before clipping). Graph-mode safe.
    """
    norm = global_norm(grads)
    factor = ops.minimum(max_norm / (norm + 1.0e-6), 1.0)
    return tuple(g * ops.cast(factor, g.dtype) for g in grads), norm


def global_norm(grads: tuple) -> ms.Tensor:
    """sqrt of the sum of squares of all gradients, in fp32. Graph-mode safe."""
    squares = [ops.reduce_sum(ops.square(ops.cast(g, ms.float32))) for g in grads]
    return ops.sqrt(ops.addn(squares))
