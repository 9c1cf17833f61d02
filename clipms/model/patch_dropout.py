"""Patch dropout (FLIP, Li et al. 2023; open_clip's `PatchDropout`): in a training forward, keep a
random subset of each image's patch tokens, always with its class token; evaluation and export
never drop. The image tower then runs on fewer tokens, which is where its cost goes.

The choice is open_clip's: a score per patch, the `max(1, int(P * (1 - p)))` highest kept in
descending score order (`topk`), after the positional embedding and before `ln_pre`. open_clip
scores with `torch.randn`, a stateful generator; here the scores come from a counter-based hash, a
pure function of (seed, draw, sample, patch):

- `draw` counts the training forwards of this model (a Parameter, so checkpoints hold it and a
  resumed run continues the exact sequence of draws: bitwise resume); every forward, hence every
  micro-batch and step, draws afresh;
- `sample` is the sample's index in the global batch (`first_sample` + row), so each rank of a
  data-parallel run draws for its own samples exactly what one process of the whole batch would;
- any continuous i.i.d. scores select a uniformly random subset, as randn's do; fed the same
  scores, `drop_patches` equals open_clip's PatchDropout (tests/clipms/model/test_patch_dropout.py).

The counter Parameter exists only once `start_drawing` is called (by the trainer), so a model
built for evaluation, export or conversion has exactly its weights. MindSpore runs a forward that
`GradOperation` also differentiates once per step, so the loss and the gradient see the same
draw and the counter advances by one per forward (tested).

The hash is Chris Wellons' `lowbias32` on int32 (multiplications wrap as uint32's do; logical
shifts are arithmetic shifts masked), so it compiles to plain integer kernels on every backend;
`reference_scores` is the same function in numpy.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

_MUL_1 = 0x7FEB352D
_MUL_2 = 0x846CA68B - (1 << 32)  # the uint32 constant as the int32 with its bits
_GOLDEN = 0x9E3779B9 - (1 << 32)  # odd: spreads consecutive counters over the 32 bits
_SEED_SALT = 0x5BD1E995


def kept_count(num_patches: int, prob: float) -> int:
    """Patches kept per image: open_clip's `max(1, int(num_patches * (1 - prob)))`."""
    return max(1, int(num_patches * (1 - prob)))


class PatchDropout(nn.Cell):
    """(N, 1 + P, D) tokens (class token first) -> (N, 1 + K, D) in training, unchanged otherwise
    and until `start_drawing` has given it a seed."""

    def __init__(self, prob: float, num_patches: int) -> None:
        super().__init__()
        if not 0 <= prob < 1:
            raise ValueError(f"patch dropout {prob!r} is not in [0, 1)")
        self.prob = prob
        self.num_patches = num_patches
        self.keep = kept_count(num_patches, prob)
        self.drawing = False
        self.seed_key = 0
        self.first_sample = 0
        self.topk = ops.TopK(sorted=True)
        self.right_shift = ops.RightShift()

    def start_drawing(self, seed: int, first_sample: int = 0, name: str = "draws") -> None:
        """Drop from now on in training forwards, with draws seeded by `seed`; this process's
        rows are samples `first_sample`.. of the global batch. Adds the draw counter, a
        Parameter called `name` (its path in the model: a Parameter added after the model was
        built keeps the name it is given)."""
        self.seed_key = int(reference_mix(seed ^ _SEED_SALT).view(np.int32))
        self.first_sample = int(first_sample)
        self.draws = Parameter(Tensor(np.int32(0)), name=name, requires_grad=False)
        self.drawing = True

    def construct(self, x: Tensor) -> Tensor:
        if not self.training or not self.drawing or self.prob == 0:
            return x
        scores = self._scores(x.shape[0])
        ops.assign_add(self.draws, ops.ones((), ms.int32))
        return drop_patches(x, scores, self.keep, self.topk)

    def _scores(self, n: int) -> Tensor:
        """(n, P) float32 scores of this draw: hash(seed, draw, sample, patch)."""
        key = self._mix(ops.fill(ms.int32, (1, 1), self.seed_key) + self.draws * _GOLDEN)
        cells = ops.arange(n * self.num_patches, dtype=ms.int32).reshape(n, self.num_patches)
        counters = cells + self.first_sample * self.num_patches
        hashed = self._mix(ops.bitwise_xor(counters * _GOLDEN, key))
        return ops.cast(self._shift(hashed, 8, 0xFFFFFF), ms.float32)  # 24 bits: exact floats

    def _shift(self, x: Tensor, bits: int, mask: int) -> Tensor:
        """x >>> bits on the uint32 pattern (an arithmetic shift, masked)."""
        return ops.bitwise_and(self.right_shift(x, Tensor(np.int32(bits))), mask)

    def _mix(self, x: Tensor) -> Tensor:
        x = ops.bitwise_xor(x, self._shift(x, 16, 0xFFFF))
        x = x * _MUL_1
        x = ops.bitwise_xor(x, self._shift(x, 15, 0x1FFFF))
        x = x * _MUL_2
        return ops.bitwise_xor(x, self._shift(x, 16, 0xFFFF))


def drop_patches(x: Tensor, scores: Tensor, keep: int, topk: ops.TopK | None = None) -> Tensor:
    """The class token and the `keep` patches of highest score, in descending score order:
    open_clip's `x[batch, rand.topk(keep).indices]` with `rand` = `scores`."""
    n, tokens, width = x.shape
    patches = tokens - 1
    _, order = (topk or ops.TopK(sorted=True))(scores, keep)  # (N, K)
    rows = ops.arange(n, dtype=ms.int32).reshape(n, 1) * patches
    flat = (order.astype(ms.int32) + rows).reshape(-1)  # (N*K,)
    kept = ops.gather(x[:, 1:].reshape(n * patches, width), flat, 0).reshape(n, keep, width)
    return ops.cat((x[:, :1], kept), axis=1)  # (N, 1 + K, D)


def start_patch_dropout(model: nn.Cell, seed: int, first_sample: int = 0) -> bool:
    """Seed every PatchDropout in `model` (the trainer, before compiling its step); True when the
    model has one."""
    found = [(name, cell) for name, cell in model.cells_and_names()
             if isinstance(cell, PatchDropout)]
    for name, cell in found:
        cell.start_drawing(seed, first_sample, f"{name}.draws" if name else "draws")
    return bool(found)


# ---- numpy: the same function, for tests and for feeding open_clip the same draw ----------------


def _u32(x: np.ndarray | int) -> np.ndarray:
    """Any integers as their uint32 bit patterns (two's complement, wrapped)."""
    return (np.asarray(x, np.int64) & 0xFFFFFFFF).astype(np.uint32)


def reference_mix(x: np.ndarray | int) -> np.ndarray:
    """`PatchDropout._mix` (lowbias32) in numpy, on uint32 bit patterns."""
    x = _u32(x)
    with np.errstate(over="ignore"):  # uint32 products wrap, as intended
        x ^= x >> np.uint32(16)
        x *= np.uint32(_MUL_1)
        x ^= x >> np.uint32(15)
        x *= _u32(_MUL_2)
        x ^= x >> np.uint32(16)
    return x


def reference_scores(seed: int, draw: int, first_sample: int, n: int,
                     num_patches: int) -> np.ndarray:
    """The (n, num_patches) scores of draw number `draw` (0-based) of a PatchDropout seeded with
    (`seed`, `first_sample`), in numpy."""
    golden = _u32(_GOLDEN)
    with np.errstate(over="ignore"):
        key = reference_mix(reference_mix(seed ^ _SEED_SALT) + _u32(draw) * golden)
        counters = _u32(np.arange(n * num_patches) + first_sample * num_patches)
        hashed = reference_mix((counters * golden) ^ key)
    return ((hashed >> np.uint32(8)) & np.uint32(0xFFFFFF)).astype(np.float32).reshape(
        n, num_patches)
