"""Where training batches come from: the `BatchSource` contract, random batches (tests and
benchmarks) and the webdataset shards. Images travel as uint8 pixels (N, 3, S, S); the train step
normalises them on the device (`clipms.train.step.PixelNormalize`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from clipms.model.config import CLIPConfig


class BatchSource(Protocol):
    """Deterministic batches. `stream(start, stop)` yields this rank's batches of global batch
    indices start..stop-1 (batch i is in epoch i // batches_per_epoch), identical for identical
    (seed, i) whatever `start` is -- what makes a resumed run exact. Images are uint8 pixels (or
    float32 already normalised), tokens int32."""

    batches_per_epoch: int

    def stream(self, start: int, stop: int) -> Iterable[tuple[np.ndarray, np.ndarray]]: ...


class RandomBatches:
    """Random pixels and token rows, a pure function of (seed, epoch, batch index): for benchmarks
    and tests. Tokens end in the highest id (EOT) like real captions."""

    def __init__(self, cfg: CLIPConfig, batch_size: int, batches_per_epoch: int, seed: int = 0,
                 rank: int = 0, group_size: int = 1) -> None:
        self.cfg, self.batch_size, self.batches_per_epoch = cfg, batch_size, batches_per_epoch
        self.seed, self.rank, self.group_size = seed, rank, group_size

    def global_batch(self, epoch: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch, index])
        n, v, t = self.batch_size * self.group_size, self.cfg.vision, self.cfg.text
        images = rng.integers(0, 256, (n, 3, v.image_size, v.image_size), dtype=np.uint8)
        tokens = rng.integers(1, t.vocab_size - 1, (n, t.context_length), dtype=np.int32)
        lengths = rng.integers(2, t.context_length + 1, n)
        for row, length in zip(tokens, lengths, strict=True):
            row[length - 1] = t.vocab_size - 1
            row[length:] = 0
        return images, tokens

    def stream(self, start: int, stop: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        for index in range(start, stop):
            images, tokens = self.global_batch(*divmod(index, self.batches_per_epoch))
            yield images[lo:hi], tokens[lo:hi]


class ShardBatches:
    """The webdataset shards through `clipms.data.dataset.build_train_dataset` as a BatchSource."""

    def __init__(self, shards_dir: Path | str, tokenizer: Any, preprocess: Any, batch_size: int,
                 seed: int = 0, rank: int = 0, group_size: int = 1, workers: int = 2,
                 augment: bool = False, decode: str = "pil",
                 group_by: Sequence[str] | None = None, group_fraction: float = 0.0) -> None:
        from clipms.data import dataset as shard_dataset

        self.shards_dir, self.tokenizer, self.preprocess = shards_dir, tokenizer, preprocess
        self.batch_size, self.seed, self.rank, self.group_size = batch_size, seed, rank, group_size
        self.workers, self.augment, self.decode = workers, augment, decode
        self.group_by, self.group_fraction = group_by, group_fraction
        self.batches_per_epoch = shard_dataset.steps_per_epoch(shards_dir, batch_size, group_size)

    def stream(self, start: int, stop: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        from clipms.data import dataset as shard_dataset

        if start >= stop:
            return
        dataset = shard_dataset.build_train_dataset(
            self.shards_dir, self.tokenizer, self.preprocess, self.batch_size,
            epochs=-(-stop // self.batches_per_epoch), start_step=start, seed=self.seed,
            rank=self.rank, world_size=self.group_size, workers=self.workers,
            augment=self.augment, decode=self.decode, group_by=self.group_by,
            group_fraction=self.group_fraction)
        batches = dataset.create_tuple_iterator(num_epochs=1, output_numpy=True)
        for _, (images, tokens) in zip(range(stop - start), batches, strict=False):
            yield images, tokens


# ---- how batches reach the compiled step ----------------------------------------------------


class HostFeed:
    """Each micro-batch copied from the host when its step is launched (CPU, where MindSpore
    sinks no data; and wherever `clipms.runtime`'s `data_sink` is off)."""

    def __init__(self, step: Any, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> None:
        import mindspore as ms

        self.step, self.batches, self.to_tensor = step, batches, ms.Tensor

    def __call__(self, apply: bool) -> Any:
        images, tokens = next(self.batches)
        return self.step(self.to_tensor(images), self.to_tensor(tokens), apply)


class _Stream:
    """`source.stream(start, stop)` as a sized iterable, the form `GeneratorDataset` accepts
    without reading it through to count its rows."""

    def __init__(self, source: BatchSource, start: int, stop: int) -> None:
        self.source, self.start, self.stop = source, start, stop

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return iter(self.source.stream(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def sink_dataset(source: BatchSource, start: int, stop: int) -> Any:
    """Batches start..stop-1 of `source`, in order and unchanged, as a MindSpore dataset (what
    `mindspore.data_sink` sends to the device queue)."""
    from mindspore import dataset as ds

    return ds.GeneratorDataset(_Stream(source, start, stop), ["images", "tokens"], shuffle=False)


class SinkFeed:
    """Micro-batches through MindSpore's device-side data queue (`mindspore.data_sink`, Ascend
    and GPU only): the dataset engine sends them ahead while steps run, so launching a step copies
    nothing. The wrapped function runs eagerly (no jit_config), so `apply` is read at every call
    and accumulation works as with `HostFeed`; the step itself stays the compiled Cell."""

    def __init__(self, step: Any, source: BatchSource, start: int, stop: int) -> None:
        import mindspore as ms

        self.step, self.apply = step, True
        self.sink = ms.data_sink(self._run, sink_dataset(source, start, stop), sink_size=1)

    def _run(self, images: Any, tokens: Any) -> Any:
        return self.step(images, tokens, self.apply)

    def __call__(self, apply: bool) -> Any:
        self.apply = apply
        return self.sink()
