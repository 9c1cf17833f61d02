"""Which samples each training step holds: the epoch order, the per-sample random streams and the
split of every global batch into the ranks' shares (clipms.data.dataset decodes what this picks).

Everything here is a pure function of (seed, epoch, step, the split's layout): no file is read,
so any rank, worker process or resumed run computes the same batches.

- `epoch_order(layout, seed, epoch, window_shards)`: the sample ids of one epoch, shards permuted,
  then samples permuted within windows of `window_shards` consecutive shards (0 = all shards: a
  uniform permutation of the split), seeded by (seed, epoch).
- `sample_rng(seed, epoch, key)`: a sample's own generator (caption draw, augmentation).
- `BatchOrder.sample_ids(step)`: global batch g of an epoch is positions [g*B*W, (g+1)*B*W) of the
  epoch's order; rank r gets the contiguous block [r*B, (r+1)*B) of it. Ranks are disjoint and
  together cover exactly what one process with batch B*W would see, in the same order.
- Hard-negative batches (`group_fraction` > 0 with per-sample `groups`, e.g. the colour label's
  value): that share of each epoch's global batches, at positions drawn per (seed, epoch), each
  holds B*W samples of one group, so the grouped field cannot tell its captions apart and the
  other attributes must. The group's samples come in the epoch order's sequence, and which
  group fills a batch is drawn in proportion to the group's size; the other batches take the
  remaining samples, shuffled again. No sample is seen twice in an epoch. Ranks
  still take their blocks of each global batch, so every rank's share of a grouped batch is of
  the same group.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from clipms.data.loading import LoaderSettings

_GROUPING_STREAM = 1  # the grouping's draws: a stream apart from the epoch order's [seed, epoch]


class SplitLayout(Protocol):
    """What the order needs of a split (clipms.data.dataset.ShardIndex is one): its shards and where
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


class SamplingError(ValueError):
    """A grouping the split's labels cannot provide (clipms.data.dataset raises it as a DataError)."""


def group_ids(labels: Sequence[dict[str, Any] | None], keys: Sequence[str],
              fields: Sequence[str]) -> np.ndarray:
    """Per sample, the index of its `fields` values (sorted) among the split's distinct ones; a
    SamplingError naming the first sample without them and the fields the labels do have."""
    values: list[tuple[str, ...]] = []
    for label, key in zip(labels, keys, strict=True):
        missing = [f for f in fields if not isinstance(label, dict) or f not in label]
        if missing:
            present = sorted({f for item in labels if isinstance(item, dict) for f in item})
            have = (f"label fields {present}" if present
                    else "no labels (real data such as mscoco has none)")
            raise SamplingError(
                f"train.group_by {list(fields)}: sample {key!r} has no label {missing[0]!r}; the "
                f"split's samples have {have}: group by those, or set train.group_by to null")
        values.append(tuple(str(label[f]) for f in fields))  # type: ignore[index]
    distinct = {v: i for i, v in enumerate(sorted(set(values)))}
    return np.array([distinct[v] for v in values], dtype=np.int64)


def grouped_batches(steps: int, fraction: float) -> int:
    """Grouped global batches per epoch: `fraction` of the epoch's, rounded half up."""
    return math.floor(fraction * steps + 0.5)


def group_capacity(groups: np.ndarray, global_batch: int) -> int:
    """How many one-group global batches the groups can fill in one epoch."""
    return int(sum(n // global_batch for n in np.bincount(groups)))


def grouped_order(base: np.ndarray, groups: np.ndarray, global_batch: int, grouped: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """`base` (an epoch order) rearranged into len(base) // global_batch global batches, of
    which `grouped` (at the positions returned, drawn by `rng`) each hold one group's samples.
    The others are drawn at random from the rest (one group only by chance)."""
    steps = len(base) // global_batch
    in_group = groups[base]
    # Every full block of global_batch consecutive samples of one group (in base's sequence).
    chunks = [block for g in np.unique(in_group)
              for block in _blocks(base[in_group == g], global_batch)]
    if grouped > len(chunks) or grouped > steps:
        raise SamplingError(f"{grouped} grouped batches asked, the groups fill {len(chunks)}")
    chosen = [chunks[i] for i in rng.choice(len(chunks), size=grouped, replace=False)]
    used = np.zeros(len(groups), dtype=bool)
    for chunk in chosen:
        used[chunk] = True
    # Shuffled again: in base's sequence the rest clusters (an unchosen block sits where the other
    # groups' samples were taken), which would make the mixed batches one-group too.
    rest = _blocks(rng.permutation(base[~used[base]]), global_batch)
    slots = sorted(rng.choice(steps, size=grouped, replace=False).tolist())
    picked, mixed = iter(chosen), iter(rest)
    batches = [next(picked) if step in slots else next(mixed) for step in range(steps)]
    return np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64), slots


def _blocks(ids: np.ndarray, size: int) -> list[np.ndarray]:
    return [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)]


class BatchOrder:
    """The sample ids of one rank's batch at each global step (see the module docstring)."""

    def __init__(self, index: SplitLayout, batch_size: int, loader: LoaderSettings,
                 groups: np.ndarray | None = None) -> None:
        """`loader` gives the seed, this rank and the world size, the shuffle window and the
        grouped share; `groups` each sample's group (`group_ids`), None: no grouping."""
        self.index, self.batch_size, self.seed = index, batch_size, loader.seed
        self.rank, self.world_size = loader.rank, loader.world_size
        self.window = loader.shuffle_window_shards
        self.steps_per_epoch = len(index) // (batch_size * self.world_size)
        group_fraction = loader.group_fraction
        if not 0.0 <= group_fraction <= 1.0:
            raise SamplingError(f"train.group_fraction {group_fraction}: expected 0 to 1")
        self.groups = groups
        self.grouped = 0 if groups is None else grouped_batches(self.steps_per_epoch,
                                                                group_fraction)
        if groups is not None and self.grouped:
            self._check_capacity(groups, group_fraction)
        self._cached: tuple[int, np.ndarray, list[int]] = (-1, np.zeros(0, dtype=np.int64), [])

    def _check_capacity(self, groups: np.ndarray, fraction: float) -> None:
        global_batch = self.batch_size * self.world_size
        capacity = group_capacity(groups, global_batch)
        if self.grouped > capacity:
            raise SamplingError(
                f"train.group_fraction {fraction}: {self.grouped} of the epoch's "
                f"{self.steps_per_epoch} global batches of {global_batch} would be grouped, but "
                f"the {int(groups.max()) + 1} groups fill only {capacity} (a fraction of at most "
                f"{capacity / self.steps_per_epoch:.3f})")

    def order(self, epoch: int) -> np.ndarray:
        """This epoch's sample order, computed once per process and epoch."""
        return self._epoch(epoch)[1]

    def grouped_steps(self, epoch: int) -> list[int]:
        """The in-epoch indices of this epoch's grouped global batches (sorted)."""
        return self._epoch(epoch)[2]

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray, list[int]]:
        if self._cached[0] != epoch:
            base, slots = epoch_order(self.index, self.seed, epoch, self.window), []
            if self.groups is not None and self.grouped:
                rng = np.random.default_rng([self.seed, epoch, _GROUPING_STREAM])
                base, slots = grouped_order(base, self.groups, self.batch_size * self.world_size,
                                            self.grouped, rng)
            self._cached = (epoch, base, slots)
        return self._cached

    def sample_ids(self, step: int) -> np.ndarray:
        """Indices (into the split) of this rank's batch at global step `step`."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        start = (in_epoch * self.world_size + self.rank) * self.batch_size
        return self.order(epoch)[start:start + self.batch_size]
