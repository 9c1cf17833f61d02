"""benchmarks/bench_serving.py end to end on a tiny bundle: real services on 127.0.0.1, the real
load client and real `python -m benchmarks.throughput encode` runs. What is checked is how the
service-vs-model ratio is measured (the model-alone "limit"), not the speed: the pinned mode's
service is started on the server CPU, and every batched text cell at concurrency 32 is paired with
a model-alone run on the CPUs and thread count the service had, in the same minute."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from harness.dvc_workspace import tool_env
from harness.tiny_model import jpeg_bytes, random_images

pytestmark = pytest.mark.slow  # its module fixture runs the benchmark: real services

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 2


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the pinned mode needs two CPUs")
    from clipms.deploy.infer import Encoder
    from clipms.deploy.search import SearchOptions
    from clipms.deploy.searchindex import Item, build_index, bundle_digest
    from harness.tiny_model import export_tiny_bundle

    root = tmp_path_factory.mktemp("bench-serving")
    bundle = export_tiny_bundle(root)
    items = [Item(f"img{i:02d}", jpeg_bytes(im), f"caption {i}", "val")
             for i, im in enumerate(random_images(8, seed=3, size=(40, 40)))]
    build_index(Encoder(bundle, kernel_fusion=False), items, root / "index",
                bundle_digest(bundle), SearchOptions(), thumbnail_size=16)
    out = root / "bench.json"
    # Fusion off in the services and the model-alone runs alike: the tiny graphs compile fast.
    env = {**tool_env(), "CLIPMS_KERNEL_FUSION": "0", "GLOG_v": "3",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_serving.py"), "--bundle", str(bundle),
         "--index", str(root / "index"), "--targets", "service", "--workloads", "text_embed",
         "--modes", "shared", "pinned", "--concurrency", "32", "--seconds", "1",
         "--rounds", str(ROUNDS), "--warmup-s", "0", "--limit-steps", "20",
         "--server-cpu", "1", "--client-cpu", "0", "--out", str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())["results"]


def test_pinned_service_starts_on_the_server_cpu(result: dict) -> None:
    assert result["server_cpus"] == {"service": sorted(os.sched_getaffinity(0)),
                                     "service@pinned": [1]}


@pytest.mark.parametrize("mode, cpus", [("shared", None), ("pinned", [1])])
def test_every_goal_cell_is_paired_with_the_model_alone(result: dict, mode: str, cpus) -> None:
    cpus = cpus or sorted(os.sched_getaffinity(0))
    cells = [c for c in result["cells"] if c["mode"] == mode]
    assert len(cells) == ROUNDS and all(c["errors"] == 0 and c["requests"] for c in cells)
    for cell in cells:
        limit = cell["limit"]
        # on the service's CPUs, with as many MindSpore threads, at the cell's mean batch
        assert limit["cpus"] == cpus and limit["threads"] == len(cpus)
        assert limit["batch_size"] == round(cell["mean_batch"]) and limit["steps"] == 20
        assert cell["vs_model_limit"] == round(cell["qps"] / limit["texts_per_s_mean"], 2)
    summary = result["summary"][mode]
    pairs = [c["vs_model_limit"] for c in cells]
    assert summary["vs_model_limit_pairs"] == pairs
    assert summary["vs_model_limit"] == round(statistics.median(pairs), 3)
    assert summary["model_runs"] == [c["limit"]["texts_per_s_mean"] for c in cells]
