"""Data sinking (runtime `data_sink`, Ascend/GPU only) as far as it runs on CPU.

`clipms.train.feed.DeviceQueue` is MindSpore's data-sink sequence with three changes, all shown
here on the sending side: the training pipeline itself (not a second pipeline around it) goes to
MindSpore's dataset transfer once, built once, it stops at the run's last batch, and `close()`
releases the transfer -- MindSpore's engine accepts the transfer on CPU and sends into its CPU
data queue. What cannot run here is the device
end: registering the queue and `GetNext` have no CPU kernel in MindSpore 2.10 ("Unsupported op
[GetNext] on CPU"). Where a test needs batches out of the queue, `HostQueue` stands in for that
end only: it takes the same dataset's batches on the host, in order.
"""

from __future__ import annotations

import time

import mindspore as ms
import numpy as np
import pytest

from clipms.data import dataset as shard_dataset
from clipms.data.loading import LoaderSettings
from clipms.data.preprocess import PreprocessConfig
from clipms.text.clip_tokenizer import Tokenizer
from clipms.train import feed
from clipms.train.feed import BatchSignature, DeviceQueue, RandomBatches, ShardBatches, SinkFeed
from clipms.train.loop import Training, _loop
from clipms.train.recipe import TrainConfig
from harness.numbered_shards import write_shards
from harness.tiny_model import MICRO

BATCH, CTX = 4, 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("shards"), {"train": [13, 12], "val": [2]})


class Counted:
    """How often the training pipeline is built (and what was built) and how many samples it has
    decoded."""

    def __init__(self, monkeypatch) -> None:
        self.builds, self.samples, self.built = 0, 0, []
        build, getitem = shard_dataset.build_train_dataset, shard_dataset.TrainSamples.__getitem__

        def counted_build(*args, **kwargs):
            self.builds += 1
            self.built.append(build(*args, **kwargs))
            return self.built[-1]

        def counted_getitem(samples, index):
            self.samples += 1
            return getitem(samples, index)

        monkeypatch.setattr(shard_dataset, "build_train_dataset", counted_build)
        monkeypatch.setattr(shard_dataset.TrainSamples, "__getitem__", counted_getitem)

    def settled(self, seconds: float = 60.0) -> int:
        """The sample count once it has stopped moving for a second."""
        deadline, last = time.monotonic() + seconds, -1
        while self.samples != last and time.monotonic() < deadline:
            last = self.samples
            time.sleep(1.0)
        return self.samples


class CpuEndQueue(DeviceQueue):
    """DeviceQueue without its device end (no CPU kernel): the transfer itself is MindSpore's."""

    def _attach(self):
        return None


def shard_source(shards) -> ShardBatches:
    # one decode worker: decoding runs in this process, where the samples are counted
    return ShardBatches(shards, Tokenizer.openai(context_length=CTX),
                        PreprocessConfig(image_size=16), BATCH, LoaderSettings(seed=1, workers=1))


def test_a_sunk_run_sends_its_training_pipeline_once_and_nothing_decodes_after_its_end(
        shards, monkeypatch):
    counted = Counted(monkeypatch)
    source = shard_source(shards)  # 6 batches an epoch
    start, stop = 4, 9  # a resumed run's remaining batches, across an epoch boundary
    sunk = feed.sink_dataset(source, start, stop)
    assert counted.builds == 1 and counted.built[0] is sunk  # the shards' own pipeline, not
    # a second one around it (whose inner pipeline would be built later, by the engine)
    queue = CpuEndQueue(sunk, BatchSignature(BATCH, 16, CTX))
    sent = counted.settled()
    assert counted.builds == 1  # the pipeline itself, built once (no getter run first)
    assert sent == (stop - start) * BATCH  # exactly the run's batches, then the end
    transfer = queue.transfer._to_device  # MindSpore 2.10's sender (datasets._ToDevice)
    queue.close()
    assert not hasattr(transfer, "_runtime_context")  # released: MindSpore's release() ran
    queue.close()  # idempotent: the loop closes whatever feed it has
    time.sleep(1.0)
    assert counted.samples == sent


def test_a_real_batch_has_the_shapes_and_dtypes_of_the_sink_signature(shards):
    """The device queue is declared from the signature, before any batch exists: a batch of the
    real loader (one decode worker, tiny shards) and of the random source must match it exactly,
    NCHW uint8 images and int32 token rows."""
    signature = BatchSignature(BATCH, 16, CTX)  # as Training.feed builds it from the config
    random_source = RandomBatches(MICRO, BATCH, 2, seed=1)
    micro = BatchSignature(BATCH, MICRO.vision.image_size, MICRO.text.context_length)
    for source, want in ((shard_source(shards), signature), (random_source, micro)):
        batch = next(feed.sink_dataset(source, 0, 1).create_tuple_iterator(
            num_epochs=1, output_numpy=True))
        assert [tuple(column.shape) for column in batch] == want.shapes()
        assert [column.dtype for column in batch] == [
            np.dtype(ms.dtype_to_nptype(t)) for t in want.types()]


@pytest.mark.slow  # builds and iterates a MindSpore data pipeline with a transfer
def test_mindsporess_own_send_repeats_epochs_so_a_sunk_run_would_keep_decoding(
        shards, monkeypatch):
    # Why DeviceQueue sends once: mindspore.data_sink sends with -1 (epochs without end).
    counted = Counted(monkeypatch)
    transfer = shard_source(shards).dataset(4, 9).device_que(send_epoch_end=False)
    transfer.send(-1)
    try:
        assert counted.settled(seconds=5.0) > 5 * BATCH
    finally:
        transfer.stop_send()
        transfer.release()


class HostQueue:
    """Stands in for the device end of the queue (no CPU kernel): the dataset's batches, taken on
    the host in order, as GetNext would take them on the device."""

    closed: list[bool] = []

    def __init__(self, dataset, signature: BatchSignature) -> None:
        self.signature = signature
        self.batches = dataset.create_tuple_iterator(num_epochs=1, output_numpy=True)
        HostQueue.closed.append(False)

    def __call__(self):
        images, tokens = next(self.batches)
        assert [images.shape, tokens.shape] == self.signature.shapes()
        return ms.Tensor(images), ms.Tensor(tokens)

    def close(self) -> None:
        HostQueue.closed[-1] = True


@pytest.mark.slow  # compiles a training step and runs it through a sink feed
def test_a_sink_feed_gives_the_step_the_host_feeds_batches_and_closes_after_the_last(
        monkeypatch):
    cfg = TrainConfig(model=MICRO, batch_size=4, lr=1e-3, warmup_steps=1, accum_steps=2,
                      max_steps=3)
    source = RandomBatches(MICRO, 4, 4, seed=2)
    HostQueue.closed.clear()
    losses = {}
    for sink in (False, True):
        ms.set_seed(cfg.seed)
        run = Training.build(cfg, 3)
        run.step, run.data_sink = 1, sink  # resumed after one step: start from batch 2
        monkeypatch.setattr(feed, "DeviceQueue", HostQueue)
        _loop(run, source, 3, None, ())
        losses[sink] = [row["loss"] for row in run.history]
    assert losses[True] == losses[False] and len(losses[True]) == 2
    assert HostQueue.closed == [True]  # released after the run's last micro-batch
    signature = BatchSignature(4, MICRO.vision.image_size, MICRO.text.context_length)
    one = SinkFeed(lambda images, tokens, apply: images.shape, source, 0, 1, signature)
    assert one(True) == (4, 3, 16, 16) and HostQueue.closed[-1]
    with pytest.raises(RuntimeError, match="no further batch"):
        one(True)
