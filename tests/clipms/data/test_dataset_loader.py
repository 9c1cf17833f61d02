"""The training loader sized for its host: `train.workers: auto`, and the loader benchmark's
answer to "what do N devices need from this host"."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from clipms.data.decode import MAX_AUTO_WORKERS, DataError, loader_workers, usable_cores


def test_auto_shares_the_hosts_cores_between_its_ranks():
    # an Atlas 800 host (192 cores, 8 NPUs), a 64-core host, this kind of 2-core machine
    assert loader_workers("auto", local_ranks=8, cores=192) == MAX_AUTO_WORKERS
    assert loader_workers("auto", local_ranks=8, cores=64) == 8
    assert loader_workers("auto", local_ranks=1, cores=2) == 2
    assert loader_workers("auto", local_ranks=2, cores=2) == 1
    assert loader_workers("auto", local_ranks=4, cores=2) == 1  # never 0
    assert loader_workers(3, local_ranks=8, cores=192) == 3  # an explicit count is kept
    assert loader_workers("auto") == min(MAX_AUTO_WORKERS, usable_cores())
    assert usable_cores() == len(os.sched_getaffinity(0))
    for bad in ("many", -1, 2.5):
        with pytest.raises(DataError, match="expected 'auto' or an integer"):
            loader_workers(bad)


def test_each_rank_resolves_auto_from_the_cores_it_can_use():
    from clipms.train.feed import rank_loader_workers

    # unbound ranks share what the launcher had: 8 ranks on a 64-core host, 2 on this kind
    assert rank_loader_workers("auto", 8, launcher_cores=64, own_cores=64) == 8
    assert rank_loader_workers("auto", 2, launcher_cores=2, own_cores=2) == 1
    # a rank bound to cores of its own (msrun --bind_core, a cpuset per rank) uses all of them:
    # 3 cores of its own get 3 workers, not the 64 // 8 = 8 its launcher would have given it
    assert rank_loader_workers("auto", 8, launcher_cores=64, own_cores=3) == 3
    assert rank_loader_workers("auto", 8, launcher_cores=192, own_cores=24) == MAX_AUTO_WORKERS
    assert rank_loader_workers("auto", 4, launcher_cores=0, own_cores=8) == 2  # unknown: shared
    assert rank_loader_workers(5, 8, launcher_cores=64, own_cores=3) == 5  # a count is kept
    assert rank_loader_workers("auto") == loader_workers("auto")  # this process's own affinity
    with pytest.raises(DataError, match="expected 'auto' or an integer"):
        rank_loader_workers("many", 8, 64, 8)


def test_the_loader_line_sets_the_loaders_rate_beside_the_steps_and_warns_when_it_lags():
    from clipms.train.loop import loader_report

    line, bound = loader_report(samples=320, waited=4.0, elapsed=5.0, workers=2)
    assert bound and line == (
        "loader 80.0 samples/s while waited for (waited 4.00 s of 5.00 s), steps 64.0 "
        "samples/s on this rank: the device waits on data 80% of the time; raise train.workers "
        "(now 2) or decode on the device (train.decode, docs/ascend.md)")
    line, bound = loader_report(samples=320, waited=0.5, elapsed=5.0, workers=2)
    assert not bound and line.startswith("loader 640.0 samples/s while waited for (waited 0.50")
    line, bound = loader_report(samples=320, waited=0.0, elapsed=5.0)
    assert not bound and line.startswith("loader never waited for (waited 0.00 s of 5.00 s)")


@pytest.mark.slow  # trains: compiles a training step
def test_a_run_fed_slower_than_it_steps_says_so_in_its_first_steps(caplog):
    import logging
    import time

    from clipms.model.architecture import CLIPConfig, TextConfig, VisionConfig
    from clipms.runtime import RuntimeConfig
    from clipms.train.loop import RandomBatches, TrainConfig, train

    micro = CLIPConfig(
        embed_dim=16,
        vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1, head_width=16),
        text=TextConfig(context_length=8, vocab_size=40, width=32, heads=2, layers=1))

    class Slow(RandomBatches):
        """A loader that needs half a second a batch: far slower than a micro CLIP's step."""

        workers = 1

        def stream(self, start, stop):
            for batch in super().stream(start, stop):
                time.sleep(0.5)
                yield batch

    cfg = TrainConfig(model=micro, batch_size=4, max_steps=5, log_every=2, warmup_steps=1,
                      runtime=RuntimeConfig(kernel_fusion=False))
    with caplog.at_level(logging.INFO, logger="clipms.train.loop"):
        train(cfg, Slow(micro, 4, 5), None)
    lines = [r for r in caplog.records if "loader " in r.getMessage()]
    # after the first step (compilation), the reads at steps 2 and 4, and the last (5)
    assert [r.getMessage().split(":")[0] for r in lines] == ["step 2", "step 4", "step 5"]
    assert all(r.levelname == "WARNING" for r in lines)
    assert "the device waits on data" in lines[0].getMessage()
    assert "raise train.workers (now 1)" in lines[0].getMessage()


def test_train_params_accept_auto_or_a_count_and_name_anything_else():
    from pipeline.params import ParamsError, validate_section
    from stages.train import TrainParams

    assert validate_section("train", TrainParams, {}).workers == "auto"
    assert validate_section("train", TrainParams, {"workers": 4}).workers == 4
    for bad in ("lots", -2):
        with pytest.raises(ParamsError, match="train.workers"):
            validate_section("train", TrainParams, {"workers": bad})


def test_needs_turn_the_cpu_cost_per_sample_into_workers_and_cores():
    from benchmarks.throughput import loader_needs

    needs = loader_needs({"cpu_ms_per_sample": 5.0}, ranks=8, device_rate=414)
    assert needs == {"ranks": 8, "device_samples_per_s": 414, "host_samples_per_s": 3312,
                     "samples_per_s_per_core": 200.0, "workers_per_rank": 3, "busy_cores": 17}


def test_needs_refuse_a_cpu_cost_the_clock_did_not_resolve():
    from benchmarks.throughput import loader_needs

    with pytest.raises(ValueError, match="cpu_ms_per_sample must be positive"):
        loader_needs({"cpu_ms_per_sample": 0.0}, ranks=8, device_rate=414)


@pytest.mark.slow  # benchmarks the loader
def test_loader_benchmark_reports_per_worker_rates_and_what_the_devices_need(capsys):
    from benchmarks.throughput import main

    # Large source images, so decoding costs well over the 0.1 CPU-s the benchmark needs to size
    # a loader (a 48 px set used less than one 10 ms clock tick in CI and had no CPU cost at all).
    assert main(["loader", "--samples", "128", "--source-size", "512", "--image-size", "32",
                 "--batch-size", "8", "--warmup", "1", "--batches", "15", "--workers", "1",
                 "--ranks", "8", "--device-rate", "100"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["needs"] is not None, result.get("needs_unmeasured")
    assert result["samples_per_s_per_worker"] == pytest.approx(result["samples_per_s"], abs=0.1)
    needs = result["needs"]
    per_core = 1000 / result["cpu_ms_per_sample"]
    assert needs["samples_per_s_per_core"] == pytest.approx(per_core, rel=0.01)
    assert needs["workers_per_rank"] == math.ceil(100 / needs["samples_per_s_per_core"])
    assert needs["host_samples_per_s"] == 800


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from benchmarks.throughput import write_synthetic_shards

    return write_synthetic_shards(tmp_path_factory.mktemp("shards"), 32, 96, per_shard=16)


def _batches(shards, decode, **kw):
    from clipms.data.dataset import build_train_dataset
    from clipms.data.loading import LoaderSettings
    from clipms.data.preprocess import PreprocessConfig
    from clipms.text.clip_tokenizer import Tokenizer

    dataset = build_train_dataset(shards, Tokenizer.openai(16), PreprocessConfig(64), 8,
                                  LoaderSettings(workers=2, decode=decode, **kw), epochs=1)
    return list(dataset.create_tuple_iterator(num_epochs=1, output_numpy=True))


def test_mindspores_own_decoder_gives_the_same_batches_as_pil_up_to_resampling(shards):
    pil, native = _batches(shards, "pil"), _batches(shards, "cpu")
    assert len(pil) == len(native) == 4
    for (image_a, tokens_a), (image_b, tokens_b) in zip(pil, native, strict=True):
        assert image_a.shape == image_b.shape == (8, 3, 64, 64)
        assert image_a.dtype == image_b.dtype == np.uint8  # normalised by the train step
        np.testing.assert_array_equal(tokens_a, tokens_b)  # same samples, same order, same captions
        # OpenCV-style bicubic vs PIL's antialiased bicubic: edges differ, the image does not
        assert np.abs(image_a.astype(int) - image_b).mean() < 1.4  # grey levels


def test_device_decode_refuses_augment_and_unknown_decoders(shards):
    from clipms.data.decode import DataError

    with pytest.raises(DataError, match="does not augment"):
        _batches(shards, "cpu", augment=True)
    with pytest.raises(DataError, match="expected one of"):
        _batches(shards, "gpu")


def test_device_decode_reads_the_header_first_and_refuses_a_bomb(tmp_path):
    from clipms.data import webds
    from harness.hostile_images import png_header_bomb

    # 10^10 pixels claimed (over PIL's own limit) and 6.4 x 10^7 (over ours only)
    files = [(f"{i:06d}", {"png": png_header_bomb(*((100_000,) * 2 if i % 2 else (8000, 8000))),
                          "json": json.dumps({"captions": ["a bomb"]}).encode()})
             for i in range(8)]
    webds.write_manifest(tmp_path, 8, {"train": webds.write_split(tmp_path, "train", files, 8)})
    with pytest.raises(RuntimeError, match="over the pixel limit"):
        _batches(tmp_path, "cpu")


@pytest.mark.skipif(bool(os.path.exists("/dev/davinci0")), reason="this host has an Ascend NPU")
def test_ascend_decode_fails_loudly_where_there_is_no_npu(shards):
    # Not runnable here: DVPP needs an NPU. What can be shown is that it never falls back to the
    # CPU in silence: the first batch fails with MindSpore's own error.
    with pytest.raises(RuntimeError, match="Soc Version"):
        _batches(shards, "ascend")
