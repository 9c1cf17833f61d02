"""Where training batches come from: the `BatchSource` contract, random batches (tests and
benchmarks) and the webdataset shards. Images travel as uint8 pixels (N, 3, S, S); the train step
normalises them on the device (`clipms.train.step.PixelNormalize`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from clipms.data.loading import DEFAULT_LOADER, LoaderSettings
from clipms.model.architecture import CLIPConfig


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
                 rank: int = 0, world_size: int = 1) -> None:
        self.cfg, self.batch_size, self.batches_per_epoch = cfg, batch_size, batches_per_epoch
        self.seed, self.rank, self.world_size = seed, rank, world_size

    def global_batch(self, epoch: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch, index])
        n, v, t = self.batch_size * self.world_size, self.cfg.vision, self.cfg.text
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
    """The webdataset shards through `clipms.data.dataset.build_train_dataset` as a BatchSource,
    drawn and decoded as `loader` says (this rank's `clipms.data.loading.LoaderSettings`)."""

    def __init__(self, shards_dir: Path | str, tokenizer: Any, preprocess: Any, batch_size: int,
                 loader: LoaderSettings = DEFAULT_LOADER) -> None:
        from clipms.data import dataset as shard_dataset

        self.shards_dir, self.tokenizer, self.preprocess = shards_dir, tokenizer, preprocess
        self.batch_size, self.loader = batch_size, loader
        self.batches_per_epoch = shard_dataset.steps_per_epoch(shards_dir, batch_size,
                                                               loader.world_size)

    @property
    def workers(self) -> int:
        """This rank's decode workers (the loop's loader report names them)."""
        return self.loader.workers

    def dataset(self, start: int, stop: int) -> Any:
        """Batches start..stop-1 as the MindSpore pipeline itself (what a sunk run sends to the
        device): built once, ending after batch stop-1."""
        from clipms.data import dataset as shard_dataset

        return shard_dataset.build_train_dataset(
            self.shards_dir, self.tokenizer, self.preprocess, self.batch_size, self.loader,
            epochs=-(-stop // self.batches_per_epoch), start_step=start, stop_step=stop)

    def stream(self, start: int, stop: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if start >= stop:
            return
        batches = self.dataset(start, stop).create_tuple_iterator(num_epochs=1, output_numpy=True)
        try:
            yield from batches
        finally:  # the decode processes end with the stream, not when the iterator is collected
            batches.stop()


def rank_loader_workers(setting: int | str, local_ranks: int = 1, launcher_cores: int = 0,
                        own_cores: int | None = None) -> int:
    """`train.workers` for this rank, decided in the rank's own process: an int as given; "auto"
    from the cores this process may run on (`own_cores`, default its affinity). A rank bound to
    cores of its own (msrun's --bind_core, a cpuset per rank: fewer cores than the launcher had,
    `launcher_cores`) decodes on all of them; an unbound rank shares them with the host's other
    `local_ranks` - 1 ranks. `launcher_cores` 0: unknown, taken as unbound."""
    from clipms.data.decode import loader_workers, usable_cores

    if setting != "auto":
        return loader_workers(setting)
    own = usable_cores() if own_cores is None else own_cores
    bound = 0 < own < launcher_cores
    return loader_workers("auto", 1 if bound else local_ranks, own)


@dataclass
class LoaderClock:
    """The samples a feed handed to the step and the seconds the training process waited for
    them (what tells a loader-bound device: `clipms.train.loop`)."""

    samples: int = 0
    waited: float = 0.0

    def timed(self, fetch: Any) -> tuple[Any, Any]:
        started = time.perf_counter()
        images, tokens = fetch()
        self.waited += time.perf_counter() - started
        self.samples += int(images.shape[0])
        return images, tokens


# ---- how batches reach the compiled step ----------------------------------------------------


class HostFeed:
    """Each micro-batch copied from the host when its step is launched (CPU, and wherever the
    runtime's `data_sink` is off)."""

    def __init__(self, step: Any, source: BatchSource, start: int, stop: int) -> None:
        import mindspore as ms

        self.step, self.to_tensor = step, ms.Tensor
        self.batches = iter(source.stream(start, stop))
        self.clock = LoaderClock()

    def batch(self) -> tuple[Any, Any]:
        """The next micro-batch as tensors (the step is called by whoever takes it)."""
        images, tokens = self.clock.timed(lambda: next(self.batches))
        return self.to_tensor(images), self.to_tensor(tokens)

    def __call__(self, *args: Any) -> Any:
        """The step on the next micro-batch (`args` after the batch: the step's own)."""
        return self.step(*self.batch(), *args)

    def close(self) -> None:
        """End the stream (and the loader processes behind it)."""
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()


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
    """Batches start..stop-1 of `source`, in order and unchanged, as one MindSpore dataset: the
    source's own pipeline when it has one (`ShardBatches.dataset`), else its stream wrapped once
    (`RandomBatches`, benchmark sources)."""
    own = getattr(source, "dataset", None)
    if own is not None:
        return own(start, stop)
    from mindspore import dataset as ds

    return ds.GeneratorDataset(_Stream(source, start, stop), ["images", "tokens"], shuffle=False)


@dataclass(frozen=True)
class BatchSignature:
    """The dtypes and shapes of one micro-batch: what the device queue and `GetNext` are built
    for (known from the config, so the pipeline is never run just to read them)."""

    batch_size: int
    image_size: int
    context_length: int

    def types(self) -> list[Any]:
        import mindspore as ms

        return [ms.uint8, ms.int32]

    def shapes(self) -> list[tuple[int, ...]]:
        b, s = self.batch_size, self.image_size
        return [(b, 3, s, s), (b, self.context_length)]


class DeviceQueue:
    """One pass of a dataset through MindSpore's device-side data queue.

    MindSpore's own sequence (`mindspore.data_sink` -> `_init_sink_dataset`, mindspore/train of
    2.10): the dataset becomes a `TransferDataset` (`device_que`) whose engine sends batches to a
    queue on the device while steps run, and a `GetNext` op takes one there. Three changes, each
    because `mindspore.data_sink` would do otherwise:
    - the dtypes and shapes come from `BatchSignature`: data_sink reads them by running the
      pipeline for one row first (`output_types`/`output_shapes`), i.e. building it twice;
    - the batches are sent once (`send(1)`): data_sink sends with -1, epochs without end, so the
      pipeline would go on decoding after the last step;
    - `close()` stops the sending and releases the queue at the end of training (data_sink leaves
      that to garbage collection).
    `_attach` (registering the queue, creating `GetNext`) has no CPU kernel in MindSpore: it runs
    on Ascend and GPU only.
    """

    def __init__(self, dataset: Any, signature: BatchSignature) -> None:
        self.signature = signature
        self.transfer = dataset.device_que(send_epoch_end=False, create_data_info_queue=False)
        self.get_next = self._attach()
        self.transfer.send(1)

    def _attach(self) -> Any:
        from mindspore import ops
        from mindspore.graph.api import _cell_graph_executor

        types, shapes = self.signature.types(), self.signature.shapes()
        _cell_graph_executor.init_dataset(self.transfer.queue_name, 1,
                                          self.signature.batch_size, types, shapes, [],
                                          phase="dataset")
        return ops.GetNext(types, shapes, len(types), self.transfer.queue_name)

    def __call__(self) -> tuple[Any, Any]:
        images, tokens = self.get_next()
        return images, tokens

    def close(self) -> None:
        """Stop sending and release the queue (idempotent)."""
        if self.transfer is not None:
            self.transfer.stop_send()
            self.transfer.release()
            self.transfer = None


class SinkFeed:
    """Micro-batches through MindSpore's device queue (`DeviceQueue`; runtime `data_sink`, Ascend
    and GPU): the dataset engine sends them ahead while steps run, so launching a step copies
    nothing. The step stays the compiled Cell; with accumulation the loop takes the
    micro-batches (`batch`) and hands them to the step, as with `HostFeed`. The queue is released
    after the last micro-batch it holds, or by `close()` when training stops early."""

    def __init__(self, step: Any, source: BatchSource, start: int, stop: int,
                 signature: BatchSignature) -> None:
        self.step, self.left = step, stop - start
        self.queue = DeviceQueue(sink_dataset(source, start, stop), signature)
        self.clock = LoaderClock()

    def batch(self) -> tuple[Any, Any]:
        """The next micro-batch, already on the device."""
        if self.left <= 0:
            raise RuntimeError("the sunk dataset holds no further batch")
        images, tokens = self.clock.timed(self.queue)
        self.left -= 1
        if self.left == 0:
            self.close()  # the last batch is on the device: nothing more to send
        return images, tokens

    def __call__(self, *args: Any) -> Any:
        """The step on the next micro-batch (`args` after the batch: the step's own)."""
        return self.step(*self.batch(), *args)

    def close(self) -> None:
        self.queue.close()
