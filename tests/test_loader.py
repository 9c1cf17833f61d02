"""The training loader sized for its host: `train.workers: auto`, and the loader benchmark's
answer to "what do N devices need from this host"."""

from __future__ import annotations

import json
import math
import os

import pytest

from clipms.data import MAX_AUTO_WORKERS, DataError, loader_workers, usable_cores


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


def test_train_params_accept_auto_or_a_count_and_name_anything_else():
    from clipms.params import ParamsError
    from stages.params import validate_section
    from stages.train import TrainParams

    assert validate_section("train", TrainParams, {}).workers == "auto"
    assert validate_section("train", TrainParams, {"workers": 4}).workers == 4
    for bad in ("lots", -2):
        with pytest.raises(ParamsError, match="train.workers"):
            validate_section("train", TrainParams, {"workers": bad})


def test_needs_turn_the_cpu_cost_per_sample_into_workers_and_cores():
    from clipms.bench import loader_needs

    needs = loader_needs({"cpu_ms_per_sample": 5.0}, ranks=8, device_rate=414)
    assert needs == {"ranks": 8, "device_samples_per_s": 414, "host_samples_per_s": 3312,
                     "samples_per_s_per_core": 200.0, "workers_per_rank": 3, "busy_cores": 17}


def test_loader_benchmark_reports_per_worker_rates_and_what_the_devices_need(capsys):
    from clipms.bench import main

    assert main(["loader", "--samples", "24", "--source-size", "48", "--image-size", "32",
                 "--batch-size", "8", "--warmup", "1", "--batches", "2", "--workers", "1",
                 "--ranks", "8", "--device-rate", "100"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["samples_per_s_per_worker"] == pytest.approx(result["samples_per_s"], abs=0.1)
    needs = result["needs"]
    per_core = 1000 / result["cpu_ms_per_sample"]
    assert needs["samples_per_s_per_core"] == pytest.approx(per_core, rel=0.01)
    assert needs["workers_per_rank"] == math.ceil(100 / needs["samples_per_s_per_core"])
    assert needs["host_samples_per_s"] == 800
