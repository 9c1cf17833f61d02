"""Which samples each training step holds: the epoch order, the per-sample random streams and the
split of every global batch into the ranks' shares (clipms.data decodes what this picks).

Everything here is a pure function of (seed, epoch, step, the split's layout): no file is read,
so any rank, worker process or resumed run computes the same batches.

- `epoch_order(layout, seed, epoch, window_shards)`: the sample ids of one epoch, shards permuted,
  then samples permuted within windows of `window_shards` consecutive shards (0 = all shards: a
  uniform permutation of the split), seeded by (seed, epoch).
- `sample_rng(seed, epoch, key)`: a sample's own generator (caption draw, augmentation).
- `BatchOrder.sample_ids(step)`: global batch g of an epoch is positions [g*B*W, (g+1)*B*W) of the
  epoch's order; rank r gets the contiguous block [r*B, (r+1)*B) of it. Ranks are disjoint and
  together cover exactly what one process with batch B*W would see, in the same order.
"""

from __future__ import annotations

import zlib
from typing import Protocol

import numpy as np


class SplitLayout(Protocol):
    """What the order needs of a split (clipms.data.ShardIndex is one): its shards and where
    each shard's samples start."""

    shards: list[str]
    shard_starts: list[int]

    def __len__(self) -> int: ...


def epoch_order(index: SplitLayout, seed: int, epoch: int, window_shards: int = 0) -> np.ndarray:
    """Sample ids of one epoch: shards permuted, then samples permuted within shard windows."""
    rng = np.random.default_rng([seed, epoch])
    bounds = [*index.shard_starts, len(index)]
    shard_order = rng.permutation(len(index.shards))
    window = window_shards if window_shards > 0 else len(index.shards)
    parts = []
    for start in range(0, len(shard_order), window):
        ids = np.concatenate([np.arange(bounds[s], bounds[s + 1])
                              for s in shard_order[start:start + window]])
        parts.append(rng.permutation(ids))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def sample_rng(seed: int, epoch: int, key: str) -> np.random.Generator:
    """Per-sample randomness (caption, augmentation): the same on every rank, worker, world size."""
    return np.random.default_rng([seed, epoch, zlib.crc32(key.encode())])


class BatchOrder:
    """The sample ids of one rank's batch at each global step (see the module docstring)."""

    def __init__(self, index: SplitLayout, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, window_shards: int = 0) -> None:
        self.index, self.batch_size, self.seed = index, batch_size, seed
        self.rank, self.world_size, self.window = rank, world_size, window_shards
        self.steps_per_epoch = len(index) // (batch_size * world_size)
        self._cached: tuple[int, np.ndarray] = (-1, np.zeros(0, dtype=np.int64))

    def order(self, epoch: int) -> np.ndarray:
        """This epoch's sample order, computed once per process and epoch."""
        if self._cached[0] != epoch:
            self._cached = (epoch, epoch_order(self.index, self.seed, epoch, self.window))
        return self._cached[1]

    def sample_ids(self, step: int) -> np.ndarray:
        """Indices (into the split) of this rank's batch at global step `step`."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        start = (in_epoch * self.world_size + self.rank) * self.batch_size
        return self.order(epoch)[start:start + self.batch_size]
