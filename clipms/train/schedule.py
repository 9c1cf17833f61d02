"""The learning-rate schedule and AdamW's folded bias correction as plain Python: the host's
copy of what `clipms.train.optim.Schedule` computes inside the compiled step (for the per-step log,
the tests and a reference step). No MindSpore here, so the training loop may import it up front.
"""

# tested by: tests/clipms/train/test_loop.py

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# open_clip's defaults for CLIP training (open_clip/src/open_clip_train/params.py for ViT models).
BETAS = (0.9, 0.98)
EPS = 1.0e-6
WEIGHT_DECAY = 0.2


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
