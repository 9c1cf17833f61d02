"""AdamW as open_clip trains CLIP, the warmup + cosine schedule, and which parameters are decayed.

Why a small AdamW of our own: MindSpore's `nn.AdamWeightDecay` runs a fast fused CPU/Ascend kernel
but has no bias correction, so each step differs from torch's AdamW (and from the open_clip
recipes tuned for it) by the factor c1 / sqrt(c2) below (CLIP's betas 0.9/0.98: 0.71 at step 1,
1.07 at step 100, within 0.2% of 1 from step 300); `mindspore.experimental.optim.AdamW` is exact
but slower here
(docs/training.md, "Optimizer note"). This module keeps the fused kernel and folds the bias
correction into the three scalars the kernel takes, computed on the host for each step t:

    torch:  p <- p - lr*wd*p - lr * (m / c1) / (sqrt(v / c2) + eps),   c1 = 1-b1^t, c2 = 1-b2^t
    kernel: p <- p - lr_t * (m / (sqrt(v) + eps_t) + wd_t * p)
    with    lr_t = lr * sqrt(c2) / c1,  eps_t = eps * sqrt(c2),  wd_t = lr * wd / lr_t

which is the same update, algebraically exact (tests/test_optim.py checks it against a numpy AdamW).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import nn, ops

# open_clip's defaults for CLIP training (open_clip/src/open_clip_train/params.py for ViT models).
BETAS = (0.9, 0.98)
EPS = 1.0e-6
WEIGHT_DECAY = 0.2

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


def cosine_lr(step: int, base_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based), as open_clip's `cosine_lr`.

    Linear warmup from base_lr/warmup to base_lr over `warmup_steps`, then half a cosine down to 0
    at `total_steps`.
    """
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0:
        return base_lr
    progress = min(step - warmup_steps, decay_steps) / decay_steps
    return 0.5 * (1.0 + math.cos(math.pi * progress)) * base_lr


@dataclass(frozen=True)
class AdamWHyper:
    """The per-step scalars fed to the fused kernel (bias correction folded in)."""

    lr: float
    eps: float
    weight_decay: float

    def tensors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.array(self.lr, np.float32), np.array(self.eps, np.float32),
                np.array(self.weight_decay, np.float32))


def folded_hyper(lr: float, t: int, betas: tuple[float, float] = BETAS, eps: float = EPS,
                 weight_decay: float = WEIGHT_DECAY) -> AdamWHyper:
    """Kernel scalars for AdamW step t (1-based) at learning rate `lr`; see the module docstring."""
    if t < 1:
        raise ValueError(f"AdamW step t must be >= 1, got {t}")
    c1 = 1.0 - betas[0] ** t
    root_c2 = math.sqrt(1.0 - betas[1] ** t)
    lr_t = lr * root_c2 / c1
    wd_t = weight_decay * c1 / root_c2 if lr > 0 else 0.0
    return AdamWHyper(lr=lr_t, eps=eps * root_c2, weight_decay=wd_t)


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
