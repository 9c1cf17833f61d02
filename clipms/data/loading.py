"""`LoaderSettings`: how one rank's training loader draws and decodes its batches, built once where
the run's settings are read (`clipms.train.recipe.TrainSettings.loader`) and handed down whole:
`clipms.train.feed.ShardBatches` -> `clipms.data.dataset.build_train_dataset` -> `TrainSamples`
-> `clipms.data.sampling.BatchOrder`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from clipms.data.decode import DECODERS
from clipms.data.webds import DataError

Decode = Literal["pil", "cpu", "ascend"]


@dataclass(frozen=True)
class LoaderSettings:
    """The training loader's settings; the batch size and the steps to yield are per call.

    seed: the data order (seeded per epoch), the caption drawn per sample and epoch, and the
        augmentation's crop.
    rank: this process's index among the data-parallel ranks, 0 .. world_size - 1: which
        contiguous share of each global batch it takes.
    world_size: the number of data-parallel ranks (MindSpore's communication group size); a global
        batch is batch_size * world_size samples.
    workers: decode processes ("pil") or dataset threads ("cpu"/"ascend") of this rank, already
        resolved (`clipms.train.feed.rank_loader_workers`); 0 or 1 decode in this process. Never
        changes which samples a batch holds.
    augment: open_clip's training crop (RandomResizedCrop) instead of the evaluation transform;
        "pil" decoding only.
    decode: where images decode, one of `clipms.data.decode.DECODERS`.
    shuffle_window_shards: shards shuffled together each epoch (0: the whole split).
    group_by: label fields the hard-negative batches share (None: no grouping).
    group_fraction: the share of each epoch's global batches grouped by `group_by`.
    """

    seed: int = 0
    rank: int = 0
    world_size: int = 1
    workers: int = 2
    augment: bool = False
    decode: Decode = "pil"
    shuffle_window_shards: int = 0
    group_by: tuple[str, ...] | None = None
    group_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.group_by is not None:  # a list from a caller: frozen, hashable
            object.__setattr__(self, "group_by", tuple(self.group_by))
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise DataError(f"rank {self.rank} out of range for world size {self.world_size}")
        if self.workers < 0 or self.shuffle_window_shards < 0:
            raise DataError(f"workers {self.workers} and shuffle_window_shards "
                            f"{self.shuffle_window_shards} must be >= 0")
        if self.decode not in DECODERS:
            raise DataError(f"decode = {self.decode!r}: expected one of {DECODERS}")
        if self.decode != "pil" and self.augment:
            raise DataError(f"decode = {self.decode!r} does not augment: use decode 'pil' with "
                            "augment")


DEFAULT_LOADER = LoaderSettings()  # one rank, two decode workers, "pil", no grouping
